//! The streaming DSML parser against the strict parser's golden cases, fed token by token
//! exactly as the engine would (stream-decoded ids of the tokenized completion).

mod common;

use common::streamed::Streamed;
use common::*;
use ds4_tokenizer::chat::ThinkingMode;
use ds4_tokenizer::dsml_stream::{StreamOptions, StreamParser};
use serde_json::Value;

#[test]
fn streaming_agrees_with_strict_parser() {
    let tok = official();
    let (_, cases) = jsonl("encoding/parse_cases.jsonl");
    let mut checked = 0;
    let mut failures = Vec::new();
    for c in &cases {
        let mode: ThinkingMode = serde_json::from_value(c["thinking_mode"].clone()).unwrap();
        let text = c["completion"].as_str().unwrap();
        let name = c["name"].as_str().unwrap();
        let opts = StreamOptions {
            thinking: mode == ThinkingMode::Thinking,
            ..Default::default()
        };
        let mut parser = StreamParser::new(opts);
        let mut dec = tok.stream_decoder(false);
        let mut events = Vec::new();
        for id in tok.encode(text) {
            events.extend(parser.push(&dec.push(id)));
        }
        events.extend(parser.push(&dec.finish()));
        let (last, out) = parser.finish();
        events.extend(last);
        let Some(want) = c.get("parsed") else {
            continue;
        };
        checked += 1;
        // Streamed pieces add up to the outcome.
        let Streamed {
            reasoning,
            content,
            args,
        } = Streamed::of(&events);
        if out.malformed || out.unterminated {
            failures.push(format!(
                "{name}: malformed={} unterminated={}",
                out.malformed, out.unterminated
            ));
            continue;
        }
        if content != out.content
            || Some(&reasoning) != out.reasoning.as_ref().or(Some(&String::new()))
        {
            failures.push(format!("{name}: streamed text differs from outcome"));
        }
        if out.content != want["content"].as_str().unwrap() {
            failures.push(format!(
                "{name}: content {:?} vs {}",
                out.content, want["content"]
            ));
        }
        if mode == ThinkingMode::Thinking
            && out.reasoning.as_deref() != want["reasoning_content"].as_str()
        {
            failures.push(format!("{name}: reasoning differs"));
        }
        let calls = want["tool_calls"].as_array().unwrap();
        if calls.len() != out.tool_calls.len() {
            failures.push(format!(
                "{name}: {} calls vs {}",
                out.tool_calls.len(),
                calls.len()
            ));
            continue;
        }
        for (k, (got, want)) in out.tool_calls.iter().zip(calls).enumerate() {
            assert_eq!(got.arguments, args[k]);
            if got.name != want["function"]["name"].as_str().unwrap() {
                failures.push(format!("{name}: call {k} name differs"));
            }
            let official = want["function"]["arguments"].as_str().unwrap();
            // Same arguments as JSON values whenever the official string is JSON at all.
            if let Ok(w) = serde_json::from_str::<Value>(official) {
                match serde_json::from_str::<Value>(&got.arguments) {
                    Ok(g) if g == w => {}
                    _ => failures.push(format!(
                        "{name}: call {k} arguments {} vs {official}",
                        got.arguments
                    )),
                }
            }
        }
    }
    assert_eq!(checked, 78);
    assert_no_failures(&failures);
}

/// Regression (found by the fuzzer): a malformed block's raw text must not depend on how
/// the stream was cut. Every fixture completion, whole vs one character at a time.
#[test]
fn outcome_independent_of_split() {
    let (_, cases) = jsonl("encoding/parse_cases.jsonl");
    for c in &cases {
        let text = c["completion"].as_str().unwrap();
        for thinking in [false, true] {
            let opts = StreamOptions {
                thinking,
                ..Default::default()
            };
            let whole = ds4_tokenizer::dsml_stream::parse_streaming(text, opts);
            let mut p = StreamParser::new(opts);
            let mut buf = [0u8; 4];
            for ch in text.chars() {
                p.push(ch.encode_utf8(&mut buf));
            }
            assert_eq!(p.finish().1, whole, "{}", c["name"]);
        }
    }
}
