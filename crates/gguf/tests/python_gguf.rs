//! Bit-for-bit cross-check of our dequantisation against the reference `gguf` Python
//! package (`gguf==0.19.0`, numpy; pinned in `.ci/requirements.txt`).
//!
//! ≥ 10,000 random blocks per type are written to a temp directory, ONE `python3`
//! process dequantises all of them with `gguf.quants.dequantize`, and every output f32
//! must have the same bits as ours. Scales are finite f16 (zero and subnormal ones
//! included); the quantised payload bytes are uniformly random. Q8_K is not checked
//! here: the Python package has no Q8_K dequantiser.
//!
//! Without python3 + gguf the test fails, unless `DS4_SKIP_PYTHON_TESTS=1`.

#[path = "../../../tests-support/record_skip.rs"]
mod record_skip;
use record_skip::record_skip;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::random_blocks;
use ds4_gguf::{quant, GgmlType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const BLOCKS: usize = 10_000;

const SCRIPT: &str = r#"
import sys, numpy as np, gguf
from gguf.quants import dequantize
from gguf.constants import GGMLQuantizationType as T
d = sys.argv[1]
assert gguf.__name__ == "gguf"
for name in sys.argv[2:]:
    raw = np.fromfile(f"{d}/{name}.bin", dtype=np.uint8)
    out = dequantize(raw, T[name]).astype(np.float32, copy=False)
    np.ascontiguousarray(out).reshape(-1).tofile(f"{d}/{name}.f32")
print("ok", np.__version__)
"#;

fn f16_scale(rng: &mut StdRng) -> u16 {
    let sign = (rng.random::<u16>() & 1) << 15;
    match rng.random_range(0..10) {
        0 => sign,
        1 | 2 => sign | rng.random_range(1..0x400),
        3 => sign | rng.random_range(0x400..0x7c00),
        _ => sign | rng.random_range(0x1400..0x3c00),
    }
}

fn python_skipped() -> bool {
    std::env::var("DS4_SKIP_PYTHON_TESTS").is_ok_and(|v| v == "1")
}

fn tmp_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("ds4-gguf-pycheck-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn read_f32(path: &Path) -> Vec<u32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// numpy converts a signalling f16 NaN to a signalling f32 NaN; `half` and x86 F16C
/// (like ggml's CPU conversion) quiet it. Sign and payload must still agree; only the
/// quiet bit may differ, and only for NaN inputs (F16 payload bytes are random).
fn same_nan_modulo_quiet_bit(a: u32, b: u32) -> bool {
    const QUIET: u32 = 0x0040_0000;
    f32::from_bits(a).is_nan() && f32::from_bits(b).is_nan() && (a | QUIET) == (b | QUIET)
}

#[test]
fn dequantize_matches_python_gguf_bit_for_bit() {
    if python_skipped() {
        record_skip("DS4_SKIP_PYTHON_TESTS=1: no gguf Python cross-check");
        return;
    }
    let mut rng = StdRng::seed_from_u64(0x6767_7566);
    let types = [
        // F16/BF16 "blocks" are single elements: 32 per generated block.
        (GgmlType::F16, 32 * BLOCKS),
        (GgmlType::BF16, 32 * BLOCKS),
        (GgmlType::Q8_0, BLOCKS),
        (GgmlType::Q2_K, BLOCKS),
        (GgmlType::Q4_K, BLOCKS),
        (GgmlType::IQ2_XXS, BLOCKS),
    ];
    let dir = tmp_dir();
    let mut data = Vec::new();
    for (ty, n) in types {
        let b = random_blocks(&mut rng, ty, n, f16_scale);
        std::fs::write(dir.join(format!("{}.bin", ty.name())), &b).unwrap();
        data.push((ty, n, b));
    }
    let out = Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .arg(&dir)
        .args(types.iter().map(|(t, _)| t.name()))
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run python3 ({e}); install gguf==0.19.0 or set DS4_SKIP_PYTHON_TESTS=1")
        });
    assert!(
        out.status.success(),
        "python3 gguf dequantize failed (pip install -r .ci/requirements.txt, or set \
         DS4_SKIP_PYTHON_TESTS=1):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (ty, n, bytes) in &data {
        let n_elems = n * ty.block_elems();
        let ours = quant::dequantize_to_vec(*ty, bytes, n_elems).unwrap();
        let theirs = read_f32(&dir.join(format!("{}.f32", ty.name())));
        assert_eq!(theirs.len(), n_elems, "{ty}: python output length");
        let mut mismatches = 0;
        for (i, (a, &b)) in ours.iter().zip(&theirs).enumerate() {
            if a.to_bits() != b && !same_nan_modulo_quiet_bit(a.to_bits(), b) {
                if mismatches < 5 {
                    let blk = i / ty.block_elems();
                    let bb = ty.block_bytes();
                    eprintln!(
                        "{ty} element {i}: ours {a:e} ({:#010x}), gguf {:e} ({b:#010x}); block {:02x?}",
                        a.to_bits(),
                        f32::from_bits(b),
                        &bytes[blk * bb..blk * bb + bb.min(16)]
                    );
                }
                mismatches += 1;
            }
        }
        assert_eq!(
            mismatches, 0,
            "{ty}: {mismatches} of {n_elems} values differ"
        );
        eprintln!("{ty}: {n_elems} values identical");
    }
    std::fs::remove_dir_all(&dir).ok();
}
