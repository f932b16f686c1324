//! The conversion itself: every planned tensor read from the checkpoint, dequantised
//! exactly to f32 and encoded to its target type, written at its offset in
//! `OUT.partial`, which is renamed to `OUT` at the end.
//!
//! Memory stays bounded: dense tensors go in chunks of rows, expert stacks one expert
//! at a time (both spread over all cores with rayon), and the checkpoint pages of a
//! finished tensor are dropped. A run that stops can be started again with the same
//! arguments: `OUT.partial.done` lists the tensors already written (after an fsync),
//! under a fingerprint of the planned header, and those are skipped.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use ds4_engine::dev::layout::TensorSpec;
use ds4_gguf::quant::{quantize_weights, quantize_weights_imatrix};
use ds4_gguf::write_at;
use ds4_gguf::GgmlType;
use rayon::prelude::*;

use crate::formats::{dequant_fp4, dequant_fp8_rows, e8m0_to_f32, plain_to_f32, FP8_BLOCK};
use crate::hf::{Checkpoint, HfTensor};
use crate::imatrix::Importance;
use crate::names::{self, Source};
use crate::plan::Plan;

/// Values per dense work item (rows are never split).
const CHUNK_VALUES: usize = 1 << 22;

/// `OUT.partial` and its progress list `OUT.partial.done`.
pub fn partial_paths(out: &Path) -> (PathBuf, PathBuf) {
    let mut p = out.as_os_str().to_owned();
    p.push(".partial");
    let partial = PathBuf::from(p);
    let mut d = partial.as_os_str().to_owned();
    d.push(".done");
    (partial, PathBuf::from(d))
}

/// The first line of `OUT.partial.done`: which planned header the listed tensors belong to.
pub fn fingerprint(header: &[u8]) -> String {
    let h = header.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    format!("ds4-quantize {h:016x} {}", header.len())
}

/// Converts the checkpoint into `out` as planned. `progress` gets the bytes of each
/// finished piece (tensor data skipped on a restart included).
pub fn write(
    ck: &Checkpoint,
    plan: &Plan,
    importance: Option<&Importance>,
    out: &Path,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<()> {
    let (partial, done_path) = partial_paths(out);
    let fp = fingerprint(&plan.layout.header);
    let mut done = vec![false; plan.specs.len()];
    let resumable = partial.exists()
        && std::fs::read_to_string(&done_path)
            .map(|t| {
                let mut lines = t.lines();
                if lines.next() != Some(fp.as_str()) {
                    return false;
                }
                for l in lines {
                    if let Ok(i) = l.trim().parse::<usize>() {
                        if i < done.len() {
                            done[i] = true;
                        }
                    }
                }
                true
            })
            .unwrap_or(false);
    if !resumable {
        done.iter_mut().for_each(|d| *d = false);
    }
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&partial)
        .with_context(|| format!("cannot create {}", partial.display()))?;
    if !resumable {
        file.set_len(0)?;
    }
    file.set_len(plan.layout.file_size).with_context(|| {
        format!(
            "cannot size {} to {} bytes (disk full?)",
            partial.display(),
            plan.layout.file_size
        )
    })?;
    write_at(&file, &plan.layout.header, 0)?;
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&done_path)
        .with_context(|| format!("cannot create {}", done_path.display()))?;
    if !resumable {
        log.set_len(0)?;
        writeln!(log, "{fp}")?;
    }
    progress(plan.layout.header.len() as u64);
    for (i, spec) in plan.specs.iter().enumerate() {
        let off = plan.layout.tensor_offsets[i];
        if done[i] {
            progress(plan.layout.tensor_sizes[i]);
            continue;
        }
        write_tensor(ck, plan, spec, importance, &file, off, progress)
            .with_context(|| format!("converting {}", spec.name))?;
        file.sync_data()?;
        writeln!(log, "{i}")?;
        log.flush()?;
    }
    file.sync_all()?;
    drop(file);
    std::fs::rename(&partial, out)
        .with_context(|| format!("cannot rename {} to {}", partial.display(), out.display()))?;
    let _ = std::fs::remove_file(&done_path);
    Ok(())
}

/// One tensor, written at `off`.
fn write_tensor(
    ck: &Checkpoint,
    plan: &Plan,
    spec: &TensorSpec,
    importance: Option<&Importance>,
    file: &File,
    off: u64,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<()> {
    let ty = spec.published;
    let cols = spec.dims[0] as usize;
    match names::source(&spec.name).context("no checkpoint name")? {
        Source::Tensor(name) => {
            let t = ck.tensor(&name)?;
            let rows = t.n_elements() / cols;
            let row_bytes = ty.row_bytes(cols).context("partial block")?;
            if let Some(bytes) = exact_bytes(ck, t, ty)? {
                write_at(file, &bytes, off)?;
                progress(bytes.len() as u64);
            } else {
                let step = (CHUNK_VALUES / cols).max(1);
                let chunks: Vec<Range<usize>> = (0..rows)
                    .step_by(step)
                    .map(|r| r..(r + step).min(rows))
                    .collect();
                chunks.par_iter().try_for_each(|r| -> Result<()> {
                    let x = rows_f32(ck, &name, t, cols, r.clone())?;
                    let q = quantize_weights(ty, &x)?;
                    write_at(file, &q, off + (r.start * row_bytes) as u64)?;
                    progress(q.len() as u64);
                    Ok(())
                })?;
            }
            ck.release(t);
        }
        Source::Experts { layer, part } => {
            let rows = spec.dims[1] as usize;
            let n_expert = plan.config.n_expert;
            let per = rows * ty.row_bytes(cols).context("partial block")?;
            (0..n_expert)
                .into_par_iter()
                .try_for_each(|e| -> Result<()> {
                    let name = names::expert_name(layer, e, part);
                    let x = expert_f32(ck, &name, rows, cols)?;
                    let qw = match importance {
                        Some(im) => im.expert(&spec.name, &name, e, cols, n_expert)?,
                        None => None,
                    };
                    let q = match (qw, ty) {
                        (Some(w), _) => quantize_weights_imatrix(ty, &x, w)?,
                        // IQ2_XXS is only good with an importance: without one, the
                        // reference's fallback, each column's energy Σ_rows x².
                        (None, GgmlType::IQ2_XXS) => {
                            quantize_weights_imatrix(ty, &x, &column_energy(&x, cols))?
                        }
                        (None, _) => quantize_weights(ty, &x)?,
                    };
                    ensure!(
                        q.len() == per,
                        "expert {e}: {} bytes, expected {per}",
                        q.len()
                    );
                    write_at(file, &q, off + (e * per) as u64)?;
                    for n in [name.clone()].into_iter().chain(names::scale_names(&name)) {
                        if let Some(t) = ck.get(&n) {
                            ck.release(t);
                        }
                    }
                    progress(q.len() as u64);
                    Ok(())
                })?;
        }
    }
    Ok(())
}

/// `Σ_rows x²` per column (the IQ2_XXS fallback importance).
pub fn column_energy(x: &[f32], cols: usize) -> Vec<f32> {
    let mut w = vec![0.0f32; cols];
    for row in x.chunks_exact(cols) {
        for (a, v) in w.iter_mut().zip(row) {
            *a += v * v;
        }
    }
    // An all-zero column would weigh nothing anywhere; keep it representable.
    let floor = w.iter().fold(0.0f32, |m, &v| m.max(v)) * 1e-6;
    w.iter_mut()
        .for_each(|v| *v = v.max(floor).max(f32::MIN_POSITIVE));
    w
}

/// The target bytes when no rounding is involved: a float tensor stored in its own
/// type (byte-exact) and the hash table's integers.
fn exact_bytes(ck: &Checkpoint, t: &HfTensor, ty: GgmlType) -> Result<Option<Vec<u8>>> {
    let b = ck.bytes(t);
    Ok(match (t.dtype.as_str(), ty) {
        ("F32", GgmlType::F32) | ("F16", GgmlType::F16) | ("BF16", GgmlType::BF16) => {
            Some(b.to_vec())
        }
        ("I32", GgmlType::I32) => Some(b.to_vec()),
        ("I64", GgmlType::I32) => {
            let mut o = Vec::with_capacity(b.len() / 2);
            for c in b.chunks_exact(8) {
                let v = i64::from_le_bytes(c.try_into().expect("8 bytes"));
                let v = i32::try_from(v).with_context(|| format!("value {v} out of i32 range"))?;
                o.extend_from_slice(&v.to_le_bytes());
            }
            Some(o)
        }
        (d, GgmlType::I32) => bail!("dtype {d} for an integer tensor"),
        _ => None,
    })
}

/// Rows `rows` of a dense tensor viewed as `[rows][cols]`, dequantised to f32.
pub fn rows_f32(
    ck: &Checkpoint,
    name: &str,
    t: &HfTensor,
    cols: usize,
    rows: Range<usize>,
) -> Result<Vec<f32>> {
    let b = ck.bytes(t);
    let mut v = Vec::with_capacity(rows.len() * cols);
    match t.dtype.as_str() {
        "F8_E4M3" => {
            let scale = fp8_scale(ck, name, t.n_elements() / cols, cols)?;
            dequant_fp8_rows(b, cols, rows, &|r, c| scale.get(r, c), &mut v);
        }
        d @ ("F32" | "F16" | "BF16") => {
            let w = if d == "F32" { 4 } else { 2 };
            v = plain_to_f32(d, &b[rows.start * cols * w..rows.end * cols * w])?;
        }
        d => bail!("{name}: dtype {d} cannot be dequantised"),
    }
    Ok(v)
}

/// A decoded FP8 block-scale grid.
struct Grid {
    vals: Vec<f32>,
    cols: usize,
}

impl Grid {
    fn get(&self, r: usize, c: usize) -> f32 {
        self.vals[r * self.cols + c]
    }
}

/// The scales of FP8 weight `name` (`[rows][cols]`): `[⌈rows/128⌉][⌈cols/128⌉]`,
/// UE8M0 as the official checkpoint stores them, or F32/BF16 inverse scales.
fn fp8_scale(ck: &Checkpoint, name: &str, rows: usize, cols: usize) -> Result<Grid> {
    let [a, b] = names::scale_names(name);
    let (sn, s) = match (ck.get(&a), ck.get(&b)) {
        (Some(s), _) => (a, s),
        (None, Some(s)) => (b, s),
        _ => bail!("{name} is FP8 but has no {a}"),
    };
    let (gr, gc) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
    ensure!(
        s.n_elements() == gr * gc,
        "{sn}: {:?} scales for a [{rows}, {cols}] weight (expected [{gr}, {gc}])",
        s.shape
    );
    let bytes = ck.bytes(s);
    let vals = match s.dtype.as_str() {
        "F8_E8M0" | "U8" | "I8" => bytes.iter().map(|&e| e8m0_to_f32(e)).collect(),
        d @ ("F32" | "BF16" | "F16") => plain_to_f32(d, bytes)?,
        d => bail!("{sn}: scale dtype {d} is not supported"),
    };
    Ok(Grid { vals, cols: gc })
}

/// One routed expert's matrix `[rows][cols]` as f32: FP4 packed (`I8`/`U8`
/// `[rows][cols/2]` with UE8M0 `.scale` `[rows][cols/32]`), FP8 or plain floats.
pub fn expert_f32(ck: &Checkpoint, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>> {
    let t = ck.tensor(name)?;
    match t.dtype.as_str() {
        "I8" | "U8" | "F4" => {
            ensure!(
                t.n_elements() * if t.dtype == "F4" { 1 } else { 2 } == rows * cols,
                "{name}: shape {:?} for a [{rows}, {cols}] expert",
                t.shape
            );
            let [sn, _] = names::scale_names(name);
            let s = ck.tensor(&sn)?;
            ensure!(
                matches!(s.dtype.as_str(), "F8_E8M0" | "U8" | "I8"),
                "{sn}: scale dtype {}",
                s.dtype
            );
            dequant_fp4(ck.bytes(t), ck.bytes(s), rows, cols).with_context(|| name.to_string())
        }
        _ => {
            ensure!(
                t.n_elements() == rows * cols,
                "{name}: shape {:?} for a [{rows}, {cols}] expert",
                t.shape
            );
            rows_f32(ck, name, t, cols, 0..rows)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;

    /// Every unquantised source stored in its own type is copied byte for byte; the
    /// hash table's I64 becomes I32 exactly (and out-of-range values are refused).
    #[test]
    fn unquantised_types_are_copied_byte_for_byte() {
        let dir = std::env::temp_dir().join(format!("ds4-convert-exact-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f16: Vec<u8> = [0x3c00u16, 0x0001, 0x8400, 0x7bff]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let bf16: Vec<u8> = [0x3f80u16, 0x0001, 0xff7f, 0x4049]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let f32b: Vec<u8> = [1.5f32, -0.0, 1e-40, 3.0e38]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let i64b: Vec<u8> = [0i64, 7, 255, -1]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let big: Vec<u8> = [1i64 << 40].iter().flat_map(|v| v.to_le_bytes()).collect();
        let views = vec![
            (
                "a".to_string(),
                TensorView::new(Dtype::F16, vec![4], &f16).unwrap(),
            ),
            (
                "b".to_string(),
                TensorView::new(Dtype::BF16, vec![2, 2], &bf16).unwrap(),
            ),
            (
                "c".to_string(),
                TensorView::new(Dtype::F32, vec![4], &f32b).unwrap(),
            ),
            (
                "d".to_string(),
                TensorView::new(Dtype::I64, vec![2, 2], &i64b).unwrap(),
            ),
            (
                "e".to_string(),
                TensorView::new(Dtype::I64, vec![1], &big).unwrap(),
            ),
        ];
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let t = |n: &str| ck.tensor(n).unwrap();
        let ex = |n: &str, ty| exact_bytes(&ck, t(n), ty).unwrap();
        assert_eq!(ex("a", GgmlType::F16).unwrap(), f16);
        assert_eq!(ex("b", GgmlType::BF16).unwrap(), bf16);
        assert_eq!(ex("c", GgmlType::F32).unwrap(), f32b);
        let i32b: Vec<u8> = [0i32, 7, 255, -1]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(ex("d", GgmlType::I32).unwrap(), i32b);
        assert!(exact_bytes(&ck, t("e"), GgmlType::I32).is_err());
        // A type change goes through the quantiser path instead (values, not bytes).
        assert!(ex("b", GgmlType::F32).is_none());
        let v = rows_f32(&ck, "b", t("b"), 2, 0..2).unwrap();
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1].to_bits(), 0x0001_0000);
        assert_eq!(v[3].to_bits(), 0x4049_0000);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
