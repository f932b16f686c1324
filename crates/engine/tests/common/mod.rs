//! Shared helpers for the fixture tests: paths, manifest, comparison statistics.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use ds4_engine::dev::{LoadOptions, Model};
use ds4_engine::Numerics;
use serde_json::Value;

pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny")
}

pub fn manifest() -> &'static Value {
    static M: OnceLock<Value> = OnceLock::new();
    M.get_or_init(|| {
        let s = std::fs::read_to_string(dir().join("manifest.json")).unwrap();
        serde_json::from_str(&s).unwrap()
    })
}

/// `plain` uses the q2 expectations.
pub fn weight_set(variant: &str) -> &'static str {
    if variant == "q4" {
        "q4"
    } else {
        "q2"
    }
}

pub fn load(variant: &str, numerics: Numerics) -> Model {
    Model::load(
        dir().join(format!("tiny-{variant}.gguf")),
        LoadOptions { numerics },
    )
    .unwrap()
}

pub fn tokens(seq: &str) -> Vec<u32> {
    ids(&manifest()["sequences"][seq]["tokens"])
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn expected(variant: &str, seq: &str) -> &'static Value {
    &manifest()["expected"][weight_set(variant)][seq]
}

pub fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

pub fn read_f32(rel: &str) -> Vec<f32> {
    let b = std::fs::read(dir().join(rel)).unwrap();
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn argmax(v: &[f32]) -> usize {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[b] {
            b = i;
        }
    }
    b
}

#[derive(Debug)]
pub struct Stats {
    pub per_pos: Vec<f64>,
    pub max: f64,
    pub median: f64,
    pub p99: f64,
    pub argmax_agree: f64,
    /// Largest expected margin at a position whose argmax differs (0 if none).
    pub worst_mismatch_margin: f64,
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    // Nearest-rank on the sorted values (numpy 'linear' would interpolate; the
    // difference is irrelevant at these tolerances).
    let n = sorted.len();
    if n == 0 {
        return 0.0;
    }
    let pos = q * (n - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

pub fn compare(got: &[f32], want: &[f32], vocab: usize, margins: &[f64]) -> Stats {
    assert_eq!(got.len(), want.len());
    let n = want.len() / vocab;
    let mut per_pos = Vec::with_capacity(n);
    let mut agree = 0;
    let mut worst = 0.0f64;
    for t in 0..n {
        let g = &got[t * vocab..(t + 1) * vocab];
        let w = &want[t * vocab..(t + 1) * vocab];
        let d = g
            .iter()
            .zip(w)
            .map(|(a, b)| (*a as f64 - *b as f64).abs())
            .fold(0.0, f64::max);
        per_pos.push(d);
        if argmax(g) == argmax(w) {
            agree += 1;
        } else {
            worst = worst.max(margins[t]);
        }
    }
    let mut s = per_pos.clone();
    s.sort_by(f64::total_cmp);
    Stats {
        max: *s.last().unwrap(),
        median: quantile(&s, 0.5),
        p99: quantile(&s, 0.99),
        argmax_agree: agree as f64 / n as f64,
        worst_mismatch_margin: worst,
        per_pos,
    }
}
