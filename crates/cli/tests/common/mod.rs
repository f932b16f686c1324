//! Helpers shared by the end-to-end tests of the binaries on the tiny fixture model.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny")
}

/// The tiny IQ2_XXS fixture model.
pub fn model() -> PathBuf {
    fixtures().join("tiny-q2.gguf")
}

/// A fresh scratch directory named after the test binary, this process and `name`.
pub fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "{}-{}-{name}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `contents` to `dir/name`; returns the path.
pub fn write_file(dir: &Path, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, contents).unwrap();
    p
}

/// A path named `name` in this test binary's scratch directory (made for this process).
pub fn tmp_file(name: &str) -> PathBuf {
    tmp_dir("files").join(name)
}

/// Runs `ds4-tool` with `args`: (success, stdout, stderr).
pub fn tool(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ds4-tool"))
        .args(args)
        .output()
        .unwrap();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// Runs `ds4-tool` with `args`, asserting that it succeeds; returns its stdout.
pub fn tool_ok(args: &[&str]) -> String {
    let (ok, out, err) = tool(args);
    assert!(ok, "ds4-tool {args:?}: {err}");
    out
}

/// Runs `ds4-tool` with `args`, asserting that it fails; returns its stderr.
pub fn tool_err(args: &[&str]) -> String {
    let (ok, out, err) = tool(args);
    assert!(!ok, "ds4-tool {args:?} succeeded: {out}");
    err
}

/// Runs `ds4-tool synth --dims <dims>` followed by `extra`, asserting that it succeeds;
/// returns its stdout.
pub fn synth(dims: &str, extra: &[&str]) -> String {
    let mut args = vec!["synth", "--dims", dims];
    args.extend_from_slice(extra);
    tool_ok(&args)
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// A raw little-endian f32 file.
pub fn read_f32(p: &Path) -> Vec<f32> {
    std::fs::read(p)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}
