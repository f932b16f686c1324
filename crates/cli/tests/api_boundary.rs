//! The programs that face users — `ds4-server` and the `ds4` chat binary — use only the
//! engine's narrow API (docs/architecture.md §2): no device crate, no GGUF internals,
//! no `ds4_engine::dev`. A new `use` of those in their sources fails here, so the
//! boundary cannot erode unnoticed.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every line of the sources under `dirs` (relative to the workspace root) that names
/// one of `forbidden`.
fn offending_lines(dirs: &[&str], forbidden: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    for d in dirs {
        rust_files(&root.join(d), &mut files);
    }
    assert!(!files.is_empty(), "no sources found under {dirs:?}");
    let mut bad = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read source");
        for (i, line) in text.lines().enumerate() {
            if forbidden.iter().any(|p| line.contains(p)) {
                bad.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    bad
}

const INTERNALS: &[&str] = &["ds4_cuda", "ds4_gguf", "ds4_engine::dev"];

/// Fails, listing the offending lines, when the sources under `dir` name an internal.
fn assert_narrow_api(dir: &str, who: &str) {
    let bad = offending_lines(&[dir], INTERNALS);
    assert!(
        bad.is_empty(),
        "engine internals in {who}:\n{}",
        bad.join("\n")
    );
}

#[test]
fn server_uses_only_the_narrow_engine_api() {
    assert_narrow_api("crates/server/src", "the server");
}

#[test]
fn chat_binary_uses_only_the_narrow_engine_api() {
    assert_narrow_api("crates/cli/src/bin/ds4", "`ds4`");
}

#[test]
fn the_server_crate_does_not_depend_on_device_or_gguf_crates() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../server/Cargo.toml"))
            .expect("server manifest");
    for dep in ["ds4-cuda", "ds4-gguf"] {
        assert!(
            !manifest.lines().any(|l| l.trim_start().starts_with(dep)),
            "crates/server/Cargo.toml depends on {dep}"
        );
    }
}
