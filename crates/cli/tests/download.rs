//! `ds4-tool download` end to end against a scripted HTTP server on 127.0.0.1: full
//! download, resume, dropped connections, servers that ignore Range, 401/404, 416 on a
//! complete `.part`, the skip of an existing file, the `ds4flash.gguf` link and the token.
//! Nothing here touches the internet.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

const REPO_PATH: &str = "/antirez/deepseek-v4-gguf/resolve/main/";
const MTP: &str = "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf";
const Q2: &str = "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf";

/// What the server does with the next request; once the script is empty it serves
/// normally.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// Answer with this status and no body.
    Status(u16),
    /// Start the normal answer but close the connection after this many body bytes.
    Cut(usize),
    /// Start the normal answer, send this many body bytes, then hang (a stalled link,
    /// for interrupting the client mid-transfer).
    Stall(usize),
}

#[derive(Default)]
struct State {
    files: HashMap<String, Arc<Vec<u8>>>,
    script: VecDeque<Step>,
    /// Answer every request with 200 and the whole file, like a server without Range.
    ignore_range: bool,
    /// Answer every request with this status.
    always: Option<u16>,
    /// Send `/resolve/main/F` to `/cdn/F` with a 302 first, like huggingface.co.
    redirect: bool,
    /// Leave Content-Range out of 416 answers, so the client must ask with HEAD.
    bare_416: bool,
    /// Announce this Content-Length in 200 answers instead of the real one.
    claim_len: Option<u64>,
    requests: Vec<Request>,
}

#[derive(Clone, Debug)]
struct Request {
    method: String,
    path: String,
    range: Option<String>,
    auth: Option<String>,
}

struct Server {
    port: u16,
    state: Arc<Mutex<State>>,
}

impl Server {
    fn start(files: &[(&str, Vec<u8>)]) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(State {
            files: files
                .iter()
                .map(|(n, d)| (n.to_string(), Arc::new(d.clone())))
                .collect(),
            ..State::default()
        }));
        let st = state.clone();
        // The accept loop lives as long as the test process; each test has its own port.
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let st = st.clone();
                std::thread::spawn(move || serve(conn, &st));
            }
        });
        Server { port, state }
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        f(&mut self.state.lock().unwrap())
    }

    fn requests(&self) -> Vec<Request> {
        self.with(|s| s.requests.clone())
    }
}

fn serve(conn: TcpStream, st: &Mutex<State>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let (mut range, mut auth) = (None, None);
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            match k.trim().to_ascii_lowercase().as_str() {
                "range" => range = Some(v.trim().to_string()),
                "authorization" => auth = Some(v.trim().to_string()),
                _ => {}
            }
        }
    }

    let (step, data, ignore_range, always, redirect, bare_416, claim_len) = {
        let mut s = st.lock().unwrap();
        s.requests.push(Request {
            method: method.clone(),
            path: path.clone(),
            range: range.clone(),
            auth,
        });
        let name = path
            .strip_prefix(REPO_PATH)
            .or_else(|| path.strip_prefix("/cdn/"))
            .unwrap_or("");
        let redirect = s.redirect && path.starts_with(REPO_PATH);
        let step = if redirect { None } else { s.script.pop_front() };
        (
            step,
            s.files.get(name).cloned(),
            s.ignore_range,
            s.always,
            redirect,
            s.bare_416,
            s.claim_len,
        )
    };

    let head = |status: &str, extra: &str, len: u64| {
        format!("HTTP/1.1 {status}\r\n{extra}Content-Length: {len}\r\nConnection: close\r\n\r\n")
    };
    let status_only = |code: u16| {
        let reason = match code {
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "Not Found",
            500 => "Internal Server Error",
            503 => "Service Unavailable",
            _ => "Whatever",
        };
        head(&format!("{code} {reason}"), "", 0)
    };
    let mut out = conn;
    if let Some(code) = always.or(match step {
        Some(Step::Status(c)) => Some(c),
        _ => None,
    }) {
        let _ = out.write_all(status_only(code).as_bytes());
        return;
    }
    if redirect {
        let name = &path[REPO_PATH.len()..];
        let _ =
            out.write_all(head("302 Found", &format!("Location: /cdn/{name}\r\n"), 0).as_bytes());
        return;
    }
    let Some(data) = data else {
        let _ = out.write_all(status_only(404).as_bytes());
        return;
    };
    let total = data.len();
    let start = match range.as_deref().and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) if !ignore_range => r.trim_end_matches('-').parse::<usize>().unwrap(),
        _ => 0,
    };
    let header = if start >= total && start > 0 {
        let range = if bare_416 {
            String::new()
        } else {
            format!("Content-Range: bytes */{total}\r\n")
        };
        let h = head("416 Range Not Satisfiable", &range, 0);
        let _ = out.write_all(h.as_bytes());
        return;
    } else if start > 0 {
        head(
            "206 Partial Content",
            &format!("Content-Range: bytes {start}-{}/{total}\r\n", total - 1),
            (total - start) as u64,
        )
    } else {
        head("200 OK", "", claim_len.unwrap_or(total as u64))
    };
    let _ = out.write_all(header.as_bytes());
    if method == "HEAD" {
        return;
    }
    let body = &data[start..];
    let body = match step {
        Some(Step::Cut(k) | Step::Stall(k)) => &body[..k.min(body.len())],
        _ => body,
    };
    let _ = out.write_all(body);
    let _ = out.flush();
    if let Some(Step::Stall(_)) = step {
        std::thread::sleep(std::time::Duration::from_secs(30));
    }
    // Dropping the stream closes it; with Cut that is mid-body, which the client must
    // see as a short read.
}

/// Deterministic bytes that are not a GGUF and have no repeating period a resume bug
/// could hide behind.
fn payload(n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A test's scratch folder under cargo's target tmp dir, emptied first (a folder per
/// process id in the system temp dir was never removed: 7 MB left behind a test a run).
fn tempdir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("ds4-download-test-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A partial download of MTP under `cwd/gguf/` (where `download mtp` resumes).
fn write_part(cwd: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(cwd.join("gguf")).unwrap();
    std::fs::write(cwd.join("gguf").join(format!("{MTP}.part")), bytes).unwrap();
}

struct Run {
    ok: bool,
    out: String,
    err: String,
}

/// Runs `ds4-tool download` in `cwd` with an environment scrubbed of anything that
/// could send a real token or reach the real server.
/// A payload of `len` bytes and a server that serves it as the MTP file.
fn mtp_server(len: usize) -> (Vec<u8>, Server) {
    let data = payload(len);
    let server = Server::start(&[(MTP, data.clone())]);
    (data, server)
}

/// Asserts that the MTP file downloaded into `cwd` is `data`.
fn assert_saved(cwd: &Path, data: &[u8]) {
    assert_eq!(std::fs::read(cwd.join("gguf").join(MTP)).unwrap(), data);
}

fn run(cwd: &Path, server: &Server, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ds4-tool"));
    cmd.current_dir(cwd)
        .arg("download")
        .args(args)
        .args(["--base-url", &server.base(), "--retry-delay-ms", "5"])
        .env_remove("HF_TOKEN")
        .env_remove("HF_HOME")
        .env_remove("DS4_GGUF_DIR")
        .env_remove("DS4_DOWNLOAD_BASE_URL")
        // The retry warnings the tests look for are log events: default level.
        .env_remove("RUST_LOG")
        .env("HOME", cwd.join("home"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().unwrap();
    Run {
        ok: o.status.success(),
        out: String::from_utf8_lossy(&o.stdout).into_owned(),
        err: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

/// `run`, which must fail with a message that contains each of `says`; returns that
/// message (stderr) for further checks.
fn refused(
    cwd: &Path,
    server: &Server,
    args: &[&str],
    env: &[(&str, &str)],
    says: &[&str],
) -> String {
    let r = run(cwd, server, args, env);
    assert!(!r.ok, "{}\n{}", r.out, r.err);
    for s in says {
        assert!(r.err.contains(s), "{s:?} missing from:\n{}", r.err);
    }
    r.err
}

fn tiny_gguf() -> Vec<u8> {
    std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny/tiny-q2.gguf"))
        .unwrap()
}

#[test]
fn full_download_verifies_and_links() {
    let data = tiny_gguf();
    let server = Server::start(&[(Q2, data.clone())]);
    let cwd = tempdir("full");
    let r = run(&cwd, &server, &["q2-imatrix"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    let dest = cwd.join("gguf").join(Q2);
    assert_eq!(std::fs::read(&dest).unwrap(), data);
    assert!(!cwd.join("gguf").join(format!("{Q2}.part")).exists());
    assert!(r.out.contains("Verified GGUF v3:"), "{}", r.out);
    assert!(r.out.contains("Linked ./ds4flash.gguf"), "{}", r.out);
    let link = cwd.join("ds4flash.gguf");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        std::fs::read_link(&link).unwrap(),
        Path::new("gguf").join(Q2)
    );
    assert_eq!(std::fs::read(&link).unwrap(), data);
    let reqs = server.requests();
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!(reqs[0].path, format!("{REPO_PATH}{Q2}"));
    assert_eq!(reqs[0].range, None);
    assert_eq!(reqs[0].auth, None);
}

#[test]
fn resumes_from_partial_file_with_range() {
    let (data, server) = mtp_server(300_000);
    let cwd = tempdir("resume");
    std::fs::create_dir_all(cwd.join("dl")).unwrap();
    std::fs::write(cwd.join("dl").join(format!("{MTP}.part")), &data[..123_457]).unwrap();
    let r = run(&cwd, &server, &["mtp", "--dir", "dl", "--no-verify"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert!(r.out.contains("resuming"), "{}", r.out);
    assert!(r.out.contains("resumed after 120.56 KiB"), "{}", r.out);
    assert_eq!(std::fs::read(cwd.join("dl").join(MTP)).unwrap(), data);
    let reqs = server.requests();
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!(reqs[0].range.as_deref(), Some("bytes=123457-"));
    // MTP is an add-on: the main model link is left alone and the hint printed.
    assert!(!cwd.join("ds4flash.gguf").exists());
    assert!(r.out.contains("--mtp dl/"), "{}", r.out);
    // Our flags: one draft per step by default, which the reference calls --mtp-draft 2.
    assert!(r.out.contains("ds4-server --mtp dl/"), "{}", r.out);
    assert!(!r.out.contains("--mtp-draft 2 "), "{}", r.out);
}

#[test]
fn dropped_connection_is_resumed_by_retry() {
    let (data, server) = mtp_server(200_000);
    server.with(|s| s.script.push_back(Step::Cut(70_000)));
    let cwd = tempdir("drop");
    let r = run(&cwd, &server, &["mtp", "--no-verify"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert!(r.err.contains("retrying"), "{}", r.err);
    assert_saved(&cwd, &data);
    let reqs = server.requests();
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    assert_eq!(reqs[0].range, None);
    assert_eq!(reqs[1].range.as_deref(), Some("bytes=70000-"));
}

#[test]
fn retry_warnings_are_log_events() {
    // `RUST_LOG` filters them like any tracing event; the download itself is unchanged.
    for (filter, shown) in [("off", false), ("warn", true)] {
        let (data, server) = mtp_server(50_000);
        server.with(|s| s.script.push_back(Step::Cut(10_000)));
        let cwd = tempdir(&format!("log-{filter}"));
        let r = run(
            &cwd,
            &server,
            &["mtp", "--no-verify"],
            &[("RUST_LOG", filter)],
        );
        assert!(r.ok, "{}\n{}", r.out, r.err);
        assert_eq!(
            r.err.contains("retrying"),
            shown,
            "RUST_LOG={filter}: {}",
            r.err
        );
        assert_saved(&cwd, &data);
    }
}

#[test]
fn connection_dropping_again_and_again_still_finishes() {
    // More drops than --retries: each one made progress, so none exhausts the budget.
    let (data, server) = mtp_server(100_000);
    server.with(|s| s.script.extend([Step::Cut(20_000); 4]));
    let cwd = tempdir("drops");
    let r = run(
        &cwd,
        &server,
        &["mtp", "--no-verify", "--retries", "2"],
        &[],
    );
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert_saved(&cwd, &data);
    let ranges: Vec<_> = server.requests().into_iter().map(|r| r.range).collect();
    let want: Vec<Option<String>> = [None, Some(20_000), Some(40_000), Some(60_000), Some(80_000)]
        .into_iter()
        .map(|o| o.map(|n| format!("bytes={n}-")))
        .collect();
    assert_eq!(ranges, want);
}

#[test]
fn transient_server_errors_are_retried_then_give_up() {
    let (data, server) = mtp_server(10_000);
    server.with(|s| s.script.extend([Step::Status(503), Step::Status(500)]));
    let cwd = tempdir("5xx");
    let r = run(&cwd, &server, &["mtp", "--no-verify"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert_saved(&cwd, &data);
    assert_eq!(server.requests().len(), 3);

    server.with(|s| s.always = Some(503));
    let cwd = tempdir("5xx-forever");
    refused(
        &cwd,
        &server,
        &["mtp", "--retries", "2"],
        &[],
        &["run the same command again to resume"],
    );
    assert_eq!(server.requests().len(), 3 + 3);
}

#[test]
fn server_ignoring_range_restarts_from_zero() {
    let (data, server) = mtp_server(50_000);
    server.with(|s| s.ignore_range = true);
    let cwd = tempdir("norange");
    // Garbage in the partial file proves it was discarded, not appended to.
    write_part(&cwd, &[0xAA; 9_999]);
    let r = run(&cwd, &server, &["mtp", "--no-verify"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert!(r.err.contains("ignored the range request"), "{}", r.err);
    assert!(!r.out.contains("resumed after"), "{}", r.out);
    assert_saved(&cwd, &data);
    let reqs = server.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].range.as_deref(), Some("bytes=9999-"));
}

#[test]
fn complete_part_file_is_finished_on_416() {
    let (data, server) = mtp_server(4_096);
    let cwd = tempdir("416");
    write_part(&cwd, &data);
    let r = run(&cwd, &server, &["mtp", "--no-verify"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert_saved(&cwd, &data);
    assert!(!cwd.join("gguf").join(format!("{MTP}.part")).exists());
    assert_eq!(server.requests()[0].range.as_deref(), Some("bytes=4096-"));
}

#[test]
fn complete_part_file_without_content_range_is_checked_with_head() {
    let (data, server) = mtp_server(4_096);
    server.with(|s| s.bare_416 = true);
    let cwd = tempdir("416-head");
    write_part(&cwd, &data);
    let r = run(&cwd, &server, &["mtp", "--no-verify"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert_saved(&cwd, &data);
    let methods: Vec<_> = server.requests().into_iter().map(|r| r.method).collect();
    assert_eq!(methods, ["GET", "HEAD"]);
}

#[test]
fn longer_part_file_than_remote_is_restarted() {
    let (data, server) = mtp_server(4_096);
    let cwd = tempdir("416-long");
    write_part(&cwd, &payload(5_000));
    let r = run(&cwd, &server, &["mtp", "--no-verify"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert_saved(&cwd, &data);
    let ranges: Vec<_> = server.requests().into_iter().map(|r| r.range).collect();
    assert_eq!(ranges, [Some("bytes=5000-".to_string()), None]);
}

#[test]
fn not_found_names_the_file() {
    let server = Server::start(&[]);
    let cwd = tempdir("404");
    refused(
        &cwd,
        &server,
        &["q4-imatrix"],
        &[],
        &["HTTP 404", "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix.gguf"],
    );
    // Not retried: the answer will not change.
    assert_eq!(server.requests().len(), 1);
    assert!(!cwd.join("ds4flash.gguf").exists());
}

#[test]
fn unauthorized_mentions_the_token() {
    let server = Server::start(&[(MTP, payload(100))]);
    server.with(|s| s.always = Some(401));
    let cwd = tempdir("401");
    refused(
        &cwd,
        &server,
        &["mtp"],
        &[],
        &["HTTP 401", "HF_TOKEN", "--token"],
    );
    assert_eq!(server.requests().len(), 1);

    let err = refused(
        &cwd,
        &server,
        &["mtp", "--token", "wrong"],
        &[],
        &["token that was sent was refused"],
    );
    assert!(
        !err.contains("wrong"),
        "the token must not be printed: {err}"
    );
}

#[test]
fn token_header_from_option_env_and_file() {
    let data = payload(1_000);
    let server = Server::start(&[(MTP, data)]);
    let auth = |server: &Server| server.requests().last().unwrap().auth.clone();

    let cwd = tempdir("token-opt");
    let r = run(
        &cwd,
        &server,
        &["mtp", "--no-verify", "--token", "opt"],
        &[("HF_TOKEN", "env")],
    );
    assert!(r.ok, "{}", r.err);
    assert_eq!(auth(&server).as_deref(), Some("Bearer opt"));

    let cwd = tempdir("token-env");
    let r = run(
        &cwd,
        &server,
        &["mtp", "--no-verify"],
        &[("HF_TOKEN", "env")],
    );
    assert!(r.ok, "{}", r.err);
    assert_eq!(auth(&server).as_deref(), Some("Bearer env"));

    let cwd = tempdir("token-file");
    std::fs::create_dir_all(cwd.join("home/.cache/huggingface")).unwrap();
    std::fs::write(cwd.join("home/.cache/huggingface/token"), "hf_file\n").unwrap();
    let r = run(&cwd, &server, &["mtp", "--no-verify"], &[]);
    assert!(r.ok, "{}", r.err);
    assert_eq!(auth(&server).as_deref(), Some("Bearer hf_file"));
    assert!(!r.out.contains("hf_file") && !r.err.contains("hf_file"));
}

#[test]
fn redirect_keeps_the_range() {
    let (data, server) = mtp_server(30_000);
    server.with(|s| s.redirect = true);
    let cwd = tempdir("redirect");
    write_part(&cwd, &data[..1_000]);
    let r = run(&cwd, &server, &["mtp", "--no-verify"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert_saved(&cwd, &data);
    let reqs = server.requests();
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    assert_eq!(reqs[1].path, format!("/cdn/{MTP}"));
    assert_eq!(reqs[1].range.as_deref(), Some("bytes=1000-"));
}

#[test]
fn existing_final_file_is_skipped() {
    let server = Server::start(&[(Q2, tiny_gguf())]);
    let cwd = tempdir("skip");
    std::fs::create_dir_all(cwd.join("models")).unwrap();
    std::fs::write(cwd.join("models").join(Q2), b"not fetched again").unwrap();
    let r = run(
        &cwd,
        &server,
        &["q2-imatrix", "--no-verify"],
        &[("DS4_GGUF_DIR", "models")],
    );
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert!(r.out.contains("Already downloaded"), "{}", r.out);
    assert!(server.requests().is_empty());
    assert_eq!(
        std::fs::read_link(cwd.join("ds4flash.gguf")).unwrap(),
        Path::new("models").join(Q2)
    );
}

#[test]
fn link_is_replaced_but_a_regular_file_is_not() {
    let server = Server::start(&[(Q2, tiny_gguf())]);
    let cwd = tempdir("link");
    std::os::unix::fs::symlink("somewhere/else.gguf", cwd.join("ds4flash.gguf")).unwrap();
    let r = run(&cwd, &server, &["q2-imatrix"], &[]);
    assert!(r.ok, "{}\n{}", r.out, r.err);
    assert!(r.out.contains("Relinked ./ds4flash.gguf"), "{}", r.out);
    assert_eq!(
        std::fs::read_link(cwd.join("ds4flash.gguf")).unwrap(),
        Path::new("gguf").join(Q2)
    );
    // No temporary link is left behind.
    let names: Vec<_> = std::fs::read_dir(&cwd)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");

    let cwd = tempdir("link-file");
    std::fs::write(cwd.join("ds4flash.gguf"), b"a real model").unwrap();
    refused(&cwd, &server, &["q2-imatrix"], &[], &["is not a symlink"]);
    assert_eq!(
        std::fs::read(cwd.join("ds4flash.gguf")).unwrap(),
        b"a real model"
    );
    // The download itself completed and is kept.
    assert!(cwd.join("gguf").join(Q2).exists());
}

#[test]
fn a_file_that_is_not_gguf_fails_verification_and_is_not_linked() {
    let server = Server::start(&[(Q2, payload(10_000))]);
    let cwd = tempdir("notgguf");
    refused(
        &cwd,
        &server,
        &["q2-imatrix"],
        &[],
        &["is not a readable GGUF file"],
    );
    assert!(!cwd.join("ds4flash.gguf").exists());
}

// #19 item 4: the announced size is checked against the free space before any byte is
// written; the refusal is final (no retries) and leaves no empty .part behind.
#[test]
fn a_file_larger_than_the_free_space_is_refused_before_writing() {
    let server = Server::start(&[(MTP, payload(1000))]);
    server.with(|s| s.claim_len = Some(1 << 60));
    let cwd = tempdir("nospace");
    let needs = format!("needs {} bytes", 1u64 << 60);
    refused(
        &cwd,
        &server,
        &["mtp"],
        &[],
        &["not enough disk space", &needs],
    );
    assert!(!cwd.join("gguf").join(format!("{MTP}.part")).exists());
    assert_eq!(server.requests().len(), 1, "a refusal is not retried");
}

/// Starts `ds4-tool download mtp` against a server that stalls after `k` body bytes,
/// waits until the `.part` file has them, sends SIGINT; returns (status, stderr, part).
fn interrupt_after(tag: &str, k: usize) -> (Option<i32>, String, PathBuf) {
    let server = Server::start(&[(MTP, payload(4096))]);
    server.with(|s| s.script.push_back(Step::Stall(k)));
    let cwd = tempdir(tag);
    let part = cwd.join("gguf").join(format!("{MTP}.part"));
    let child = Command::new(env!("CARGO_BIN_EXE_ds4-tool"))
        .current_dir(&cwd)
        .args(["download", "mtp", "--base-url", &server.base()])
        .env_remove("HF_TOKEN")
        .env("HOME", cwd.join("home"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while std::fs::metadata(&part).map_or(true, |m| m.len() < k as u64) {
        assert!(
            t0.elapsed().as_secs() < 20,
            "no {} after 20 s",
            part.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: kill(2) on the child's pid, which has not been waited for yet.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let o = child.wait_with_output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
        part,
    )
}

// #19 item 4: Ctrl+C keeps the bytes fetched so far for the next run (they resume) and
// removes a .part file that has none.
#[test]
fn ctrl_c_keeps_fetched_bytes_and_removes_an_empty_part() {
    let (code, err, part) = interrupt_after("sigint-bytes", 1000);
    assert_eq!(code, Some(130), "{err}");
    assert!(
        err.contains("interrupted") && err.contains("resume"),
        "{err}"
    );
    assert_eq!(std::fs::read(&part).unwrap(), payload(4096)[..1000]);
    let (code, err, part) = interrupt_after("sigint-empty", 0);
    assert_eq!(code, Some(130), "{err}");
    assert!(
        !part.exists(),
        "an empty {} was left behind",
        part.display()
    );
}
