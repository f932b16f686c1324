//! Shared by the Python-oracle tests through `#[path]` (#19 item 1): their reference
//! outputs are committed as small golden files under `<crate>/tests/golden/`, written by
//! `scripts/regen-python-golden.sh` from the live oracle, so the comparison runs on any
//! machine. The live oracle runs as well when its Python packages are importable; this
//! module decides whether it should and how a missing package is reported.

use std::path::PathBuf;
use std::process::Command;

use sha2::{Digest, Sha256};

/// `DS4_REGEN_PYTHON_GOLDEN=1` (set by the regeneration script): the live-oracle test
/// writes the golden file from the oracle's output instead of only checking it.
pub fn regen() -> bool {
    std::env::var("DS4_REGEN_PYTHON_GOLDEN").is_ok_and(|v| v == "1")
}

/// `DS4_REQUIRE_PYTHON_TESTS=1` (CI): an oracle that cannot run is a failure.
pub fn required() -> bool {
    regen() || std::env::var("DS4_REQUIRE_PYTHON_TESTS").is_ok_and(|v| v == "1")
}

/// Whether the live oracle can run: `Ok` when `python3` imports every module, else why
/// not. The probe is separate from the oracle run so that a crashing oracle is a test
/// failure, never mistaken for a missing package.
pub fn python_modules(modules: &[&str]) -> Result<(), String> {
    if std::env::var("DS4_SKIP_PYTHON_TESTS").is_ok_and(|v| v == "1") && !required() {
        return Err("DS4_SKIP_PYTHON_TESTS=1".into());
    }
    let probe = format!("import {}", modules.join(", "));
    match Command::new("python3").arg("-c").arg(&probe).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "python3 cannot `{probe}`: {}",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
                .trim()
        )),
        Err(e) => Err(format!("python3 not runnable: {e}")),
    }
}

/// The committed golden file's path.
pub fn path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

pub fn read(name: &str) -> serde_json::Value {
    let p = path(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run scripts/regen-python-golden.sh to create it",
            p.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

pub fn write(name: &str, value: &serde_json::Value) {
    let p = path(name);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let mut text = serde_json::to_string_pretty(value).unwrap();
    text.push('\n');
    std::fs::write(&p, text).unwrap_or_else(|e| panic!("writing {}: {e}", p.display()));
    eprintln!("wrote {}", p.display());
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A 64-bit hash prefix: enough to tell groups apart, small enough to keep hundreds of
/// them in a few KB.
pub fn short_hash(bytes: &[u8]) -> String {
    sha256_hex(bytes)[..16].to_string()
}

/// The entries of the JSON arrays `want[key]` and `got[key]` side by side with their
/// index, up to the shorter array; panics naming `key` where either is not an array.
pub fn pairs<'a>(
    want: &'a serde_json::Value,
    got: &'a serde_json::Value,
    key: &str,
) -> impl Iterator<Item = (usize, &'a serde_json::Value, &'a serde_json::Value)> {
    let arr = |v: &'a serde_json::Value| {
        v[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key} is not an array"))
    };
    arr(want)
        .iter()
        .zip(arr(got))
        .enumerate()
        .map(|(i, (a, b))| (i, a, b))
}

/// The `pairs` that differ.
pub fn mismatches<'a>(
    want: &'a serde_json::Value,
    got: &'a serde_json::Value,
    key: &str,
) -> impl Iterator<Item = (usize, &'a serde_json::Value, &'a serde_json::Value)> {
    pairs(want, got, key).filter(|(_, a, b)| a != b)
}

/// The message of a live-oracle test that could not run: a failure when required.
pub fn cannot_run(what: &str, why: &str) {
    assert!(
        !required(),
        "{what}: {why} (DS4_REQUIRE_PYTHON_TESTS=1; pip install -r .ci/requirements.txt)"
    );
}
