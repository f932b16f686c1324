//! Anthropic Messages: a reply ended by one of the request's `stop_sequences` reports
//! `stop_reason: "stop_sequence"` and names the string in `stop_sequence`, streaming
//! and not; other endings keep `end_turn` / `max_tokens` with `stop_sequence: null`
//! (#24 item 5). The fake engine answers "Hello! I am a tiny fake model. STOP …".

mod common;

use common::*;
use ds4_server::ServerConfig;
use serde_json::{json, Value};

fn body(stops: Value, max_tokens: u64, stream: bool) -> Value {
    json!({
        "model": "claude", "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": "hi"}], "stop_sequences": stops,
    })
}

/// The stream's text and its `message_delta` event.
fn streamed(r: &Resp) -> (String, Value) {
    let events: Vec<Value> = r
        .sse()
        .iter()
        .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
        .collect();
    let text = events
        .iter()
        .filter_map(|e| e["delta"]["text"].as_str())
        .collect();
    let delta = events
        .iter()
        .find(|e| e["type"] == "message_delta")
        .cloned()
        .expect("a message_delta event");
    (text, delta)
}

#[test]
fn a_stop_sequence_is_reported_as_such() {
    let s = fake_server(ServerConfig::for_tests(4096));
    let r = post_json(
        s.addr,
        "/v1/messages",
        &body(json!(["nope", "STOP"]), 1000, false),
    );
    assert_eq!(r["stop_reason"], "stop_sequence", "{r}");
    assert_eq!(r["stop_sequence"], "STOP", "{r}");
    let text = first_of(&r["content"], "text");
    assert_eq!(text["text"], "Hello! I am a tiny fake model. ");
    let resp = post(s.addr, "/v1/messages", &body(json!(["STOP"]), 1000, true));
    let (text, delta) = streamed(&resp);
    assert_eq!(text, "Hello! I am a tiny fake model. ");
    assert_eq!(delta["delta"]["stop_reason"], "stop_sequence", "{delta}");
    assert_eq!(delta["delta"]["stop_sequence"], "STOP", "{delta}");
}

#[test]
fn other_endings_name_no_stop_sequence() {
    let s = fake_server(ServerConfig::for_tests(4096));
    // A stop sequence that never appears: the reply ends at EOS.
    let r = post_json(
        s.addr,
        "/v1/messages",
        &body(json!(["never there"]), 1000, false),
    );
    assert_eq!(r["stop_reason"], "end_turn", "{r}");
    assert_eq!(r["stop_sequence"], Value::Null, "{r}");
    // The limit comes first.
    let r = post_json(s.addr, "/v1/messages", &body(json!(["STOP"]), 2, false));
    assert_eq!(r["stop_reason"], "max_tokens", "{r}");
    assert_eq!(r["stop_sequence"], Value::Null, "{r}");
    let resp = post(
        s.addr,
        "/v1/messages",
        &body(json!(["never there"]), 1000, true),
    );
    let (_, delta) = streamed(&resp);
    assert_eq!(delta["delta"]["stop_reason"], "end_turn", "{delta}");
    assert_eq!(delta["delta"]["stop_sequence"], Value::Null, "{delta}");
}
