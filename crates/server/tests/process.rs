//! The `ds4-server` binary as a process: the process lock and the KV-directory lock
//! (server.md §3), how reference flags without an implementation are reported, and
//! start-up (the port bound first, /health "loading" until the model is ready).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{root, stop, temp_dir, write_mtp_file, TINY_MODEL};

/// A fresh, existing scratch directory, removed when the test ends (also on a panic).
struct Temp(PathBuf);

impl std::ops::Deref for Temp {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp(tag: &str) -> Temp {
    let d = temp_dir(tag);
    std::fs::create_dir_all(&d).unwrap();
    Temp(d)
}

fn command(lock: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ds4-server"));
    c.env("DS4_LOCK_FILE", lock)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // The fake engine unless a model is given.
    if !args.contains(&"-m") {
        c.arg("--fake-engine")
            .arg(root().join("fixtures/tiny/tokenizer.json"));
    }
    if !args.contains(&"--port") {
        c.args(["--port", "0"]);
    }
    c
}

/// Reads `lines` into `log` until one contains `want`; returns that line.
fn wait_for_line(
    lines: &mut impl Iterator<Item = std::io::Result<String>>,
    log: &mut String,
    want: &str,
) -> String {
    loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("server exited before {want:?}:\n{log}"))
            .expect("stderr");
        log.push_str(&line);
        log.push('\n');
        if line.contains(want) {
            return line;
        }
    }
}

/// Starts a server and waits for its `ready` line; returns it and its stderr so far.
fn start(lock: &Path, args: &[&str]) -> (Child, String) {
    let mut child = command(lock, args).spawn().expect("start ds4-server");
    let err = child.stderr.take().unwrap();
    let mut lines = BufReader::new(err).lines();
    let mut log = String::new();
    wait_for_line(&mut lines, &mut log, "ready on ");
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
}

#[test]
fn unimplemented_reference_flags_warn_or_fail_by_name() {
    let d = temp("flags");
    let lock = d.join("ds4.lock");
    // The files must exist (#19 item 4: input files are checked at start-up).
    let mtp = d.join("mtp.gguf");
    let dirs = d.join("dirs.f32");
    std::fs::write(&mtp, b"").unwrap();
    std::fs::write(&dirs, b"").unwrap();
    let (mtp, dirs) = (mtp.to_str().unwrap(), dirs.to_str().unwrap());
    let (a, log) = start(
        &lock,
        &[
            "--mtp",
            mtp,
            "--mtp-draft",
            "2",
            "--dir-steering-file",
            dirs,
            "--dir-steering-ffn",
            "-0.5",
            "--warm-weights",
        ],
    );
    for want in [
        &format!("warning: --mtp {mtp}: the fake engine has no MTP block"),
        &format!("warning: --dir-steering-file {dirs}: the fake engine cannot be steered"),
        "warning: --warm-weights",
    ] {
        assert!(log.contains(want), "missing {want:?} in:\n{log}");
    }
    stop(a);
    // A steering scale without directions is refused, as the reference does.
    let (code, err) = run_to_exit(&lock, &["--dir-steering-attn", "1"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--dir-steering-ffn/--dir-steering-attn need --dir-steering-file"),
        "{err}"
    );
    let (code, err) = run_to_exit(&lock, &["--metal"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not available in this build"), "{err}");
}

/// Directional steering on a real (tiny) model: a file of the model's shape is loaded
/// with the reference's default scales or the given ones; a file of another size is
/// refused with its name and both sizes.
#[test]
fn steering_flags_load_directions_for_the_model() {
    let d = temp("steer");
    let lock = d.join("ds4.lock");
    let model = root().join(TINY_MODEL);
    let m = model.to_str().unwrap();
    // The tiny model: 6 layers of 256.
    let (n_layer, n_embd) = (6usize, 256usize);
    let good = d.join("good.f32");
    let mut dirs = vec![0u8; n_layer * n_embd * 4];
    for il in 0..n_layer {
        let i = (il * n_embd + il) * 4;
        dirs[i..i + 4].copy_from_slice(&1.0f32.to_le_bytes());
    }
    std::fs::write(&good, &dirs).unwrap();
    let g = good.to_str().unwrap();
    let (a, log) = start(&lock, &["-m", m, "--cpu", "--dir-steering-file", g]);
    assert!(
        log.contains(&format!("directional steering: {g} ffn=1 attn=0")),
        "{log}"
    );
    stop(a);
    let (a, log) = start(
        &lock,
        &[
            "-m",
            m,
            "--cpu",
            "--dir-steering-file",
            g,
            "--dir-steering-ffn",
            "-1",
            "--dir-steering-attn",
            "0.5",
        ],
    );
    assert!(log.contains("ffn=-1 attn=0.5"), "{log}");
    stop(a);
    let bad = d.join("bad.f32");
    std::fs::write(&bad, &dirs[4..]).unwrap();
    let b = bad.to_str().unwrap();
    let (code, err) = run_to_exit(&lock, &["-m", m, "--cpu", "--dir-steering-file", b]);
    assert_eq!(code, Some(1), "{err}");
    let want = format!(
        "steering file {b}: {} bytes, expected {}",
        dirs.len() - 4,
        dirs.len()
    );
    assert!(err.contains(&want), "{err}");
}

// #19 item 4: path flags are checked before the port is bound or the model loads, with
// clap's wording and status 2.
#[test]
fn bad_path_flags_exit_2_before_the_load() {
    let d = temp("paths");
    let lock = d.join("ds4.lock");
    let lock_s = lock.to_str().unwrap().to_string();
    let missing = d.join("missing");
    let m = missing.to_str().unwrap();
    let out_in_missing = format!("{m}/out.txt");
    let file = d.join("file");
    std::fs::write(&file, b"x").unwrap();
    let f = file.to_str().unwrap();
    let sub_of_file = format!("{f}/kv");
    let cases: &[(&[&str], &str)] = &[
        (&["-m", m], "for '--model <MODEL>': no such file"),
        (
            &["-m", d.to_str().unwrap()],
            "for '--model <MODEL>': it is a directory",
        ),
        (&["--mtp", m], "for '--mtp <MTP>': no such file"),
        (
            &["--api-key-file", m],
            "for '--api-key-file <PATH>': no such file",
        ),
        (
            &["--dir-steering-file", m],
            "for '--dir-steering-file <DIR_STEERING_FILE>': no such file",
        ),
        (&["--trace", &out_in_missing], "does not exist"),
        (
            &["--trace", &lock_s[..lock_s.len() - "/ds4.lock".len()]],
            "it is a directory",
        ),
        (
            &["--kv-disk-dir", f],
            "for '--kv-disk-dir <KV_DISK_DIR>': not a directory",
        ),
        (&["--kv-disk-dir", &sub_of_file], "not a directory"),
        (&["--chdir", m], "for '--chdir <CHDIR>': no such directory"),
    ];
    for (args, want) in cases {
        // `command` adds the fake engine unless -m is given.
        let t0 = Instant::now();
        let (code, err) = run_to_exit(&lock, args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.starts_with("error: invalid value '"), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: want {want:?} in {err}");
        assert!(!err.contains("listening on"), "{args:?}: {err}");
        assert!(t0.elapsed() < Duration::from_secs(10), "{args:?}");
    }
    // A missing model says where the weights come from.
    let (_, err) = run_to_exit(&lock, &["-m", m]);
    assert!(err.contains("ds4-tool download q2-imatrix"), "{err}");
    // An output directory that does not exist yet is created: accepted.
    let (a, _) = start(
        &lock,
        &["--kv-disk-dir", &format!("{}/new/kv", d.display())],
    );
    stop(a);
}

/// The address in a `listening on http://ADDR ...` line.
fn addr_of(line: &str) -> std::net::SocketAddr {
    let rest = line.split("http://").nth(1).expect("url in line");
    rest.split_whitespace()
        .next()
        .unwrap()
        .parse()
        .expect("address")
}

// #19 item 3: the port is bound before the load; meanwhile /health answers 503
// "loading" with a progress value and the API answers 503 in its own error shape, a
// progress line is logged every few seconds; once loaded, /health is 200.
#[test]
fn health_says_loading_until_the_fake_engine_is_ready() {
    loading_then_ready("loading-fake", &[]);
}

// #19 item 3, with the tiny synthetic model on the CPU backend.
#[test]
fn health_says_loading_until_the_tiny_model_is_ready() {
    let model = root().join("fixtures/tiny/tiny-q2.gguf");
    let m = model.to_str().unwrap();
    loading_then_ready("loading-tiny", &["-m", m, "--cpu", "--ctx", "4096"]);
}

fn loading_then_ready(tag: &str, extra: &[&str]) {
    let d = temp(tag);
    let mut args = vec!["--fake-load-ms", "7000"];
    args.extend_from_slice(extra);
    let mut child = command(&d.join("ds4.lock"), &args)
        .spawn()
        .expect("start ds4-server");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = String::new();
    let addr = addr_of(&wait_for_line(&mut lines, &mut log, "listening on "));
    let h = common::get(addr, "/health");
    assert_eq!(h.status, 503, "{}", h.text());
    let v = h.json();
    assert_eq!(v["status"], "loading", "{v}");
    let p = v["progress"].as_f64().expect("progress number");
    assert!((0.0..=1.0).contains(&p), "{v}");
    let m = common::post(
        addr,
        "/v1/messages",
        &serde_json::json!({"max_tokens": 4, "messages": []}),
    );
    assert_eq!(m.status, 503);
    assert_eq!(m.json()["type"], "error", "{}", m.text());
    let c = common::post(
        addr,
        "/v1/chat/completions",
        &serde_json::json!({"messages": []}),
    );
    assert_eq!(c.status, 503);
    assert!(c.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("loading"));
    wait_for_line(&mut lines, &mut log, "ready on ");
    assert!(log.contains("loading: "), "no progress line:\n{log}");
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    let h = common::get(addr, "/health");
    assert_eq!(h.status, 200, "{}", h.text());
    assert_eq!(h.json()["status"], "ok");
    stop(child);
}

// #19 item 3: a busy port fails at once, not after a (here 10-minute) load.
#[test]
fn a_busy_port_fails_before_loading() {
    let d = temp("busyport");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let (code, err) = run_to_exit(
        &d.join("ds4.lock"),
        &["--port", &port, "--fake-load-ms", "600000"],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cannot listen on 127.0.0.1:"), "{err}");
}

#[test]
fn mtp_loads_a_matching_block_and_refuses_another_models() {
    let d = temp("mtp");
    let lock = d.join("ds4.lock");
    let model = root().join(TINY_MODEL);
    let model = model.to_str().unwrap();
    let wrong = write_mtp_file(&d, Some(512));
    let wrong = wrong.to_str().unwrap();
    let (code, err) = run_to_exit(&lock, &["-m", model, "--cpu", "--mtp", wrong]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "--mtp {wrong}: cannot use this MTP file with {model}"
        )),
        "{err}"
    );
    assert!(err.contains("mtp.0."), "the reason names the tensor: {err}");

    let good = write_mtp_file(&d, None);
    let good = good.to_str().unwrap();
    let (a, log) = start(
        &lock,
        &[
            "-m",
            model,
            "--cpu",
            "--mtp",
            good,
            "--mtp-draft",
            "2",
            "--mtp-margin",
            "0",
        ],
    );
    assert!(
        log.contains(&format!(
            "mtp {good}: speculative decoding, 2 drafts per cycle, margin 0"
        )),
        "{log}"
    );
    assert!(!log.contains("warning: --mtp"), "{log}");
    stop(a);

    // Without --mtp the draft options do nothing: said so.
    let (a, log) = start(&lock, &["--mtp-margin", "2"]);
    assert!(
        log.contains("warning: --mtp-draft/--mtp-margin have no effect without --mtp"),
        "{log}"
    );
    stop(a);
}
