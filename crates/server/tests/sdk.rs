//! The official OpenAI and Anthropic Python SDKs against the `ds4-server` binary
//! (pinned in .ci/requirements.txt). Fails when the packages are missing, unless
//! DS4_SKIP_PYTHON_TESTS=1.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use common::{record_skip, root, stop, temp_dir};

fn skip() -> bool {
    if std::env::var("DS4_SKIP_PYTHON_TESTS").as_deref() == Ok("1") {
        record_skip("DS4_SKIP_PYTHON_TESTS=1: the Python SDK tests");
        return true;
    }
    false
}

/// Starts the binary on an ephemeral port with `paths` (flags with path values) and the
/// whitespace-separated `flags`, and returns it with its base URL.
fn start(paths: &[&str], flags: &str) -> (Child, String) {
    // Each instance gets its own process lock (the default lock file admits one).
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let lock = std::env::temp_dir().join(format!(
        "ds4-sdk-{}-{}.lock",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let mut child = Command::new(env!("CARGO_BIN_EXE_ds4-server"))
        .env("DS4_LOCK_FILE", &lock)
        .args(["--port", "0"])
        .args(paths)
        .args(flags.split_whitespace())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ds4-server");
    let err = child.stderr.take().unwrap();
    let mut lines = BufReader::new(err).lines();
    let url = loop {
        let line = lines
            .next()
            .expect("server exited before it was ready")
            .expect("stderr");
        eprintln!("{line}");
        // "ready", not "listening": the port is bound before the model loads.
        if let Some(u) = line.split("ready on ").nth(1) {
            break u.trim().to_string();
        }
    };
    std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            eprintln!("{l}")
        }
    });
    (child, url)
}

fn run_sdk(url: &str, extra: &[&str]) {
    let out = Command::new("python3")
        .arg(root().join("crates/server/tests/py/sdk_test.py"))
        .args(["--base-url", url])
        .args(extra)
        .output()
        .expect("python3");
    eprintln!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "SDK test failed (install with: pip install -r .ci/requirements.txt, or set DS4_SKIP_PYTHON_TESTS=1)");
}

#[test]
fn python_sdks_against_the_fake_engine() {
    if skip() {
        return;
    }
    let dir = temp_dir("sdk-kv");
    let tj = root().join("fixtures/tiny/tokenizer.json");
    let d = dir.to_str().unwrap();
    let paths = ["--fake-engine", tj.to_str().unwrap(), "--kv-disk-dir", d];
    let (child, url) = start(&paths, "--ctx 4096 --kv-cache-min-tokens 16");
    run_sdk(&url, &["--kv-dir", d]);
    stop(child);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn python_sdks_against_the_tiny_model() {
    if skip() {
        return;
    }
    let model = root().join("fixtures/tiny/tiny-q2.gguf");
    let (child, url) = start(&["-m", model.to_str().unwrap()], "--cpu --ctx 4096 -n 24");
    run_sdk(&url, &["--no-tools"]);
    stop(child);
}
