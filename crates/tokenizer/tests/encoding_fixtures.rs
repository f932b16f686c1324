//! `fixtures/encoding`: prompt rendering, prompt ids and completion parsing.

mod common;

use common::*;
use ds4_tokenizer::chat::{
    encode_messages, encode_messages_marked, EncodeOptions, Message, ThinkingMode,
};
use ds4_tokenizer::dsml::parse_completion;
use serde_json::Value;

fn messages(v: &Value) -> Vec<Message> {
    serde_json::from_value(v.clone()).expect("messages deserialize")
}

fn options(c: &Value) -> EncodeOptions {
    EncodeOptions {
        thinking_mode: serde_json::from_value(c["thinking_mode"].clone()).unwrap(),
        reasoning_effort: serde_json::from_value(c["reasoning_effort"].clone()).unwrap(),
        drop_thinking: c["drop_thinking"].as_bool().unwrap_or(true),
        add_default_bos_token: c["add_default_bos_token"].as_bool().unwrap_or(true),
    }
}

#[test]
fn encode_cases_prompt_and_ids() {
    let tok = official();
    let (header, cases) = jsonl("encoding/encode_cases.jsonl");
    assert_eq!(header["meta"]["tokenizer_sha256"], OFFICIAL_SHA256);
    let mut failures = Vec::new();
    let mut injected = 0;
    for c in &cases {
        let mut msgs = messages(&c["messages"]);
        if let Some(tools) = c.get("tools") {
            msgs[0].tools = Some(serde_json::from_value(tools.clone()).unwrap());
        }
        let context = match &c["context"] {
            Value::Null => Vec::new(),
            v => messages(v),
        };
        let want = c["prompt"].as_str().unwrap();
        let label = format!("{} {}", c["id"], c["name"]);
        match encode_messages(&msgs, &context, &options(c)) {
            Ok(got) if got == want => {
                let ids = tok.encode(&got);
                let want_ids = ids_of(&c["prompt_ids"]);
                if ids != want_ids {
                    failures.push(format!(
                        "{label}: ids differ at #{}",
                        first_diff(&ids, &want_ids)
                    ));
                }
                // The server's path: client text marked plain. Where no client text
                // spells a control token the ids must not move; where some does (the
                // official encoder then emits the control token), it stays plain text.
                let marked = encode_messages_marked(&msgs, &context, &options(c)).unwrap();
                assert_eq!(marked.text(), got);
                let marked_ids = tok.encode_marked(marked.text(), marked.plain_ranges());
                let plain = marked.plain_ranges();
                let spelled = plain
                    .iter()
                    .any(|r| tok.encode(&got[r.clone()]).iter().any(|&t| tok.is_added(t)));
                if spelled {
                    injected += 1;
                    let mut at = 0;
                    for &t in &marked_ids {
                        if tok.is_added(t) && plain.iter().any(|r| r.contains(&at)) {
                            failures.push(format!("{label}: control token {t} at byte {at}"));
                        }
                        at += tok.token_bytes(t).len();
                    }
                    assert_eq!(tok.decode(&marked_ids, false), got, "{label}");
                    assert_ne!(marked_ids, want_ids, "{label}");
                } else if marked_ids != want_ids {
                    failures.push(format!(
                        "{label}: marked ids differ at #{}",
                        first_diff(&marked_ids, &want_ids)
                    ));
                }
            }
            Ok(got) => {
                let k = first_diff(got.as_bytes(), want.as_bytes());
                let lo = k.saturating_sub(40);
                failures.push(format!(
                    "{label}: prompt differs at byte {k}: got {:?} want {:?}",
                    String::from_utf8_lossy(&got.as_bytes()[lo..(k + 60).min(got.len())]),
                    String::from_utf8_lossy(&want.as_bytes()[lo..(k + 60).min(want.len())]),
                ));
            }
            Err(e) => failures.push(format!("{label}: error {e}")),
        }
    }
    assert_eq!(cases.len(), 156);
    // The cases whose messages, reasoning, tool arguments or results spell markers
    // (user_content_contains_marker_strings, string_args_markup_quotes_newlines, …).
    assert_eq!(injected, 18);
    assert_no_failures(&failures);
}

#[test]
fn upstream_pairs() {
    for n in 1..=4 {
        let input: Value = serde_json::from_slice(&read_fixture(&format!(
            "encoding/upstream/test_input_{n}.json"
        )))
        .unwrap();
        let want = String::from_utf8(read_fixture(&format!(
            "encoding/upstream/test_output_{n}.txt"
        )))
        .unwrap();
        let msgs = if n == 1 {
            let mut m = messages(&input["messages"]);
            m[0].tools = Some(serde_json::from_value(input["tools"].clone()).unwrap());
            m
        } else {
            messages(&input)
        };
        let opts = EncodeOptions {
            thinking_mode: if n == 4 {
                ThinkingMode::Chat
            } else {
                ThinkingMode::Thinking
            },
            ..Default::default()
        };
        let got = encode_messages(&msgs, &[], &opts).unwrap();
        assert_eq!(got, want, "upstream pair {n}");
    }
}

#[test]
fn parse_cases() {
    let (_, cases) = jsonl("encoding/parse_cases.jsonl");
    let mut failures = Vec::new();
    let mut n_err = 0;
    for c in &cases {
        let mode: ThinkingMode = serde_json::from_value(c["thinking_mode"].clone()).unwrap();
        let text = c["completion"].as_str().unwrap();
        let name = c["name"].as_str().unwrap();
        let got = parse_completion(text, mode);
        match (got, c.get("parsed")) {
            (Ok(p), Some(want)) => {
                let got = serde_json::to_value(&p).unwrap();
                if got != *want {
                    failures.push(format!("{name}: got {got} want {want}"));
                }
            }
            (Err(e), None) => {
                n_err += 1;
                if e.python_type() != c["error"] || e.to_string() != c["error_message"] {
                    failures.push(format!(
                        "{name}: error {}: {e} vs {} {}",
                        e.python_type(),
                        c["error"],
                        c["error_message"]
                    ));
                }
            }
            (Ok(p), None) => failures.push(format!("{name}: parsed {p:?}, expected an error")),
            (Err(e), Some(_)) => failures.push(format!("{name}: unexpected error {e}")),
        }
    }
    assert_eq!(cases.len(), 92);
    assert_eq!(n_err, 14);
    assert_no_failures(&failures);
}
