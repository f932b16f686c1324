//! #18: requests that used to be accepted wrongly (items 7, 8, 9, 12), over loopback on
//! the fake engine.

mod common;

use common::*;
use ds4_server::ServerConfig;
use serde_json::{json, Value};

fn cfg() -> ServerConfig {
    ServerConfig::for_tests(4096)
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Status and error message of a POST of `body` to `path`.
fn status_msg(addr: std::net::SocketAddr, path: &str, body: &Value) -> (u16, String) {
    let r = post(addr, path, body);
    let j = r.json();
    let msg = j["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (r.status, msg)
}

// #18 item 12: bodies each API refuses, with the words the message must contain.
#[test]
fn malformed_conversations_are_400() {
    let s = fake_server(cfg());
    let image = json!([{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]);
    let audio = json!([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]);
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            "must not be empty",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "unknown message role",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("hi"), "max_tokens": 0}),
            "positive integer",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("hi"), "max_completion_tokens": -1}),
            "positive integer",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user("hi"), "n": 2}),
            "only n=1 is supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": image}]}),
            "images are not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": audio}]}),
            "audio inputs are not supported",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": -1}),
            "positive integer",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 3}),
            "only n=1",
        ),
        (
            "/v1/messages",
            json!({"messages": user("hi")}),
            "max_tokens: Field required",
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 0, "messages": user("hi")}),
            "positive integer",
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 5, "messages": []}),
            "must not be empty",
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}),
            "unknown message role",
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}),
            "images are not supported",
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]}),
            "images are not supported",
        ),
        ("/v1/responses", json!({"input": []}), "must not be empty"),
        (
            "/v1/responses",
            json!({"input": [{"type": "message", "role": "robot", "content": "hi"}]}),
            "unknown message role",
        ),
        (
            "/v1/responses",
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "images are not supported",
        ),
        (
            "/v1/responses",
            json!({"input": "hi", "max_output_tokens": 0}),
            "positive integer",
        ),
    ];
    for (path, body, want) in cases {
        let (status, msg) = status_msg(s.addr, path, &body);
        assert_eq!(status, 400, "{path} {body}: {msg}");
        assert!(msg.contains(want), "{path} {body}: {msg:?} lacks {want:?}");
    }
    // The Anthropic error shape on /v1/messages.
    let r = post(s.addr, "/v1/messages", &json!({"messages": user("hi")})).json();
    assert_eq!(r["type"], "error");
    // count_tokens takes no max_tokens (as Anthropic's).
    let r = post(
        s.addr,
        "/v1/messages/count_tokens",
        &json!({"messages": user("hi")}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // n=1 and a positive limit still work.
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": user("hi"), "n": 1, "max_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

// #18 item 12: a known path with the wrong method is 405 with Allow, not 404.
#[test]
fn wrong_method_is_405_with_allow() {
    let s = fake_server(cfg());
    for (method, path, allow) in [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/messages", "POST"),
        ("DELETE", "/v1/responses", "POST"),
        ("POST", "/v1/models", "GET"),
        ("POST", "/health", "GET"),
    ] {
        let r = request(s.addr, method, path, &[], b"");
        assert_eq!(r.status, 405, "{method} {path}");
        assert!(
            r.header("allow").is_some_and(|a| a.contains(allow)),
            "{method} {path}: {:?}",
            r.headers
        );
    }
    let r = request(s.addr, "GET", "/v1/messages", &[], b"");
    assert_eq!(r.json()["type"], "error", "Anthropic shape");
}

// #18 item 8: stop strings are limited in count and length (configurable), a clear 400.
#[test]
fn stop_strings_are_limited() {
    let s = fake_server(ServerConfig {
        max_stops: 3,
        max_stop_bytes: 8,
        ..cfg()
    });
    let chat = |stop: Value| json!({"messages": user("hi"), "max_tokens": 2, "stop": stop});
    let (status, msg) = status_msg(
        s.addr,
        "/v1/chat/completions",
        &chat(json!(["a", "b", "c", "d"])),
    );
    assert_eq!(status, 400);
    assert!(msg.contains("at most 3"), "{msg}");
    let (status, msg) = status_msg(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "x", "stop": "123456789"}),
    );
    assert_eq!(status, 400);
    assert!(msg.contains("at most 8 bytes"), "{msg}");
    let body =
        json!({"max_tokens": 2, "messages": user("hi"), "stop_sequences": ["w", "x", "y", "z"]});
    let r = post(s.addr, "/v1/messages", &body);
    assert_eq!((r.status, r.json()["type"].as_str()), (400, Some("error")));
    // At the limits it works.
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &chat(json!(["a", "b", "12345678"])),
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A POST to the chat endpoint with the given Host and extra headers.
fn chat_with(addr: std::net::SocketAddr, host: &str, headers: &[(&str, &str)]) -> u16 {
    let body = json!({"messages": user("hi"), "max_tokens": 1}).to_string();
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    raw(addr, req.as_bytes()).status
}

const JSON: (&str, &str) = ("Content-Type", "application/json");

// #18 item 9: without an API key, DNS rebinding (a foreign Host), cross-site origins
// and non-JSON bodies are refused; SDKs, curl and listed hosts/origins still work.
#[test]
fn browser_requests_need_a_trusted_host_origin_and_json() {
    let s = fake_server(ServerConfig {
        allowed_hosts: vec!["ds4.lan".into()],
        allowed_origins: vec!["https://app.example".into()],
        ..cfg()
    });
    let a = s.addr;
    for (host, headers, want) in [
        ("127.0.0.1:8000", vec![JSON], 200),
        ("localhost:8000", vec![JSON], 200),
        ("[::1]:8000", vec![JSON], 200),
        ("ds4.lan:8000", vec![JSON], 200),
        ("attacker.example:8000", vec![JSON], 403),
        (
            "localhost",
            vec![JSON, ("Origin", "http://localhost:3000")],
            200,
        ),
        (
            "localhost",
            vec![JSON, ("Origin", "https://app.example")],
            200,
        ),
        (
            "localhost",
            vec![JSON, ("Origin", "https://evil.example")],
            403,
        ),
        ("localhost", vec![JSON, ("Origin", "null")], 403),
        ("localhost", vec![("Content-Type", "text/plain")], 415),
        (
            "localhost",
            vec![("Content-Type", "multipart/form-data; boundary=x")],
            415,
        ),
        // curl -d without -H, and no Content-Type at all.
        (
            "localhost",
            vec![("Content-Type", "application/x-www-form-urlencoded")],
            200,
        ),
        ("localhost", vec![], 200),
        (
            "localhost",
            vec![("Content-Type", "application/json; charset=utf-8")],
            200,
        ),
    ] {
        assert_eq!(chat_with(a, host, &headers), want, "{host} {headers:?}");
    }
    // A foreign Host may still ask /health; reading /v1/models under it is refused.
    let get_as = |path: &str| {
        let req =
            format!("GET {path} HTTP/1.1\r\nHost: attacker.example\r\nConnection: close\r\n\r\n");
        raw(a, req.as_bytes()).status
    };
    assert_eq!((get_as("/health"), get_as("/v1/models")), (200, 403));
    // With an API key the key is the protection: a foreign Host with the key works.
    let s = fake_server(ServerConfig {
        api_key: Some("k".into()),
        ..cfg()
    });
    let auth = ("Authorization", "Bearer k");
    assert_eq!(chat_with(s.addr, "ds4.example", &[JSON, auth]), 200);
    assert_eq!(
        chat_with(
            s.addr,
            "ds4.example",
            &[("Content-Type", "text/plain"), auth]
        ),
        415
    );
}

/// `f()` until it gives `want` (at most 200 tries 10 ms apart, an upper bound of waiting
/// for the server to see a client's bytes or its leaving); the last status.
fn until(want: u16, f: impl Fn() -> u16) -> u16 {
    let mut status = 0;
    for _ in 0..200 {
        status = f();
        if status == want {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    status
}

// #18 item 7: bodies being received share a memory budget; one that does not fit while
// others hold it gets 503 (in the API's shape), one larger than the budget 413, and the
// budget comes back when a body is done or its client goes away.
#[test]
fn inflight_bodies_share_a_bounded_budget() {
    use std::io::{Read, Write};
    let s = fake_server(ServerConfig {
        max_inflight_body_bytes: 64 << 10,
        ..cfg()
    });
    let a = s.addr;
    // A slow client: announces 60 KB, sends 50 KB, waits.
    let mut slow = std::net::TcpStream::connect(a).unwrap();
    write!(slow, "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 60000\r\n\r\n").unwrap();
    slow.write_all(&[b' '; 50_000]).unwrap();
    // Let the server take these bytes in before racing it (an upper bound of waiting:
    // were the next body read first, the slow one would be the one refused).
    std::thread::sleep(std::time::Duration::from_millis(300));
    // Its bytes are held; a 20 KB body no longer fits.
    // 20 KB of JSON whitespace around a tiny request (a long prompt would hit the context).
    let small = json!({"messages": user("hi"), "max_tokens": 1}).to_string();
    let big = format!("{}{small}", " ".repeat(20_000)).into_bytes();
    let post_big = |path: &str| request(a, "POST", path, &[], &big);
    let status = until(503, || post_big("/v1/chat/completions").status);
    assert_eq!(status, 503, "the in-flight budget was not enforced");
    let r = post_big("/v1/messages");
    assert_eq!((r.status, r.json()["type"].as_str()), (503, Some("error")));
    // Small requests still pass.
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": user("hi"), "max_tokens": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // The slow client leaves: its share comes back.
    slow.shutdown(std::net::Shutdown::Both).unwrap();
    let mut sink = Vec::new();
    let _ = slow.read_to_end(&mut sink);
    drop(slow);
    let status = until(200, || post_big("/v1/chat/completions").status);
    assert_eq!(status, 200, "the budget was not given back");
    // Larger than the whole budget: 413.
    let huge = json!({"messages": user(&"y".repeat(70_000)), "max_tokens": 1});
    assert_eq!(post(a, "/v1/chat/completions", &huge).status, 413);
}
