//! Live protocol bindings (server.md §4.2), their cache paths (§4.1 steps 1–6), tool
//! output validation (400/409), visible-keyed disk saves (§4.4) and the canonical
//! rebuild (§4.3), on the deterministic fake engine.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use ds4_server::config::KvDiskConfig;
use ds4_server::engine::FakeEngine;
use ds4_server::job::GenEvent;
use ds4_server::{ServerConfig, TestServer};
use serde_json::{json, Value};

fn cfg() -> ServerConfig {
    ServerConfig::for_tests(4096)
}

/// `ds4_cache_hits_total{kind=KIND}` from /metrics.
fn hits(s: &TestServer, kind: &str) -> u64 {
    metric(s, &format!("ds4_cache_hits_total{{kind=\"{kind}\"}}"))
}

fn metric(s: &TestServer, name: &str) -> u64 {
    let text = get(s.addr, "/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}")) as u64
}

fn responses_tools() -> Value {
    json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}])
}

/// A Responses tool-call turn (Codex: tools, thinking, no summaries). Returns the
/// response, its function_call item and (prompt, completion) token counts.
fn responses_turn(s: &TestServer) -> (Value, Value, u64, u64) {
    let req = json!({"instructions": "Be brief.", "input": "weather in Paris?", "tools": responses_tools()});
    let r = post_json(s.addr, "/v1/responses", &req);
    let fc = first_of(&r["output"], "function_call").clone();
    let p = r["usage"]["input_tokens"].as_u64().unwrap();
    let c = r["usage"]["output_tokens"].as_u64().unwrap();
    (r, fc, p, c)
}

/// What Codex sends after running the tool: the whole history without reasoning.
fn codex_replay(fc: &Value, output: &str) -> Value {
    json!([
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": fc["call_id"], "name": "get_weather", "arguments": fc["arguments"]},
        {"type": "function_call_output", "call_id": fc["call_id"], "output": output},
    ])
}

fn output_text(r: &Value) -> String {
    r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["type"] == "message")
        .map(|o| o["content"][0]["text"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn responses_visible_transcript_keeps_the_live_reasoning() {
    let s = fake_server(cfg());
    let (_, fc, p1, c1) = responses_turn(&s);
    // Codex drops the reasoning from its replay; the visible binding still maps the
    // history onto the live tokens, so nothing of turn 1 is evaluated again.
    let mut input = codex_replay(&fc, "sunny");
    let body = json!({"instructions": "Be brief.", "input": input, "tools": responses_tools()});
    let r2 = post(s.addr, "/v1/responses", &body).json();
    assert_eq!(output_text(&r2), "It is sunny in Paris.");
    assert_eq!(
        r2["usage"]["input_tokens_details"]["cached_tokens"],
        p1 + c1,
        "{r2}"
    );
    assert_eq!(hits(&s, "responses-visible"), 1);
    // A turn without calls binds too: the next user message continues it.
    let p2 = r2["usage"]["input_tokens"].as_u64().unwrap();
    let c2 = r2["usage"]["output_tokens"].as_u64().unwrap();
    let items = input.as_array_mut().unwrap();
    items.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny in Paris."}]}));
    items.push(json!({"type": "message", "role": "user", "content": "thanks"}));
    let req = json!({"instructions": "Be brief.", "input": input, "tools": responses_tools()});
    let r3 = post_json(s.addr, "/v1/responses", &req);
    assert_eq!(
        r3["usage"]["input_tokens_details"]["cached_tokens"],
        p2 + c2,
        "{r3}"
    );
    assert_eq!(hits(&s, "responses-visible"), 2);
}

#[test]
fn responses_tool_outputs_alone_continue_the_live_calls() {
    let s = fake_server(cfg());
    let (_, fc, p1, c1) = responses_turn(&s);
    let r2 = post(
        s.addr,
        "/v1/responses",
        &json!({"instructions": "Be brief.", "tools": responses_tools(), "input": [
            {"type": "function_call_output", "call_id": fc["call_id"], "output": "sunny"}
        ]}),
    )
    .json();
    assert_eq!(r2["status"], "completed", "{r2}");
    assert_eq!(output_text(&r2), "It is sunny in Paris.");
    assert_eq!(
        r2["usage"]["input_tokens_details"]["cached_tokens"],
        p1 + c1
    );
    assert_eq!(hits(&s, "responses-tool-output"), 1);
    // The tail (EOS, the tool result, the assistant prefix) was all that was new.
    let tail = r2["usage"]["input_tokens"].as_u64().unwrap() - (p1 + c1);
    assert!((5..40).contains(&tail), "tail of {tail} tokens: {r2}");
}

#[test]
fn responses_unknown_call_ids_are_rejected_unless_replayed() {
    let s = fake_server(cfg());
    let only_output = |id: &Value| json!({"tools": responses_tools(), "input": [{"type": "message", "role": "user", "content": "weather in Paris?"}, {"type": "function_call_output", "call_id": id, "output": "sunny"}]});
    let r = post(s.addr, "/v1/responses", &only_output(&json!("call_nope")));
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json()["error"]["message"],
        "Responses continuation state is not available for call_id call_nope; retry by replaying the full input history"
    );
    // A full replay (the call is earlier in the input) needs no live state.
    let r = post(
        s.addr,
        "/v1/responses",
        &json!({"tools": responses_tools(), "input": [
            {"type": "message", "role": "user", "content": "weather in Paris?"},
            {"type": "function_call", "call_id": "call_nope", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_nope", "output": "sunny"},
        ]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // Known to the live binding but not the trailing live calls: only the live session
    // could serve it, and the request's tail does not continue it → 409.
    let (_, fc, _, _) = responses_turn(&s);
    let body = only_output(&fc["call_id"]);
    let r = post(s.addr, "/v1/responses", &body);
    assert_eq!(r.status, 409, "{}", r.text());
    let conflict =
        "Responses continuation state is not available; retry by replaying the full input history";
    assert_eq!(r.json()["error"]["message"], conflict);
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let r = post(s.addr, "/v1/responses", &stream);
    assert_eq!(
        r.status,
        409,
        "streams report it as a status too: {}",
        r.text()
    );
    // Another request takes the session over: the binding is gone, the id unknown.
    post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    let r = post(s.addr, "/v1/responses", &body);
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn live_tool_state_vanishing_before_execution_is_409() {
    let s = fake_server(cfg());
    let (_, fc, _, _) = responses_turn(&s);
    // Validated while the binding is live …
    let body = json!({"tools": responses_tools(), "input": [{"type": "function_call_output", "call_id": fc["call_id"], "output": "sunny"}]});
    let (p, _) = ds4_server::api::responses::prepare(&s.shared, body.to_string().as_bytes())
        .expect("validated against the live binding");
    assert!(p.live.requires_live);
    // … but another request runs first.
    post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    let mut rx = ds4_server::api::submit(&s.shared, &p).unwrap();
    loop {
        match rx.blocking_recv() {
            Some(GenEvent::Failed { status, message }) => {
                assert_eq!(status, 409);
                assert!(message.contains("retry by replaying the full input history"));
                break;
            }
            Some(GenEvent::Done(r)) => panic!("served without live state: {r:?}"),
            Some(_) => {}
            None => panic!("no answer"),
        }
    }
}

fn anthropic_tools() -> Value {
    json!([{"name": "get_weather", "description": "Weather of a city", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}])
}

#[test]
fn anthropic_tool_results_continue_the_live_frontier() {
    let s = fake_server(cfg());
    let q = json!({"role": "user", "content": "What is the weather in Paris?"});
    let req = json!({"max_tokens": 300, "messages": [q], "tools": anthropic_tools()});
    let r1 = post_json(s.addr, "/v1/messages", &req);
    assert_eq!(r1["stop_reason"], "tool_use", "{r1}");
    let tu = first_of(&r1["content"], "tool_use").clone();
    let p1 = r1["usage"]["input_tokens"].as_u64().unwrap();
    let c1 = r1["usage"]["output_tokens"].as_u64().unwrap();
    // Claude Code style: no thinking block replayed, the result in a user message.
    let result = json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu["id"], "content": "sunny"}]});
    let replay = json!([q, {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, tu]}, result]);
    let req = json!({"max_tokens": 300, "messages": replay, "tools": anthropic_tools()});
    let r2 = post_json(s.addr, "/v1/messages", &req);
    assert_eq!(r2["content"][1]["text"], "It is sunny in Paris.", "{r2}");
    assert_eq!(r2["usage"]["cache_read_input_tokens"], p1 + c1, "{r2}");
    assert_eq!(hits(&s, "anthropic-tool-output"), 1);

    // An unknown tool_use_id: 400 in Anthropic's error shape.
    let bad = json!({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]});
    let r = post(s.addr, "/v1/messages", &bad);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "error");
    assert_eq!(
        r.json()["error"]["message"],
        "Anthropic continuation state is not available for tool_use_id toolu_nope; retry by replaying the full messages history"
    );
    // count_tokens needs no live state.
    assert_eq!(post(s.addr, "/v1/messages/count_tokens", &bad).status, 200);
}

#[test]
fn anthropic_result_for_a_live_call_that_the_tail_does_not_continue_is_409() {
    let s = fake_server(cfg());
    let req = json!({"max_tokens": 300, "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": anthropic_tools()});
    let r1 = post_json(s.addr, "/v1/messages", &req);
    let id = first_of(&r1["content"], "tool_use")["id"].clone();
    // The result is known to the live frontier but followed by another user message, so
    // the trailing run carries no tool results: nothing continues the live calls.
    let body = json!({"max_tokens": 10, "tools": anthropic_tools(), "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": "sunny"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and now?"},
    ]});
    let r = post(s.addr, "/v1/messages", &body);
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(
        r.json()["error"]["message"],
        "Anthropic continuation state is not available; retry by replaying the full messages history"
    );
}

fn disk_cfg(dir: &Path) -> ServerConfig {
    let mut c = cfg();
    c.kv_disk = Some(KvDiskConfig {
        cold_max_tokens: 0,
        ..KvDiskConfig::for_tests(dir.to_path_buf())
    });
    c
}

/// (ext flags, key text) of every KVC file in `dir`.
fn kv_files(dir: &Path) -> Vec<(u8, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".kv") {
            continue;
        }
        let b = std::fs::read(e.path()).unwrap();
        let kl = u32::from_le_bytes(b[48..52].try_into().unwrap()) as usize;
        out.push((b[6], String::from_utf8(b[52..52 + kl].to_vec()).unwrap()));
    }
    out
}

#[test]
fn thinking_visible_key_on_shutdown_resumes_after_restart() {
    let dir = temp_dir("think");
    let sys = json!({"role": "system", "content": "You are terse. ".repeat(4)});
    let mut msgs = vec![sys, json!({"role": "user", "content": "hi"})];
    let s = fake_server(disk_cfg(&dir));
    let r1 = post(s.addr, "/v1/chat/completions", &json!({"messages": msgs})).json();
    let p1 = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    let c1 = r1["usage"]["completion_tokens"].as_u64().unwrap();
    s.stop();
    let files = kv_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let (ext, key) = &files[0];
    assert_eq!(ext & 4, 4, "thinking-visible key flag");
    // The key is what the next request renders: reasoning dropped, no final EOS.
    assert!(
        key.ends_with("<｜Assistant｜></think>Hello! I am a tiny fake model. STOP here."),
        "{key}"
    );
    assert!(!key.contains("Let me think"), "{key}");
    let content = r1["choices"][0]["message"]["content"].clone();
    msgs.push(json!({"role": "assistant", "content": content}));
    msgs.push(json!({"role": "user", "content": "and again"}));
    let s = fake_server(disk_cfg(&dir));
    let r2 = post(s.addr, "/v1/chat/completions", &json!({"messages": msgs})).json();
    // The checkpoint holds the live tokens (reasoning included) under the visible key.
    assert_eq!(
        r2["usage"]["prompt_tokens_details"]["cached_tokens"],
        p1 + c1,
        "{r2}"
    );
    assert_eq!(hits(&s, "disk"), 1);
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn responses_visible_key_on_evict_resumes_after_restart() {
    let dir = temp_dir("resp");
    let s = fake_server(disk_cfg(&dir));
    let (_, fc, p1, c1) = responses_turn(&s);
    // Another conversation replaces the live session: the evict save keys it by the
    // Responses visible transcript.
    post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": "Other. ".repeat(8)}, {"role": "user", "content": "hi"}]}),
    );
    s.stop();
    let files = kv_files(&dir);
    let visible: Vec<&(u8, String)> = files.iter().filter(|(e, _)| e & 2 == 2).collect();
    assert_eq!(visible.len(), 1, "{files:?}");
    let key = &visible[0].1;
    assert!(key.ends_with("</｜DSML｜tool_calls>"), "{key}");
    assert!(key.contains("<think></think>Checking."), "{key}");
    // The replayed call maps to its exact DSML through the file's tool map.
    assert_eq!(visible[0].0 & 1, 1, "tool map flag");
    let s = fake_server(disk_cfg(&dir));
    let req = json!({"instructions": "Be brief.", "input": codex_replay(&fc, "sunny"), "tools": responses_tools()});
    let r2 = post_json(s.addr, "/v1/responses", &req);
    assert_eq!(output_text(&r2), "It is sunny in Paris.");
    assert_eq!(
        r2["usage"]["input_tokens_details"]["cached_tokens"],
        p1 + c1,
        "{r2}"
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model whose DSML is not canonical (the encoder re-renders `[1,2]` as `[1, 2]`).
fn sloppy_server(cfg: ServerConfig) -> TestServer {
    let tok = tokenizer();
    let script: ds4_server::engine::Script = Arc::new(|prompt: &str| {
        let mut out = String::new();
        if prompt.ends_with("<think>") {
            out.push_str("Plan.</think>");
        }
        if prompt
            .rsplit("<｜User｜>")
            .next()
            .unwrap_or("")
            .contains("<tool_result>")
        {
            out.push_str("Done.");
        } else {
            out.push_str("Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"days\" string=\"false\">[1,2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
        }
        out
    });
    let eng = FakeEngine::new(tok.clone(), cfg.ctx, script);
    TestServer::start(cfg, tok, Box::new(eng))
}

#[test]
fn canonical_rebuild_makes_the_next_request_a_memory_token_hit() {
    let mut c = cfg();
    c.exact_dsml_replay = false;
    let s = sloppy_server(c);
    let mut msgs = vec![json!({"role": "user", "content": "weather?"})];
    let req = json!({"messages": msgs, "tools": [weather_tool()]});
    let r1 = post_json(s.addr, "/v1/chat/completions", &req);
    let m = &r1["choices"][0]["message"];
    assert_eq!(
        m["tool_calls"][0]["function"]["arguments"],
        "{\"days\":[1,2]}"
    );
    let p1 = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    msgs.push(json!({"role": "assistant", "content": m["content"], "reasoning_content": m["reasoning_content"], "tool_calls": m["tool_calls"]}));
    msgs.push(
        json!({"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "sunny"}),
    );
    let req = json!({"messages": msgs, "tools": [weather_tool()]});
    let r2 = post_json(s.addr, "/v1/chat/completions", &req);
    assert_eq!(r2["choices"][0]["message"]["content"], "Done.");
    assert_eq!(metric(&s, "ds4_canonical_rebuilds_total"), 1);
    assert_eq!(hits(&s, "memory-token"), 1);
    // The canonical turn was already in the live KV: more than the first prompt reused.
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > p1, "cached {cached} <= first prompt {p1}: {r2}");
    let p2 = r2["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(p2 - cached < 40, "only the tool result is new: {r2}");
}

#[test]
fn stop_string_and_length_turns_bind_nothing() {
    let s = fake_server(cfg());
    let msgs = vec![json!({"role": "user", "content": "hi"})];
    // A stop string cuts the visible content short of what the live KV holds.
    let req = json!({"messages": msgs, "stop": ["STOP"]});
    let r1 = post_json(s.addr, "/v1/chat/completions", &req);
    assert_eq!(
        r1["choices"][0]["message"]["content"],
        "Hello! I am a tiny fake model. "
    );
    let mut next = msgs.clone();
    next.push(json!({"role": "assistant", "content": r1["choices"][0]["message"]["content"]}));
    next.push(json!({"role": "user", "content": "more"}));
    post(s.addr, "/v1/chat/completions", &json!({"messages": next}));
    assert_eq!(hits(&s, "thinking-visible"), 0);
    assert_eq!(hits(&s, "snapshot"), 1);
}
