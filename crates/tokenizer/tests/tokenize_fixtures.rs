//! `fixtures/tokenizer/tokenize_cases.jsonl` and the tiny-vocabulary golden cases.

mod common;

use common::*;
use ds4_tokenizer::Tokenizer;
use sha2::{Digest, Sha256};

#[test]
fn official_tokenizer_file_is_the_pinned_one() {
    let (header, _) = jsonl("tokenizer/tokenize_cases.jsonl");
    let digest = Sha256::digest(read_fixture("tokenizer/tokenizer.json"));
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, OFFICIAL_SHA256);
    assert_eq!(header["meta"]["tokenizer_sha256"], OFFICIAL_SHA256);
    assert_eq!(official().vocab_size(), 129_280);
}

/// Runs `check` (which adds a message to the list for each mismatch) on every case of
/// `kind` (encode, decode) in tokenize_cases.jsonl with the official tokenizer; asserts
/// that there are `count` such cases and no mismatches.
fn check_cases(
    kind: &str,
    count: usize,
    check: impl Fn(&Tokenizer, &serde_json::Value, &mut Vec<String>),
) {
    let tok = official();
    let (_, cases) = jsonl("tokenizer/tokenize_cases.jsonl");
    let cases: Vec<_> = cases.into_iter().filter(|c| c["kind"] == kind).collect();
    let mut failures = Vec::new();
    for c in &cases {
        check(tok, c, &mut failures);
    }
    assert_eq!(cases.len(), count);
    assert_no_failures(&failures);
}

#[test]
fn encode_cases_exact() {
    check_cases("encode", 1319, |tok, c, failures| {
        let text = c["text"].as_str().expect("text");
        let want = ids_of(&c["ids"]);
        let got = tok.encode(text);
        if got != want {
            let k = first_diff(&got, &want);
            failures.push(format!(
                "cat={} first diff at id #{k}: got {:?} want {:?} (text {:?})",
                c["cat"],
                &got[k..(k + 5).min(got.len())],
                &want[k..(k + 5).min(want.len())],
                text.chars().take(80).collect::<String>()
            ));
        }
        // Every encode case round-trips through decode.
        let back = tok.decode(&want, false);
        if back != text {
            failures.push(format!("cat={} decode(encode) differs", c["cat"]));
        }
    });
}

#[test]
fn decode_cases_exact_and_streaming() {
    check_cases("decode", 202, |tok, c, failures| {
        let ids = ids_of(&c["ids"]);
        let skip = c["skip_special_tokens"].as_bool().expect("flag");
        let want = c["text"].as_str().expect("text");
        let got = tok.decode(&ids, skip);
        if got != want {
            let k = first_diff(got.as_bytes(), want.as_bytes());
            failures.push(format!("cat={} decode differs at byte {k}", c["cat"]));
        }
        let mut dec = tok.stream_decoder(skip);
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&dec.push(id));
        }
        streamed.push_str(&dec.finish());
        if streamed != want {
            let k = first_diff(streamed.as_bytes(), want.as_bytes());
            failures.push(format!(
                "cat={} stream decode differs at byte {k}",
                c["cat"]
            ));
        }
    });
}

#[test]
fn special_ids_by_string() {
    let s = official().special_ids().expect("all markers present");
    assert_eq!((s.bos, s.eos), (0, 1));
    assert_eq!((s.user, s.assistant), (128803, 128804));
    assert_eq!(
        (s.think_start, s.think_end, s.dsml),
        (128821, 128822, 128825)
    );
    assert_eq!(s.latest_reminder, Some(128828));
    let t = official();
    assert!(t.is_special(0) && !t.is_special(128803));
    assert_eq!(t.id_to_token(128825), Some("｜DSML｜"));
}

#[test]
fn tiny_vocabulary_golden() {
    let tok = Tokenizer::from_tokenizer_json(&read_fixture("tiny/tokenizer.json"))
        .expect("tiny tokenizer.json loads");
    let manifest: serde_json::Value =
        serde_json::from_slice(&read_fixture("tiny/manifest.json")).expect("manifest");
    let t = &manifest["tokenizer"];
    for (s, id) in t["special_ids"].as_object().expect("special ids") {
        assert_eq!(tok.token_to_id(s), Some(id.as_u64().unwrap() as u32), "{s}");
    }
    let golden = t["golden"].as_array().expect("golden");
    assert!(!golden.is_empty());
    for g in golden {
        let text = g["text"].as_str().unwrap();
        assert_eq!(tok.encode(text), ids_of(&g["ids"]), "{text:?}");
    }
    assert!(tok.special_ids().is_ok());
}

/// The GGUF constructor, fed the same vocabulary with llama.cpp token types, must behave
/// exactly like the tokenizer.json one.
#[test]
fn gguf_vocab_matches_json() {
    let json: serde_json::Value =
        serde_json::from_slice(&read_fixture("tokenizer/tokenizer.json")).unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); 129_280];
    let mut types = vec![1i32; 129_280];
    for (s, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = s.clone();
    }
    for a in json["added_tokens"].as_array().unwrap() {
        let id = a["id"].as_u64().unwrap() as usize;
        tokens[id] = a["content"].as_str().unwrap().to_string();
        types[id] = if a["special"] == true { 3 } else { 4 };
    }
    let merges: Vec<String> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect();
    let gguf = Tokenizer::from_gguf_vocab(tokens, merges, Some(types)).unwrap();
    let tok = official();
    let (_, cases) = jsonl("tokenizer/tokenize_cases.jsonl");
    for c in &cases {
        let ids = if c["kind"] == "encode" {
            let text = c["text"].as_str().unwrap();
            let ids = gguf.encode(text);
            assert_eq!(ids, tok.encode(text), "cat={}", c["cat"]);
            ids
        } else {
            ids_of(&c["ids"])
        };
        for skip in [false, true] {
            assert_eq!(gguf.decode(&ids, skip), tok.decode(&ids, skip));
        }
    }
}
