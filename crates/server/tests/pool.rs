//! The session pool and continuous batching (#21), on the CPU: the real engine on
//! fixtures/tiny/tiny-q2.gguf (Exact numerics) where tokens must match, the fake engine
//! (with a per-token delay) where only the worker's scheduling is under test.
//!
//! Batches are made deterministic with `Shared::pause_admission`: requests are queued
//! while admission is paused and released together, so the worker admits them in one
//! iteration of its loop.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use ds4_engine::{BackendChoice, Engine, EngineOptions, Numerics};
use ds4_server::config::KvDiskConfig;
use ds4_server::engine::RealEngine;
use ds4_server::{ServerConfig, TestServer};
use serde_json::{json, Value};

fn real(cfg: ServerConfig) -> TestServer {
    let engine = Engine::open(
        root().join("fixtures/tiny/tiny-q2.gguf"),
        EngineOptions {
            backend: BackendChoice::Cpu { threads: None },
            numerics: Numerics::Exact,
            ..EngineOptions::default()
        },
    )
    .expect("tiny model");
    let tok = engine.tokenizer().expect("tokenizer");
    let session = engine.new_session(cfg.ctx).expect("session");
    TestServer::start(cfg, tok, Box::new(RealEngine::new(&engine, session)))
}

fn pool_cfg(sessions: usize) -> ServerConfig {
    let mut c = ServerConfig::for_tests(1024);
    c.max_sessions = Some(sessions);
    c
}

/// A greedy chat request (no thinking: the thinking mode forces its own sampling).
fn greedy(user: &str, max_tokens: usize) -> Value {
    json!({"model": "deepseek-chat", "temperature": 0, "max_tokens": max_tokens,
           "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": user}]})
}

fn content(r: &Value) -> String {
    r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {r}"))
        .to_string()
}

fn cached(r: &Value) -> u64 {
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached tokens: {r}"))
}

/// The value of a metric line `name` (with its labels, if any) in `/metrics`.
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = get(addr, "/metrics").text();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|r| r.strip_prefix(' '))
                .map(|v| v.parse::<f64>().expect("metric value"))
        })
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
}

/// Waits (bounded) until `n` requests are queued.
fn wait_queued(addr: SocketAddr, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(addr, "ds4_requests_queued") < n {
        assert!(Instant::now() < deadline, "requests never got queued");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits (bounded) until no request runs: every row was freed.
fn wait_idle(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(addr, "ds4_requests_running") > 0.0 {
        assert!(Instant::now() < deadline, "requests still running");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// N concurrent greedy clients get exactly the tokens each gets alone, and the worker
/// really ran them in shared decode steps.
#[test]
fn concurrent_greedy_clients_get_their_tokens_alone() {
    let users = ["one", "two two", "three three three", "four"];
    let alone: Vec<String> = {
        let s = real(pool_cfg(1));
        users
            .iter()
            .map(|u| content(&post_json(s.addr, "/v1/chat/completions", &greedy(u, 24))))
            .collect()
    };
    let s = real(pool_cfg(4));
    let addr = s.addr;
    s.shared.pause_admission(true);
    let handles: Vec<_> = users
        .iter()
        .map(|u| {
            let body = greedy(u, 24);
            std::thread::spawn(move || post_json(addr, "/v1/chat/completions", &body))
        })
        .collect();
    wait_queued(addr, users.len() as f64);
    s.shared.pause_admission(false);
    let got: Vec<Value> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (i, r) in got.iter().enumerate() {
        assert_eq!(content(r), alone[i], "client {i}: {r}");
    }
    // Admitted together, the four decode in the same steps (a step of 3 or 4 rows)
    // once their prompts are in; each prompt is one prefill chunk.
    let four = metric(addr, "ds4_decode_step_rows_bucket{le=\"4\"}");
    let two = metric(addr, "ds4_decode_step_rows_bucket{le=\"2\"}");
    assert!(
        four > two,
        "no step of 3 or 4 rows ({two} of 2 or fewer, {four} of 4 or fewer)"
    );
    // The worker updates the gauge after the iteration that answered the last one.
    wait_idle(addr);
    assert!(metric(addr, "ds4_time_to_first_token_seconds_count") >= 4.0);
    for i in 0..4 {
        // Four live sessions, each holding its conversation's KV.
        assert!(metric(addr, &format!("ds4_session_tokens{{session=\"{i}\"}}")) > 0.0);
        assert!(metric(addr, &format!("ds4_session_kv_bytes{{session=\"{i}\"}}")) > 0.0);
    }
    assert!(metric(addr, "ds4_inter_token_seconds_count") >= 4.0);
}

fn chat(msgs: &Value) -> Value {
    json!({"model": "deepseek-chat", "temperature": 0, "max_tokens": 12, "messages": msgs})
}

/// Conversation A, conversation B, then A continued (its reply and a new user turn):
/// with one session B evicts A (to the RAM tier or the disk cache), with two A stays
/// live. The continuation must be the same either way, and reuse A's KV.
fn evict_and_continue(cfg: ServerConfig) -> (Value, SocketAddr, TestServer) {
    let sys = json!({"role": "system", "content": "You are terse."});
    let a = json!([sys, {"role": "user", "content": "hello world"}]);
    let b = json!([sys, {"role": "user", "content": "a completely different story"}]);
    let s = real(cfg);
    let a1 = post_json(s.addr, "/v1/chat/completions", &chat(&a));
    let b1 = post_json(s.addr, "/v1/chat/completions", &chat(&b));
    assert!(b1["choices"][0]["message"]["content"].is_string(), "{b1}");
    let mut a2 = a.as_array().unwrap().clone();
    a2.push(json!({"role": "assistant", "content": content(&a1)}));
    a2.push(json!({"role": "user", "content": "and then?"}));
    let r = post_json(s.addr, "/v1/chat/completions", &chat(&Value::Array(a2)));
    (r, s.addr, s)
}

#[test]
fn evicted_sessions_come_back_from_ram_and_disk_and_continue_exactly() {
    let (live, _, s) = evict_and_continue(pool_cfg(2));
    assert!(cached(&live) > 16, "{live}");
    drop(s);

    let mut c = pool_cfg(1);
    c.kv_ram_bytes = 64 << 20;
    let (ram, addr, s) = evict_and_continue(c);
    assert_eq!(content(&ram), content(&live), "{ram}");
    assert_eq!(cached(&ram), cached(&live));
    assert_eq!(metric(addr, "ds4_pool_ram_hits_total"), 1.0);
    assert_eq!(metric(addr, "ds4_cache_hits_total{kind=\"ram\"}"), 1.0);
    assert!(metric(addr, "ds4_pool_evictions_total") >= 2.0);
    drop(s);

    let dir = temp_dir("pool-disk");
    let mut c = pool_cfg(1);
    c.kv_disk = Some(KvDiskConfig {
        budget_bytes: 256 << 20,
        ..KvDiskConfig::for_tests(dir.clone())
    });
    let (disk, addr, s) = evict_and_continue(c);
    assert_eq!(content(&disk), content(&live), "{disk}");
    assert!(cached(&disk) > 16, "{disk}");
    assert_eq!(metric(addr, "ds4_pool_ram_hits_total"), 0.0);
    assert_eq!(metric(addr, "ds4_cache_hits_total{kind=\"disk\"}"), 1.0);
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts a streaming chat request; returns the socket after the first body bytes.
fn open_stream(addr: SocketAddr, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut buf = Vec::new();
    let mut b = [0u8; 256];
    // Past the headers and into the first SSE frame with content.
    while !String::from_utf8_lossy(&buf).contains("\"content\"") {
        let n = s.read(&mut b).expect("read");
        assert!(
            n > 0,
            "stream closed early: {}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&b[..n]);
    }
    s
}

fn stream_text(r: &Resp) -> String {
    r.sse_json()
        .iter()
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

/// A request that extends a busy session gets a copy of it (a fork); a client that
/// disconnects frees its row while the other streams finish.
#[test]
fn busy_sessions_fork_and_disconnects_free_their_rows() {
    let s = fake_server_delay(pool_cfg(4), 15);
    let addr = s.addr;
    let long = |stream: bool| json!({"model": "deepseek-chat", "stream": stream, "max_tokens": 200, "messages": [{"role": "user", "content": "a long answer please"}]});
    let alone = post_json(addr, "/v1/chat/completions", &long(false));
    let want = content(&alone);
    assert!(want.contains("word39"), "{alone}");
    // A generates on session 0; the same prompt meanwhile is served by a copy of A's
    // prompt snapshot, not by a second prefill.
    let a = open_stream(addr, &long(true));
    let b = post_json(addr, "/v1/chat/completions", &long(false));
    assert_eq!(content(&b), want);
    assert_eq!(
        cached(&b),
        b["usage"]["prompt_tokens"].as_u64().unwrap() - 1,
        "{b}"
    );
    assert_eq!(metric(addr, "ds4_pool_forks_total"), 1.0);
    drop(a);
    // A ends (or, had it still been generating, is cancelled) before the count below.
    wait_idle(addr);
    let before = metric(addr, "ds4_cancelled_total");

    // Three streams; one hangs up after its first token: its row goes, the other two
    // finish in full.
    let quitter = open_stream(addr, &long(true));
    let stayers: Vec<_> = (0..2)
        .map(|_| {
            let body = long(true);
            std::thread::spawn(move || post(addr, "/v1/chat/completions", &body))
        })
        .collect();
    drop(quitter);
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(addr, "ds4_cancelled_total") < before + 1.0 {
        assert!(
            Instant::now() < deadline,
            "the disconnects were never noticed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    for h in stayers {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(stream_text(&r), want);
    }
    wait_idle(addr);
}

/// bench/serve-load.py against a CPU server on the tiny model: every request succeeds
/// and the CSV line adds up.
#[test]
fn serve_load_script_runs_against_the_tiny_model() {
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_err()
    {
        record_skip("no python3: bench/serve-load.py");
        return;
    }
    let mut c = pool_cfg(3);
    // The tiny tokenizer spends a token or two per character of the tool schemas.
    c.ctx = 4096;
    let s = real(c);
    let out = std::process::Command::new("python3")
        .arg(root().join("bench/serve-load.py"))
        .args(["--url", &s.url(), "--clients", "3", "--requests", "2"])
        .args(["--max-tokens", "6", "--system-words", "12", "--turns", "1"])
        .arg("--csv-header")
        .output()
        .expect("run serve-load.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let head: Vec<&str> = lines[0].split(',').collect();
    let row: Vec<&str> = lines[1].split(',').collect();
    assert_eq!(head.len(), row.len());
    let col = |name: &str| row[head.iter().position(|h| *h == name).unwrap()];
    assert_eq!(col("ok"), "6");
    assert_eq!(col("failed"), "0");
    let tokens: u64 = col("tokens").parse().unwrap();
    // Six requests of at most 6 tokens, as the server counted them.
    assert!(tokens > 0 && tokens <= 36, "{stdout}");
    assert_eq!(metric(s.addr, "ds4_tokens_out_total"), tokens as f64);
    assert!(stderr.contains("aggregate"), "{stderr}");
}

/// The live protocol bindings are per session: a Responses tool-call turn on one
/// session, another conversation on a second, then the tool outputs alone (no replayed
/// call) are accepted and continue the first session.
#[test]
fn bindings_stay_with_their_session() {
    let s = fake_server(pool_cfg(2));
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let r1 = post_json(
        s.addr,
        "/v1/responses",
        &json!({"instructions": "Be brief.", "input": "weather in Paris?", "tools": tools}),
    );
    let fc = first_of(&r1["output"], "function_call").clone();
    let held = r1["usage"]["input_tokens"].as_u64().unwrap()
        + r1["usage"]["output_tokens"].as_u64().unwrap();
    let other = post_json(s.addr, "/v1/chat/completions", &greedy("something else", 8));
    assert!(
        other["choices"][0]["message"]["content"].is_string(),
        "{other}"
    );
    let r2 = post(
        s.addr,
        "/v1/responses",
        &json!({"instructions": "Be brief.", "tools": tools, "input": [
            {"type": "function_call_output", "call_id": fc["call_id"], "output": "sunny"}
        ]}),
    );
    assert_eq!(r2.status, 200, "{}", r2.text());
    let r2 = r2.json();
    assert_eq!(
        r2["usage"]["input_tokens_details"]["cached_tokens"], held,
        "{r2}"
    );
    assert_eq!(
        metric(
            s.addr,
            "ds4_cache_hits_total{kind=\"responses-tool-output\"}"
        ),
        1.0
    );
    assert_eq!(metric(s.addr, "ds4_pool_evictions_total"), 0.0);
}

/// A long prompt arriving while another request generates is prefilled in bounded
/// chunks with that request's decode steps between them (the engine's call order).
#[test]
fn a_long_prompt_is_prefilled_between_decode_steps() {
    use ds4_server::engine::{default_script, Call, CallLog, FakeEngine};
    let tok = tokenizer();
    let log: CallLog = Default::default();
    let mut cfg = pool_cfg(2);
    cfg.ctx = 16384;
    let eng = FakeEngine::new(tok.clone(), cfg.ctx, default_script()).with_call_log(log.clone());
    let s = TestServer::start(cfg, tok, Box::new(eng));
    let addr = s.addr;
    s.shared.pause_admission(true);
    let a = std::thread::spawn(move || {
        post_json(
            addr,
            "/v1/chat/completions",
            &json!({"model": "deepseek-chat", "max_tokens": 400, "messages": [{"role": "user", "content": "a long answer please"}]}),
        )
    });
    wait_queued(addr, 1.0);
    let long: String = (0..1500).map(|i| format!("w{i} ")).collect();
    let b = std::thread::spawn(move || {
        post_json(
            addr,
            "/v1/chat/completions",
            &json!({"model": "deepseek-chat", "max_tokens": 8, "messages": [{"role": "user", "content": long}]}),
        )
    });
    wait_queued(addr, 2.0);
    s.shared.pause_admission(false);
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    assert!(content(&a).contains("word39"), "{a}");
    let b_prompt = b["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(
        b_prompt > 4 * 512,
        "a prompt of {b_prompt} tokens is not long"
    );
    let calls = log.lock().unwrap().clone();
    assert!(
        calls
            .iter()
            .all(|c| !matches!(c, Call::Prefill(n) if *n > 512)),
        "{calls:?}"
    );
    let chunks: Vec<usize> = (0..calls.len())
        .filter(|&i| calls[i] == Call::Prefill(512))
        .collect();
    assert!(chunks.len() >= 4, "{calls:?}");
    // A's prompt is in after B's first chunk: every later chunk of B follows a decode.
    for w in chunks[1..].windows(2) {
        assert!(
            calls[w[0]..w[1]].contains(&Call::Decode),
            "no decode between chunks: {calls:?}"
        );
    }
}

/// A forked session continues exactly (the real engine): two requests for one prompt
/// admitted together; the first takes the session holding that prompt, the second
/// gets a copy of it while the first runs, and both reply as they would alone.
#[test]
fn a_forked_session_continues_exactly() {
    let s = real(pool_cfg(3));
    let addr = s.addr;
    let alone_long = post_json(addr, "/v1/chat/completions", &greedy("hello world", 24));
    let alone_short = {
        let s1 = real(pool_cfg(1));
        post_json(s1.addr, "/v1/chat/completions", &greedy("hello world", 10))
    };
    s.shared.pause_admission(true);
    let a = std::thread::spawn(move || {
        post_json(addr, "/v1/chat/completions", &greedy("hello world", 24))
    });
    wait_queued(addr, 1.0);
    let b = std::thread::spawn(move || {
        post_json(addr, "/v1/chat/completions", &greedy("hello world", 10))
    });
    wait_queued(addr, 2.0);
    s.shared.pause_admission(false);
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    assert_eq!(metric(addr, "ds4_pool_forks_total"), 1.0);
    let prompt = b["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(cached(&a), prompt - 1, "{a}");
    assert_eq!(cached(&b), prompt - 1, "{b}");
    assert_eq!(content(&a), content(&alone_long));
    assert_eq!(content(&b), content(&alone_short));
}
