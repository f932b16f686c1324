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
