//! The `ds4-server` binary as a process: the process lock and the KV-directory lock
//! (server.md §3), and how reference flags without an implementation are reported.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{root, stop, temp_dir};

/// A fresh, existing scratch directory.
fn temp(tag: &str) -> PathBuf {
    let d = temp_dir(tag);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn command(lock: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ds4-server"));
    c.env("DS4_LOCK_FILE", lock)
        .arg("--fake-engine")
        .arg(root().join("fixtures/tiny/tokenizer.json"))
        .args(["--port", "0"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// Starts a server and waits for its `listening` line; returns it and its stderr so far.
fn start(lock: &Path, args: &[&str]) -> (Child, String) {
    let mut child = command(lock, args).spawn().expect("start ds4-server");
    let err = child.stderr.take().unwrap();
    let mut lines = BufReader::new(err).lines();
    let mut log = String::new();
    loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("server exited before listening:\n{log}"))
            .expect("stderr");
        log.push_str(&line);
        log.push('\n');
        if line.contains("listening on ") {
            break;
        }
    }
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    (child, log)
}

/// Runs a server that is expected to exit by itself; returns (status, stderr).
fn run_to_exit(lock: &Path, args: &[&str]) -> (Option<i32>, String) {
    let mut child = command(lock, args).spawn().expect("start ds4-server");
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (st.code(), err);
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("ds4-server {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_second_server_on_the_same_lock_file_exits_2_and_stale_locks_are_taken_over() {
    let d = temp("lock");
    let lock = d.join("ds4.lock");
    let (a, _) = start(&lock, &[]);
    let (code, err) = run_to_exit(&lock, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "another ds4 process is already running (pid {})",
            a.id()
        )),
        "{err}"
    );
    assert!(err.contains("DS4_LOCK_FILE"), "{err}");
    stop(a);
    // The file stays behind with a dead pid: a new server takes it over.
    assert!(lock.exists());
    std::fs::write(&lock, "4194303\n").unwrap();
    let (b, _) = start(&lock, &[]);
    assert_eq!(
        std::fs::read_to_string(&lock).unwrap().trim(),
        b.id().to_string()
    );
    stop(b);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn two_servers_cannot_share_a_kv_cache_directory() {
    let d = temp("kvdir");
    let kv = d.join("kv");
    let kv_s = kv.to_str().unwrap();
    let (a, _) = start(&d.join("a.lock"), &["--kv-disk-dir", kv_s]);
    let (code, err) = run_to_exit(&d.join("b.lock"), &["--kv-disk-dir", kv_s]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("the KV cache directory {kv_s} is in use")),
        "{err}"
    );
    assert!(err.contains(&format!("(pid {})", a.id())), "{err}");
    stop(a);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn unimplemented_reference_flags_warn_or_fail_by_name() {
    let d = temp("flags");
    let lock = d.join("ds4.lock");
    let (a, log) = start(
        &lock,
        &[
            "--mtp",
            "mtp.gguf",
            "--mtp-draft",
            "2",
            "--dir-steering-ffn",
            "0.5",
            "--warm-weights",
        ],
    );
    for want in [
        "warning: --mtp mtp.gguf: MTP speculative decoding is not implemented",
        "warning: --mtp-draft/--mtp-margin are ignored",
        "warning: --dir-steering-ffn/--dir-steering-attn have no effect without --dir-steering-file",
        "warning: --warm-weights",
    ] {
        assert!(log.contains(want), "missing {want:?} in:\n{log}");
    }
    stop(a);
    // Steering changes the answers: refused rather than ignored.
    let (code, err) = run_to_exit(&lock, &["--dir-steering-file", "dirs.f32"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--dir-steering-file dirs.f32: directional steering is not implemented"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
