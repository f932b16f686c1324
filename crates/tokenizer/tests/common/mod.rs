//! Shared helpers for the integration tests: fixture paths and the official tokenizer.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use ds4_tokenizer::Tokenizer;

pub mod streamed;

pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(rel)
}

pub fn read_fixture(rel: &str) -> Vec<u8> {
    let p = fixture(rel);
    std::fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

/// Non-header lines of a JSON Lines fixture, parsed with key order kept.
pub fn jsonl(rel: &str) -> (serde_json::Value, Vec<serde_json::Value>) {
    let text = String::from_utf8(read_fixture(rel)).expect("fixture is UTF-8");
    let mut lines = text.lines();
    let header: serde_json::Value =
        serde_json::from_str(lines.next().expect("header line")).expect("header JSON");
    let cases = lines
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).expect("case JSON"))
        .collect();
    (header, cases)
}

pub const OFFICIAL_SHA256: &str =
    "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf";

pub fn official() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let bytes = read_fixture("tokenizer/tokenizer.json");
        Tokenizer::from_tokenizer_json(&bytes).expect("official tokenizer.json loads")
    })
}

pub fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Index of the first difference between two sequences (or the shorter length).
pub fn first_diff<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

/// Fails with every collected case failure listed, one a line.
pub fn assert_no_failures(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
