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
