//! Connection limits (#18 item 1) and SSE keepalives during a slow prefill (#19 item 3),
//! against the in-process server.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{get, tokenizer, EngineHooks, Hooked};
use ds4_server::{ServerConfig, TestServer};
use serde_json::json;

/// Whether the server closed `s` within `wait` (EOF or reset; a timeout means open).
fn closed_within(s: &TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut b = [0u8; 256];
    let mut s = s;
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

fn limited(max: usize, header_secs: u64, idle_secs: u64) -> TestServer {
    let mut c = ServerConfig::for_tests(4096);
    c.conn.max_connections = max;
    c.conn.header_read_timeout = Duration::from_secs(header_secs);
    c.conn.idle_timeout = Duration::from_secs(idle_secs);
    common::fake_server(c)
}

// #18 item 1: with a cap of 64, a few hundred idle sockets make the server close the
// longest-idle ones instead of holding them all (which ran the process out of fds),
// and /health still answers.
#[test]
fn idle_sockets_beyond_the_cap_are_closed_and_health_answers() {
    let s = limited(64, 600, 600);
    let socks: Vec<TcpStream> = (0..300usize)
        .map(|i| {
            let mut t = TcpStream::connect(s.addr).expect("connect");
            if i.is_multiple_of(3) {
                // Half-sent headers count as idle too.
                t.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
            }
            t
        })
        .collect();
    let r = get(s.addr, "/health");
    assert_eq!(r.status, 200, "{}", r.text());
    // The oldest sockets were closed to make room; the newest 64 or fewer stay open.
    let closed = socks
        .iter()
        .take(200)
        .filter(|t| closed_within(t, Duration::from_secs(10)))
        .count();
    assert_eq!(
        closed, 200,
        "only {closed} of the 200 oldest idle sockets were closed"
    );
}

// #18 item 1: a connection that stops in the middle of its headers is closed after the
// header-read timeout, one that sends nothing (or finished its request) after the idle
// timeout; each limit applies on its own.
#[test]
fn half_sent_and_idle_connections_time_out() {
    let s = limited(64, 1, 600);
    let silent = TcpStream::connect(s.addr).unwrap();
    let mut half = TcpStream::connect(s.addr).unwrap();
    half.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    // Upper bounds of waiting, far above the 1 s timeout.
    assert!(closed_within(&half, Duration::from_secs(30)));
    // The idle limit is 600 s: a silent connection is not cut by the header timeout.
    assert!(!closed_within(&silent, Duration::from_secs(2)));
    drop(s);

    let s = limited(64, 600, 1);
    let silent = TcpStream::connect(s.addr).unwrap();
    assert!(closed_within(&silent, Duration::from_secs(30)));
    // A keep-alive connection that finished its request is idle again.
    let mut ka = TcpStream::connect(s.addr).unwrap();
    ka.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut b = [0u8; 512];
    ka.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    assert!(ka.read(&mut b).unwrap() > 0);
    assert!(closed_within(&ka, Duration::from_secs(30)));
}

// #18 item 1: at the cap, a connection with a request in flight is never the one closed.
#[test]
fn busy_connections_survive_the_cap() {
    let mut c = ServerConfig::for_tests(4096);
    c.conn.max_connections = 4;
    let s = common::fake_server_delay(c, 20);
    let addr = s.addr;
    let streaming = std::thread::spawn(move || {
        common::post(
            addr,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hello"}], "stream": true, "max_tokens": 40}),
        )
    });
    std::thread::sleep(Duration::from_millis(200));
    let _idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let r = streaming.join().unwrap();
    assert_eq!(r.status, 200);
    assert!(r.text().contains("[DONE]"), "stream cut: {}", r.text());
}

/// A prefill that takes `per_call` per call (one call per chunk).
#[derive(Clone)]
struct SlowPrefill {
    per_call: Duration,
}

impl EngineHooks for SlowPrefill {
    fn before_prefill(&mut self, _held: &[u32], _tokens: &[u32]) {
        std::thread::sleep(self.per_call);
    }
}

// #19 item 3: a long prefill sends progress events more often than the keepalive
// interval; they used to restart the keepalive timer, so the client saw nothing at all
// until the first token. Now keepalives keep coming every interval of silence.
#[test]
fn keepalives_continue_during_a_long_prefill() {
    let mut c = ServerConfig::for_tests(32768);
    c.keepalive = Duration::from_millis(400);
    let tok = tokenizer();
    let eng = Hooked::fake(
        &c,
        &tok,
        SlowPrefill {
            per_call: Duration::from_millis(100),
        },
    );
    let s = TestServer::start(c, tok, Box::new(eng));
    // ~20 prefill chunks of 512 tokens: ~2 s of prefill with progress every 100 ms.
    let prompt = "word ".repeat(10_000);
    let r = common::post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": prompt}], "stream": true, "max_tokens": 4}),
    );
    assert_eq!(r.status, 200);
    let text = r.text();
    // Decoding 4 tokens is instant: every keepalive was sent during the prefill.
    let keepalives = text.matches(": keepalive").count();
    assert!(
        keepalives >= 1,
        "no keepalive during the prefill:\n{text:.400}"
    );
}
