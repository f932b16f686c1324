//! Tokenizer throughput on prose and code from the vendored fixtures.
//!
//! `cargo bench -p ds4-tokenizer --bench tokenize`

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ds4_tokenizer::Tokenizer;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// Texts of the fixture cases whose category starts with one of `prefixes`, joined and
/// repeated to about `target` bytes.
fn corpus(prefixes: &[&str], target: usize) -> String {
    let text = std::fs::read_to_string(fixtures().join("tokenizer/tokenize_cases.jsonl"))
        .expect("tokenize_cases.jsonl");
    let mut parts = Vec::new();
    for line in text.lines().skip(1) {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        let cat = v["cat"].as_str().unwrap_or("");
        if v["kind"] == "encode" && prefixes.iter().any(|p| cat.starts_with(p)) {
            parts.push(v["text"].as_str().unwrap_or("").to_string());
        }
    }
    let one = parts.join("\n\n");
    let mut s = String::with_capacity(target + one.len());
    while s.len() < target {
        s.push_str(&one);
        s.push('\n');
    }
    s
}

fn bench(c: &mut Criterion) {
    let bytes = std::fs::read(fixtures().join("tokenizer/tokenizer.json")).expect("tokenizer.json");
    let tok = Tokenizer::from_tokenizer_json(&bytes).expect("load");
    let mut group = c.benchmark_group("encode");
    for (name, prefixes) in [
        ("prose_en_it", &["prose_en", "prose_it"][..]),
        ("prose_all_languages", &["prose_"][..]),
        ("code", &["code_"][..]),
    ] {
        let text = corpus(prefixes, 4 << 20);
        group.throughput(Throughput::Bytes(text.len() as u64));
        group.sample_size(10);
        group.bench_function(name, |b| b.iter(|| black_box(tok.encode(black_box(&text)))));
    }
    group.finish();

    let text = corpus(&["prose_en", "prose_it"], 1 << 20);
    let ids = tok.encode(&text);
    let mut group = c.benchmark_group("decode");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.sample_size(10);
    group.bench_function("prose_en_it", |b| {
        b.iter(|| black_box(tok.decode(black_box(&ids), false)))
    });
    group.finish();

    c.bench_function("load_tokenizer_json", |b| {
        b.iter(|| black_box(Tokenizer::from_tokenizer_json(black_box(&bytes)).is_ok()))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
