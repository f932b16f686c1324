//! Batched decode steps over several sessions (`cuda/batched.rs`, `state/batch.rs`):
//! sessions at different positions — across the window and the ratio-4 and ratio-128
//! compression boundaries, one with a pending multi-row step, one reset — decode their
//! tokens together through [`Backend::decode_rows`], against the same sessions decoding
//! one token at a time. Each row must give the lone session's tokens (Exact numerics:
//! the same argmax and the Exact tier; Fast: the Fast tier), and a few plain tokens
//! after the batched steps check that every session's KV state was written as its own.

use std::sync::Arc;

use anyhow::Result;
use ds4_cuda::selftest::same_bits;

use super::Tally;
use crate::dev::{Backend, CudaBackend, CudaWeights, Gpu, LoadOptions, LogitRows, Model};
use crate::dev_fixture::{position_deltas, spread, within_tier, Manifest, VARIANTS};
use crate::{argmax, Numerics};

/// Prompt lengths of the sessions: one token, inside the 16-token window, across it,
/// just before and after ratio-4 and ratio-128 rows, and one long prompt. Eight, so a
/// step of all of them takes the products' tensor-core paths (`tokens_mma`, `f16_mma`:
/// from 8 rows) where the fixture's shapes fit them.
const PROMPTS: [usize; 8] = [1, 6, 17, 127, 130, 255, 258, 400];
/// Batched steps, then plain tokens per session.
const STEPS: usize = 12;
const AFTER: usize = 3;

/// The logits of every row of every step (`[step][session][vocab]` flattened) and of
/// the plain tokens after them, for sessions on `tokens` (session i's tokens start at
/// i · 37, wrapping). `batched` decodes each step's rows through `decode_rows`, in
/// groups that change from step to step (all sessions, then subsets, in another
/// order); otherwise one session at a time.
fn script(
    weights: &Arc<CudaWeights>,
    numerics: Numerics,
    tokens: &[u32],
    batched: bool,
) -> Result<Vec<f32>> {
    let n = PROMPTS.len();
    let tok = |i: usize, p: usize| tokens[(i * 37 + p) % tokens.len()];
    let mut sessions: Vec<Box<dyn Backend>> = Vec::with_capacity(n);
    for (i, &len) in PROMPTS.iter().enumerate() {
        let mut b: Box<dyn Backend> = Box::new(CudaBackend::new(weights, 4096, numerics)?);
        let prompt: Vec<u32> = (0..len).map(|p| tok(i, p)).collect();
        b.forward(&prompt, LogitRows::Last)?;
        sessions.push(b);
    }
    // Session 1 has a multi-row step pending (kept whole by the next decode), session
    // 2 was reset and prefilled again (its state is cleared lazily).
    sessions[1].step_rows(&[tok(1, PROMPTS[1]), tok(1, PROMPTS[1] + 1)])?;
    sessions[2].reset();
    let again: Vec<u32> = (0..PROMPTS[2]).map(|p| tok(2, p)).collect();
    sessions[2].forward(&again, LogitRows::Last)?;
    let mut pos: Vec<usize> = (0..n).map(|i| sessions[i].n_tokens()).collect();
    let mut out = Vec::new();
    for step in 0..STEPS {
        // Which sessions decode this step, in which order.
        let rows: Vec<usize> = match step % 3 {
            0 => (0..n).collect(),
            1 => (0..n).rev().step_by(2).collect(),
            _ => vec![4, 0, 6],
        };
        let toks: Vec<u32> = rows.iter().map(|&i| tok(i, pos[i])).collect();
        let mut logits: Vec<Vec<f32>> = Vec::with_capacity(rows.len());
        if batched {
            let mut picked: Vec<Option<&mut Box<dyn Backend>>> =
                sessions.iter_mut().map(Some).collect();
            let mut backs: Vec<&mut dyn Backend> = Vec::with_capacity(rows.len());
            for &i in &rows {
                backs.push(picked[i].take().expect("distinct rows").as_mut());
            }
            let (first, rest) = backs.split_first_mut().expect("rows");
            for r in first.decode_rows(rest, &toks) {
                logits.push(r?);
            }
        } else {
            for (&i, &t) in rows.iter().zip(&toks) {
                logits.push(sessions[i].forward(&[t], LogitRows::Last)?);
            }
        }
        for (&i, l) in rows.iter().zip(logits) {
            pos[i] += 1;
            out.extend(l);
        }
    }
    for (i, s) in sessions.iter_mut().enumerate() {
        for _ in 0..AFTER {
            out.extend(s.forward(&[tok(i, pos[i])], LogitRows::Last)?);
            pos[i] += 1;
        }
    }
    Ok(out)
}

/// Each fixture model: the batched sessions against the same sessions one at a time.
pub fn check_batch(
    gpu: &Arc<Gpu>,
    dir: &std::path::Path,
    line: &mut dyn FnMut(&str),
) -> Result<Tally> {
    let manifest = Manifest::load(dir)?;
    let tokens = manifest.tokens("c");
    let mut tally = Tally::default();
    line("\nbatched decode: sessions at different positions in one step against each alone");
    for (variant, file, _) in VARIANTS {
        let model = Model::load(dir.join(file), LoadOptions::default())?;
        let weights = Arc::new(CudaWeights::upload(gpu, &model, &|_| {})?);
        let vocab = weights.config.vocab;
        for numerics in [Numerics::Exact, Numerics::Fast] {
            let want = script(&weights, numerics, &tokens, false)?;
            let got = script(&weights, numerics, &tokens, true)?;
            let bits = same_bits(&got, &want);
            let deltas = position_deltas(&got, &want, vocab);
            let (max, median, p99) = spread(&deltas);
            let flips = got
                .chunks_exact(vocab)
                .zip(want.chunks_exact(vocab))
                .filter(|(g, w)| argmax(g) != argmax(w))
                .count();
            let same_tokens = numerics == Numerics::Fast || flips == 0;
            tally.record(
                line,
                got.len() == want.len() && same_tokens && within_tier(numerics, max, median, p99),
                format_args!(
                    "{variant:<6} batch {:<6}: {} rows, {} greedy tokens differ, max |Δ| {max:.2e} (median {median:.1e}, p99 {p99:.1e}), {} of {} logits not bit-identical",
                    format!("{numerics:?}"),
                    deltas.len(),
                    flips,
                    bits.differ,
                    bits.total
                ),
            );
        }
    }
    Ok(tally)
}
