//! Whole-model checks of a backend against the tiny fixtures' official logits
//! (fixtures/tiny/README.md): every variant, sequence and position, both numeric
//! modes, with the fixture tiers as pass criteria. The CUDA run of `ds4-tool
//! gpu-selftest` ([`run_fixtures`]: the fixtures, batched prefill against decode,
//! snapshots across backends; [`check_graph_variants`]: each restructuring of the
//! decode graph off and on) is here too, so the engine's own tests run it.

use std::path::Path;

use crate::dev::{Backend, LogitRows};
use crate::{argmax, Numerics};
use anyhow::{Context, Result};

#[cfg(feature = "cuda")]
mod cuda;
mod greedy;
pub use greedy::{greedy_run_identity, run_samplers, sample_run_identity};

#[cfg(feature = "cuda")]
pub use cuda::{
    check_batch, check_graph_variants, check_imatrix, check_mtp, check_offload, check_sampling,
    check_split, check_steering, run_fixtures, Tally,
};

/// One (variant, sequence, mode) comparison.
#[derive(Clone, Debug)]
pub struct FixtureResult {
    pub variant: String,
    pub seq: String,
    pub numerics: Numerics,
    pub max: f32,
    pub median: f32,
    pub p99: f32,
    pub argmax_agree: f64,
    /// Positions compared and positions whose argmax agrees.
    pub positions: usize,
    pub agreeing: usize,
    /// Positions whose argmax differs although the reference margin is large.
    pub argmax_violations: usize,
    pub greedy_ok: bool,
    pub passed: bool,
}

/// The tiny fixtures: (variant, file, expected-logits set).
pub const VARIANTS: [(&str, &str, &str); 3] = [
    ("q2", "tiny-q2.gguf", "q2"),
    ("q4", "tiny-q4.gguf", "q4"),
    ("plain", "tiny-plain.gguf", "q2"),
];

pub struct Manifest(serde_json::Value);

impl Manifest {
    pub fn load(dir: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(dir.join("manifest.json"))
            .with_context(|| format!("no manifest.json in {}", dir.display()))?;
        Ok(Manifest(serde_json::from_str(&text)?))
    }

    pub fn tokens(&self, seq: &str) -> Vec<u32> {
        nums(&self.0["sequences"][seq]["tokens"])
            .into_iter()
            .map(|v| v as u32)
            .collect()
    }

    fn expected(&self, set: &str, seq: &str) -> &serde_json::Value {
        &self.0["expected"][set][seq]
    }
}

fn nums(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default()
}

fn read_f32(path: &Path) -> Result<Vec<f32>> {
    let b = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn percentile(sorted: &[f32], q: f64) -> f32 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Per position (row of `vocab` logits), the largest |got − want|.
fn position_deltas(got: &[f32], want: &[f32], vocab: usize) -> Vec<f32> {
    got.chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .map(|(g, w)| {
            g.iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max)
        })
        .collect()
}

/// (max, median, p99) of per-position deltas.
fn spread(per_pos: &[f32]) -> (f32, f32, f32) {
    let max = per_pos.iter().copied().fold(0.0f32, f32::max);
    let mut sorted = per_pos.to_vec();
    sorted.sort_by(f32::total_cmp);
    (max, percentile(&sorted, 0.5), percentile(&sorted, 0.99))
}

/// The fixture tier of `numerics` on per-position max |Δlogit| (fixtures/tiny/README.md):
/// exact max ≤ 1e-3 and median ≤ 1e-4; fast median ≤ 0.15, p99 ≤ 0.5, max ≤ 1.
fn within_tier(numerics: Numerics, max: f32, median: f32, p99: f32) -> bool {
    if numerics == Numerics::Exact {
        max <= 1e-3 && median <= 1e-4
    } else {
        median <= 0.15 && p99 <= 0.5 && max <= 1.0
    }
}

/// Compares `backend` (fresh, empty) on one sequence.
pub fn check_sequence(
    backend: &mut dyn Backend,
    manifest: &Manifest,
    dir: &Path,
    variant: &str,
    set: &str,
    seq: &str,
    numerics: Numerics,
) -> Result<FixtureResult> {
    let tokens = manifest.tokens(seq);
    let vocab = manifest.0["config"]["vocab"]
        .as_u64()
        .context("manifest config.vocab")? as usize;
    let got = backend.forward(&tokens, LogitRows::All)?;
    let want = read_f32(
        &dir.join("expected")
            .join(set)
            .join(format!("{seq}.logits.f32")),
    )?;
    anyhow::ensure!(
        got.len() == want.len(),
        "{variant}/{seq}: {} logits, expected {}",
        got.len(),
        want.len()
    );
    let exp = manifest.expected(set, seq);
    let margins = nums(&exp["top1_top2_margin"]);
    let exact = numerics == Numerics::Exact;
    let margin_rule = if exact { 2e-3 } else { 0.75 };
    let per_pos = position_deltas(&got, &want, vocab);
    let (mut agree, mut violations) = (0usize, 0usize);
    for (t, (g, w)) in got
        .chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .enumerate()
    {
        if argmax(g) == argmax(w) {
            agree += 1;
        } else if margins.get(t).copied().unwrap_or(0.0) >= margin_rule {
            violations += 1;
        }
    }
    let (max, median, p99) = spread(&per_pos);
    let agree_frac = agree as f64 / per_pos.len() as f64;

    // Greedy continuation from the end of the sequence.
    let greedy = nums(&exp["greedy"]["tokens"]);
    let gmargins = nums(&exp["greedy"]["top1_top2_margin"]);
    let mut logits = got[got.len() - vocab..].to_vec();
    let mut greedy_ok = true;
    for (i, &want_tok) in greedy.iter().enumerate() {
        if !exact && gmargins.get(i).copied().unwrap_or(0.0) < 0.75 {
            break; // beyond this step the fast tier promises nothing
        }
        let tok = argmax(&logits);
        if tok != want_tok as u32 {
            greedy_ok = false;
            break;
        }
        if i + 1 < greedy.len() {
            logits = backend.forward(&[tok], LogitRows::Last)?;
        }
    }
    // The fast tier's agreement *rate* (≥ 95%) is judged over all positions of a model
    // (`pooled_agreement`): on a 12-position sequence a single flip at a near-tie
    // (reference margin 0.0016 in q4/a) would read 91.7%. Every other criterion,
    // including "argmax equal wherever the margin ≥ 0.75", holds per sequence.
    let passed = within_tier(numerics, max, median, p99) && violations == 0 && greedy_ok;
    Ok(FixtureResult {
        variant: variant.into(),
        seq: seq.into(),
        numerics,
        max,
        median,
        p99,
        argmax_agree: agree_frac,
        positions: per_pos.len(),
        agreeing: agree,
        argmax_violations: violations,
        greedy_ok,
        passed,
    })
}

/// Argmax agreement over every position of several sequences, and whether it meets
/// the fast tier's 95%.
pub fn pooled_agreement(results: &[FixtureResult]) -> (f64, bool) {
    let n: usize = results.iter().map(|r| r.positions).sum();
    let a: usize = results.iter().map(|r| r.agreeing).sum();
    let frac = a as f64 / n.max(1) as f64;
    (frac, frac >= 0.95)
}
