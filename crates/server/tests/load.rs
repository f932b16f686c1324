//! The load acceptance of #18: 32 clients × 20 mixed requests (the three APIs,
//! streaming and not, some cancelled mid-stream) under the connection limits, with 0
//! errors and the server healthy afterwards.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::{get, post};
use ds4_server::ServerConfig;
use serde_json::{json, Value};

/// Starts a streaming chat request and hangs up after its first bytes (a cancel).
fn cancelled_stream(addr: SocketAddr, body: &Value) -> bool {
    let body = body.to_string();
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut buf = [0u8; 64];
    s.write_all(req.as_bytes()).is_ok()
        && s.read(&mut buf).is_ok_and(|n| n > 0)
        && buf.starts_with(b"HTTP/1.1 200")
}

/// One request of kind `k`; whether it succeeded.
fn one(addr: SocketAddr, k: usize, w: usize, i: usize) -> bool {
    let stream = (w + i).is_multiple_of(2);
    let msg = format!("hello {w} {i}");
    let r = match k {
        0 => post(
            addr,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": msg}], "stream": stream, "max_tokens": 16}),
        ),
        1 => post(
            addr,
            "/v1/responses",
            &json!({"input": msg, "stream": stream, "max_output_tokens": 16}),
        ),
        2 => post(
            addr,
            "/v1/messages",
            &json!({"max_tokens": 16, "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}], "stream": stream}),
        ),
        3 => {
            return cancelled_stream(
                addr,
                &json!({"messages": [{"role": "user", "content": msg}], "stream": true, "max_tokens": 64}),
            )
        }
        _ => get(addr, "/health"),
    };
    let t = r.text();
    let ok = r.status == 200 && !t.contains("\"error\":{") && !t.contains("event: error");
    if !ok {
        eprintln!("load failure (kind {k}): {} {t}", r.status);
    }
    ok
}

// #18 acceptance: 32 clients × 20 mixed requests → 0 errors, with the connection cap
// and timeouts on (a cap above the client count: none of them is ever idle-evicted
// while it has a request in flight).
#[test]
fn thirty_two_clients_twenty_mixed_requests_no_errors() {
    mixed_load(1);
}

// The same with a session pool of 4 (#21): requests of the three APIs, tool calls and
// cancels run in shared batches, with evictions and forks between them.
#[test]
fn thirty_two_clients_twenty_mixed_requests_on_a_pool_no_errors() {
    mixed_load(4);
}

fn mixed_load(sessions: usize) {
    let mut c = ServerConfig::for_tests(4096);
    c.conn.max_connections = 48;
    c.max_sessions = Some(sessions);
    c.kv_ram_bytes = 16 << 20;
    let s = common::fake_server(c);
    let addr = s.addr;
    let handles: Vec<_> = (0..32)
        .map(|w| {
            std::thread::spawn(move || (0..20).filter(|&i| !one(addr, (w + i) % 5, w, i)).count())
        })
        .collect();
    let fails: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(fails, 0, "{fails} of 640 requests failed");
    assert_eq!(get(addr, "/health").status, 200);
    // Every row was freed (the gauge follows the iteration that answered the last).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !get(addr, "/metrics")
        .text()
        .contains("\nds4_requests_running 0\n")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "requests still running"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
