//! `run_tokenize` / `run_render` over the fixture files piped in unchanged.

mod common;

use common::*;
use ds4_tokenizer::cli::{run_render, run_tokenize};

#[test]
fn render_fixture_file() {
    let input = read_fixture("encoding/encode_cases.jsonl");
    let mut out = Vec::new();
    let n = run_render(&input[..], &mut out).unwrap();
    let (_, cases) = jsonl("encoding/encode_cases.jsonl");
    assert_eq!(n, cases.len());
    let out = String::from_utf8(out).unwrap();
    for (line, case) in out.lines().zip(&cases) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["prompt"], case["prompt"], "{}", case["id"]);
    }
}

#[test]
fn tokenize_fixture_file() {
    let input = read_fixture("tokenizer/tokenize_cases.jsonl");
    let (_, cases) = jsonl("tokenizer/tokenize_cases.jsonl");
    let encode: Vec<_> = cases.iter().filter(|c| c["kind"] == "encode").collect();
    let lines: String = encode
        .iter()
        .map(|c| serde_json::json!({ "text": c["text"] }).to_string() + "\n")
        .collect();
    let mut out = Vec::new();
    assert_eq!(
        run_tokenize(lines.as_bytes(), &mut out, official()).unwrap(),
        encode.len()
    );
    for (line, case) in String::from_utf8(out).unwrap().lines().zip(&encode) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["ids"], case["ids"]);
    }
    // The fixture file itself goes through (header skipped, every case has a "text").
    assert_eq!(
        run_tokenize(&input[..], &mut Vec::new(), official()).unwrap(),
        cases.len()
    );
    // A line without "text" is reported with its line number.
    let err = run_tokenize(
        &b"{\"text\":\"a\"}\n{\"ids\":[1]}\n"[..],
        &mut Vec::new(),
        official(),
    )
    .unwrap_err();
    assert!(err.to_string().starts_with("line 2:"), "{err}");
}
