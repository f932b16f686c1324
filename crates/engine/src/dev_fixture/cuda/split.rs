//! A model split by layers over GPUs (`cuda/split.rs`), checked on one card: both
//! stages on the same GPU run the single-GPU kernels on the same inputs, so the logits
//! must equal the unsplit run's bit for bit through the batched prefill, the captured
//! decode graphs, a state exported and imported, and a copy of the session.

use std::sync::Arc;

use anyhow::Result;
use ds4_cuda::selftest::same_bits;

use super::Tally;
use crate::dev::{Backend, CudaBackend, CudaWeights, Gpu, LoadOptions, LogitRows, Model};
use crate::dev_fixture::{Manifest, VARIANTS};
use crate::placement::Placement;
use crate::Numerics;

/// Sequence b: a third as one batched forward, a 4-row step of which 2 rows are kept,
/// then token by token to two thirds; the state then moves through the host form into
/// a fresh session and a copy of it decodes the rest.
fn script(
    fresh: &dyn Fn() -> Result<Box<dyn Backend>>,
    tokens: &[u32],
) -> Result<(Vec<f32>, crate::kv::KvCache)> {
    let mut b = fresh()?;
    let (a, m) = (tokens.len() / 3, 2 * tokens.len() / 3);
    let mut out = b.forward(&tokens[..a], LogitRows::All)?;
    out.extend(b.step_rows(&tokens[a..a + 4])?);
    b.commit_rows(2)?;
    for t in &tokens[a + 2..m] {
        out.extend(b.forward(std::slice::from_ref(t), LogitRows::Last)?);
    }
    let state = b.export_state()?;
    let mut moved = fresh()?;
    moved.import_state(state.clone())?;
    let mut copy = moved.try_clone_box()?;
    for t in &tokens[m..] {
        out.extend(copy.forward(std::slice::from_ref(t), LogitRows::Last)?);
    }
    Ok((out, state))
}

/// Each fixture model as one upload and as two stages on `gpu`.
pub fn check_split(
    gpu: &Arc<Gpu>,
    dir: &std::path::Path,
    line: &mut dyn FnMut(&str),
) -> Result<Tally> {
    let manifest = Manifest::load(dir)?;
    let tokens = manifest.tokens("b");
    let mut tally = Tally::default();
    line("\nlayer split: two stages (both on this GPU) against one upload");
    for (variant, file, _) in VARIANTS {
        let model = Model::load(dir.join(file), LoadOptions::default())?;
        let n_layer = model.config().n_layer;
        let cut = n_layer / 2;
        let whole = Arc::new(CudaWeights::upload(gpu, &model, &|_| {})?);
        let stage = |r: std::ops::Range<usize>, host: bool| -> Result<Arc<CudaWeights>> {
            let p = Placement {
                experts_on_host: vec![host; n_layer],
                embedding_on_host: host,
            };
            let w = CudaWeights::upload_placed(gpu, &model, p, r, host, &|_| {})?;
            Ok(Arc::new(w))
        };
        let stages = [stage(0..cut, false)?, stage(cut..n_layer, false)?];
        // The second stage's experts and embedding in host memory (a split that offloads).
        let offloaded = [stages[0].clone(), stage(cut..n_layer, true)?];
        for numerics in [Numerics::Exact, Numerics::Fast] {
            let one = || -> Result<Box<dyn Backend>> {
                Ok(Box::new(CudaBackend::new(&whole, 4096, numerics)?))
            };
            let (want, want_kv) = script(&one, &tokens)?;
            for (what, st) in [("", &stages), (" +offload", &offloaded)] {
                let split = || -> Result<Box<dyn Backend>> {
                    Ok(Box::new(crate::cuda::SplitBackend::new(
                        st, 4096, numerics,
                    )?))
                };
                let (got, got_kv) = script(&split, &tokens)?;
                let d = same_bits(&got, &want);
                let same_kv = got_kv == want_kv;
                tally.record(
                    line,
                    d.same() && same_kv,
                    format_args!(
                        "{variant:<6} split{what} {:<6}: layers 0–{} | {cut}–{}: {} of {} logits differ, exported state {} (must be bit-identical)",
                        format!("{numerics:?}"),
                        cut - 1,
                        n_layer - 1,
                        d.differ,
                        d.total,
                        if same_kv { "equal" } else { "DIFFERS" }
                    ),
                );
            }
        }
    }
    Ok(tally)
}
