//! End-to-end tests of every endpoint over loopback, on the deterministic fake engine.

mod common;

use std::time::Duration;

use common::*;
use ds4_server::ServerConfig;
use serde_json::{json, Value};

fn cfg() -> ServerConfig {
    ServerConfig::for_tests(4096)
}

#[test]
fn models_health_metrics_and_unknown_paths() {
    let s = fake_server(cfg());
    let m = get(s.addr, "/v1/models").json();
    assert_eq!(m["data"][0]["id"], "deepseek-v4-flash");
    assert_eq!(get(s.addr, "/v1/models/deepseek-v4-flash").status, 200);
    let r = get(s.addr, "/v1/models/gpt-17");
    assert_eq!(r.status, 404);
    assert!(r.json()["error"]["message"].is_string());
    assert_eq!(get(s.addr, "/health").json()["status"], "ok");
    let r = get(s.addr, "/nope");
    assert_eq!(
        (r.status, r.json()["error"]["message"].as_str()),
        (404, Some("unknown endpoint"))
    );
    assert_eq!(get(s.addr, "/v1/chat/completions").status, 405);
    post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    let text = get(s.addr, "/metrics").text();
    for m in [
        "ds4_queue_depth",
        "ds4_tokens_in_total",
        "ds4_tokens_out_total",
        "ds4_prefill_tokens_per_second",
        "ds4_decode_tokens_per_second",
        "ds4_cache_hits_total{kind=\"memory-token\"}",
    ] {
        assert!(text.contains(m), "{m} missing from /metrics:\n{text}");
    }
}

#[test]
fn chat_thinking_on_off_and_aliases() {
    let s = fake_server(cfg());
    let req = json!({"messages": [{"role": "user", "content": "hi"}]});
    let r = post_json(s.addr, "/v1/chat/completions", &req);
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(
        r["choices"][0]["message"]["reasoning_content"],
        "The user wants an answer. Let me think."
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    for body in [
        json!({"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]}),
        json!({"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}),
        json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "none"}),
        json!({"messages": [{"role": "user", "content": "hi"}], "think": false}),
    ] {
        let r = post(s.addr, "/v1/chat/completions", &body).json();
        assert!(
            r["choices"][0]["message"]
                .get("reasoning_content")
                .is_none(),
            "{body}: {r}"
        );
        assert_eq!(
            r["choices"][0]["message"]["content"],
            "Hello! I am a tiny fake model. STOP here."
        );
    }
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "banana"}),
    );
    assert_eq!(r.status, 400);
    // Max needs ctx >= 393216: at 4096 it is plain thinking (no Max prefix, still reasoning).
    let req = json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max"});
    let r = post_json(s.addr, "/v1/chat/completions", &req);
    assert!(r["choices"][0]["message"]["reasoning_content"].is_string());
}

#[test]
fn stop_sequences_and_max_tokens() {
    let s = fake_server(cfg());
    let body = json!({"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "stop": ["STOP"]});
    let r = post(s.addr, "/v1/chat/completions", &body).json();
    assert_eq!(
        r["choices"][0]["message"]["content"],
        "Hello! I am a tiny fake model. "
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    let mut b = body.clone();
    b["stream"] = json!(true);
    let r = post(s.addr, "/v1/chat/completions", &b);
    let text: String = r
        .sse_json()
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, "Hello! I am a tiny fake model. ");
    assert!(!r.text().contains("STO"));
    let r = post(s.addr, "/v1/chat/completions", &json!({"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})).json();
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 3);
    // #18 item 12: a non-positive limit is a 400, not an empty answer.
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn chat_tool_round_trip_reuses_the_kv() {
    let s = fake_server(cfg());
    let mut msgs = vec![json!({"role": "user", "content": "What is the weather in Paris?"})];
    let first = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": msgs, "tools": [weather_tool()], "stream": true, "stream_options": {"include_usage": true}}),
    );
    let chunks = first.sse_json();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut id = String::new();
    let mut args = String::new();
    let mut finish = None;
    let mut usage = Value::Null;
    for c in &chunks {
        if let Some(tc) = c["choices"][0]["delta"]["tool_calls"].as_array() {
            if let Some(i) = tc[0]["id"].as_str() {
                id = i.to_string();
                assert_eq!(tc[0]["function"]["name"], "get_weather");
            }
            args.push_str(tc[0]["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        if c["usage"].is_object() {
            usage = c["usage"].clone();
        }
        let content = c["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        assert!(
            !content.contains('<') && !content.contains("DSML"),
            "DSML leaked: {content:?}"
        );
    }
    assert!(first.text().ends_with("data: [DONE]\n\n"));
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert!(id.starts_with("call_") && id.len() == 37, "{id}");
    let parsed: Value = serde_json::from_str(&args).expect("streamed arguments form JSON");
    assert_eq!(parsed, json!({"city": "Paris & \"Lyon\""}));
    let p1 = usage["prompt_tokens"].as_u64().unwrap();
    let c1 = usage["completion_tokens"].as_u64().unwrap();
    // The client replays the call (compact arguments) and the result.
    msgs.push(json!({"role": "assistant", "content": "Checking.", "reasoning_content": "The user wants an answer. Let me think.", "tool_calls": [{"id": id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]}));
    msgs.push(json!({"role": "tool", "tool_call_id": id, "content": "sunny, 21C"}));
    let req = json!({"messages": msgs, "tools": [weather_tool()]});
    let second = post_json(s.addr, "/v1/chat/completions", &req);
    assert_eq!(
        second["choices"][0]["message"]["content"],
        "It is sunny in Paris."
    );
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Exact DSML replay: the whole first turn (prompt + sampled call) is reused.
    assert_eq!(cached, p1 + c1, "{second}");
}

#[test]
fn second_turn_prefills_only_the_suffix() {
    let s = fake_server(cfg());
    let mut msgs = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "hi"}),
    ];
    let r1 = post(s.addr, "/v1/chat/completions", &json!({"messages": msgs})).json();
    let p1 = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    let c1 = r1["usage"]["completion_tokens"].as_u64().unwrap();
    msgs.push(json!({"role": "assistant", "content": r1["choices"][0]["message"]["content"]}));
    msgs.push(json!({"role": "user", "content": "and again"}));
    let r2 = post(s.addr, "/v1/chat/completions", &json!({"messages": msgs})).json();
    let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Old reasoning is dropped from the history, yet the thinking binding maps the
    // visible transcript onto the live session: the whole first turn is reused
    // (reasoning included) and only the EOS and the new user turn are evaluated.
    assert_eq!(cached, p1 + c1, "{r2}");
    assert!(get(s.addr, "/metrics")
        .text()
        .contains("ds4_cache_hits_total{kind=\"thinking-visible\"} 1"));
    assert_eq!(
        r2["usage"]["prompt_tokens_details"]["cache_write_tokens"]
            .as_u64()
            .unwrap()
            + cached,
        r2["usage"]["prompt_tokens"].as_u64().unwrap()
    );
}

#[test]
fn completions_stream_and_not() {
    let s = fake_server(cfg());
    let req = json!({"prompt": "hi", "max_tokens": 500});
    let r = post_json(s.addr, "/v1/completions", &req);
    assert_eq!(r["object"], "text_completion");
    assert!(r["choices"][0]["text"]
        .as_str()
        .unwrap()
        .contains("</think>"));
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": ["hi"], "stream": true, "think": false, "stream_options": {"include_usage": true}}),
    );
    let ev = r.sse_json();
    let text: String = ev
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, "Hello! I am a tiny fake model. STOP here.");
    assert!(
        ev.last().unwrap()["usage"]["completion_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    assert_eq!(
        post(s.addr, "/v1/completions", &json!({"max_tokens": 5})).status,
        400
    );
}

#[test]
fn responses_tool_call_stream_and_continuation() {
    let s = fake_server(cfg());
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let body = json!({"model": "gpt-5", "instructions": "Be brief.", "input": "weather in Paris?", "tools": tools, "stream": true, "reasoning": {"effort": "high", "summary": "auto"}});
    let r = post(s.addr, "/v1/responses", &body);
    let ev = r.sse_json();
    let types: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types[0], "response.created");
    assert_eq!(*types.last().unwrap(), "response.completed");
    for (i, e) in ev.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64);
        assert_eq!(
            e.as_object().unwrap().keys().nth(1).map(String::as_str),
            Some("sequence_number")
        );
    }
    assert!(types.contains(&"response.reasoning_summary_text.delta"));
    let rdone = types
        .iter()
        .position(|t| *t == "response.reasoning_summary_text.done")
        .unwrap();
    let first_text = types
        .iter()
        .position(|t| *t == "response.output_text.delta")
        .unwrap();
    assert!(rdone < first_text, "reasoning closes before text starts");
    let done = ev.last().unwrap();
    let fc = first_of(&done["response"]["output"], "function_call").clone();
    assert_eq!(fc["name"], "get_weather");
    let call_id = fc["call_id"].as_str().unwrap().to_string();
    let input = json!([
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]},
        {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": fc["arguments"]},
        {"type": "function_call_output", "call_id": call_id, "output": "sunny"},
    ]);
    let req = json!({"instructions": "Be brief.", "input": input, "tools": tools});
    let r = post_json(s.addr, "/v1/responses", &req);
    assert_eq!(r["status"], "completed");
    let msg = first_of(&r["output"], "message");
    assert_eq!(msg["content"][0]["text"], "It is sunny in Paris.");
    assert!(
        r["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    for bad in [
        json!({"input": "x", "previous_response_id": "resp_1"}),
        json!({"input": "x", "tool_choice": {"type": "function", "name": "f"}}),
        json!({"input": [{"type": "bogus"}]}),
        json!({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
        json!({}),
    ] {
        let r = post(s.addr, "/v1/responses", &bad);
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    }
}

#[test]
fn anthropic_messages_stream_tool_use_and_count_tokens() {
    let s = fake_server(cfg());
    let tools = json!([{"name": "get_weather", "description": "w", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 1000, "system": [{"type": "text", "text": "x-anthropic-billing: 1"}, {"type": "text", "text": "Be brief."}], "messages": [{"role": "user", "content": "weather?"}], "tools": tools, "stream": true, "thinking": {"type": "enabled", "budget_tokens": 1024}});
    let r = post(s.addr, "/v1/messages", &body);
    let ev = r.sse();
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_deref().unwrap()).collect();
    assert_eq!(names[0], "message_start");
    assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);
    let starts: Vec<Value> = ev
        .iter()
        .filter(|(n, _)| n.as_deref() == Some("content_block_start"))
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap()["content_block"]["type"].clone())
        .collect();
    assert_eq!(
        starts,
        vec![json!("thinking"), json!("text"), json!("tool_use")]
    );
    let delta: Value = serde_json::from_str(&ev[ev.len() - 2].1).unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    let tool_start = ev
        .iter()
        .find(|(n, d)| n.as_deref() == Some("content_block_start") && d.contains("tool_use"))
        .unwrap();
    let tool_id = serde_json::from_str::<Value>(&tool_start.1).unwrap()["content_block"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(tool_id.starts_with("toolu_"));
    let partial: String = ev
        .iter()
        .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["delta"]["partial_json"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&partial).unwrap(),
        json!({"city": "Paris & \"Lyon\""})
    );
    // Continuation with the tool result (content before role, as some clients send it).
    let msgs = json!([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "The user wants an answer. Let me think.", "signature": "x"}, {"type": "text", "text": "Checking."}, {"type": "tool_use", "id": tool_id, "name": "get_weather", "input": {"city": "Paris & \"Lyon\""}}]},
        {"content": [{"type": "tool_result", "tool_use_id": tool_id, "content": [{"type": "text", "text": "sunny"}]}], "role": "user"},
    ]);
    let r = post(s.addr, "/v1/messages", &json!({"model": "claude", "max_tokens": 1000, "system": "Be brief.", "messages": msgs, "tools": tools})).json();
    assert_eq!(r["type"], "message");
    assert_eq!(r["stop_reason"], "end_turn");
    let text = first_of(&r["content"], "text");
    assert_eq!(text["text"], "It is sunny in Paris.");
    assert!(
        r["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );
    let req = json!({"model": "claude", "messages": [{"role": "user", "content": "hello"}]});
    let n = post_json(s.addr, "/v1/messages/count_tokens", &req);
    assert!(n["input_tokens"].as_u64().unwrap() > 3);
    let r = post(s.addr, "/v1/messages", &json!({"max_tokens": 10}));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "error");
}

#[test]
fn bad_input_never_kills_the_server() {
    let mut c = cfg();
    c.max_body_bytes = 8 << 20;
    let s = fake_server(c);
    let a = s.addr;
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("/v1/chat/completions", b"{not json".to_vec(), 400),
        ("/v1/chat/completions", b"[1,2]".to_vec(), 400),
        ("/v1/chat/completions", br#"{"messages":"hi"}"#.to_vec(), 400),
        ("/v1/chat/completions", br#"{"messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#.to_vec(), 400),
        ("/v1/chat/completions", br#"{"messages":[{"role":"user","content":"x"}],"stream":1}"#.to_vec(), 400),
        ("/v1/chat/completions", br#"{"messages":[{"role":"user","content":"x"}],"unknown_field":{"a":1},"model":"who-knows"}"#.to_vec(), 200),
        ("/v1/messages", br#"{"messages":[{"role":"user","content":5}]}"#.to_vec(), 400),
        ("/v1/chat/completions", format!("{}{}", "[".repeat(300), "]".repeat(300)).into_bytes(), 400),
        ("/v1/chat/completions", vec![b'x'; 10 << 20], 413),
    ];
    for (path, body, want) in cases {
        let r = request(a, "POST", path, &[], &body);
        assert_eq!(
            r.status,
            want,
            "{path} {:?}: {}",
            String::from_utf8_lossy(&body[..body.len().min(80)]),
            r.text()
        );
    }
    // A prompt past the context.
    let long = "word ".repeat(5000);
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": long}]}),
    );
    assert_eq!(r.status, 400);
    let e = r.json();
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    assert_eq!(e["error"]["n_ctx"], 4096);
    let r = post(
        a,
        "/v1/messages",
        &json!({"max_tokens": 5, "messages": [{"role": "user", "content": long}]}),
    );
    assert_eq!(
        (r.status, r.json()["error"]["type"].as_str()),
        (400, Some("invalid_request_error"))
    );
    // Fuzz: mutate a valid body at random positions; nothing may answer 5xx.
    let valid = json!({"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop": ["x"], "tools": [weather_tool()]}).to_string().into_bytes();
    let mut seed = 0x1234_5678_u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for i in 0..120 {
        let mut b = valid.clone();
        for _ in 0..(1 + rnd() % 4) {
            let p = (rnd() as usize) % b.len();
            match rnd() % 3 {
                0 => b[p] = (rnd() % 256) as u8,
                1 => {
                    b.remove(p);
                }
                _ => b.insert(p, b"{}[]\",:0"[(rnd() % 8) as usize]),
            }
        }
        let path = [
            "/v1/chat/completions",
            "/v1/messages",
            "/v1/responses",
            "/v1/completions",
        ][i % 4];
        let r = request(a, "POST", path, &[], &b);
        assert!(
            r.status < 500,
            "{path} status {} for {:?}",
            r.status,
            String::from_utf8_lossy(&b)
        );
    }
    assert_eq!(
        post(
            a,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}]})
        )
        .status,
        200
    );
}

#[test]
fn cors_options_and_api_key() {
    let mut c = cfg();
    c.cors = true;
    c.api_key = Some("sekrit".into());
    let s = fake_server(c);
    let r = request(s.addr, "OPTIONS", "/v1/chat/completions", &[], b"");
    assert_eq!(r.status, 204);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
    let body = json!({"messages": [{"role": "user", "content": "hi"}]}).to_string();
    let r = request(s.addr, "POST", "/v1/chat/completions", &[], body.as_bytes());
    assert_eq!(r.status, 401);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
    let r = request(
        s.addr,
        "POST",
        "/v1/messages",
        &[("x-api-key", "wrong")],
        b"{}",
    );
    assert_eq!((r.status, r.json()["type"].as_str()), (401, Some("error")));
    assert_eq!(
        request(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &[("Authorization", "Bearer sekrit")],
            body.as_bytes()
        )
        .status,
        200
    );
    assert_eq!(
        request(
            s.addr,
            "POST",
            "/v1/chat/completions",
            &[("x-api-key", "sekrit")],
            body.as_bytes()
        )
        .status,
        200
    );
    assert_eq!(get(s.addr, "/health").status, 200);
}

#[test]
fn disconnect_mid_stream_cancels_and_the_next_request_works() {
    use std::io::{Read, Write};
    let s = fake_server_delay(cfg(), 20);
    let body = json!({"model": "deepseek-chat", "messages": [{"role": "user", "content": "a long answer please"}], "stream": true}).to_string();
    let mut sock = std::net::TcpStream::connect(s.addr).unwrap();
    write!(
        sock,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 512];
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let n = sock.read(&mut buf).unwrap();
    assert!(n > 0);
    drop(sock);
    // The worker notices within a token or two; then it is free again.
    let t = std::time::Instant::now();
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(r.status, 200);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "cancelled generation kept running: {:?}",
        t.elapsed()
    );
    let m = get(s.addr, "/metrics").text();
    assert!(
        m.lines()
            .any(|l| l.starts_with("ds4_cancelled_total ") && !l.ends_with(" 0")),
        "{m}"
    );
}

#[test]
fn full_queue_answers_503() {
    let mut c = cfg();
    c.queue_max = 1;
    let s = fake_server_delay(c, 30);
    let addr = s.addr;
    let handles: Vec<_> = (0..6)
        .map(|_| std::thread::spawn(move || post(addr, "/v1/chat/completions", &json!({"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})).status))
        .collect();
    let statuses: Vec<u16> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(statuses.contains(&503), "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 200 || *s == 503));
}

#[test]
fn load_test_mixed_requests() {
    let s = fake_server(cfg());
    let addr = s.addr;
    let t = std::time::Instant::now();
    let handles: Vec<_> = (0..8)
        .map(|w| {
            std::thread::spawn(move || {
                let mut fails = 0;
                for i in 0..25 {
                    let k = (w + i) % 5;
                    let stream = i % 2 == 0;
                    let r = match k {
                        0 => post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": format!("hi {w} {i}")}], "stream": stream, "max_tokens": 40})),
                        1 => post(addr, "/v1/completions", &json!({"prompt": format!("p {i}"), "stream": stream, "max_tokens": 20})),
                        2 => post(addr, "/v1/responses", &json!({"input": format!("q {i}"), "stream": stream, "max_output_tokens": 30})),
                        3 => post(addr, "/v1/messages", &json!({"max_tokens": 30, "messages": [{"role": "user", "content": "weather?"}], "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}], "stream": stream})),
                        _ => get(addr, "/v1/models"),
                    };
                    let t = r.text();
                    let ok = r.status == 200 && !t.contains("\"error\":{") && !t.contains("event: error");
                    if !ok {
                        fails += 1;
                        eprintln!("load failure: {} {}", r.status, r.text());
                    }
                }
                fails
            })
        })
        .collect();
    let fails: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    eprintln!(
        "load test: 200 requests from 8 clients in {:.2}s, {fails} failures",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(fails, 0);
}
