//! Expert offload on the CUDA backend (`crate::placement`, ds4_cuda's `HostMapped`):
//! the same kernels read the routed experts (and the token embedding) from mapped host
//! memory instead of device memory, so every logit must be bit-identical to the
//! resident upload's — through the batched prefill (the grouped expert GEMMs), the
//! captured decode graphs and a multi-row step with a partial commit.

use std::sync::Arc;

use anyhow::Result;
use ds4_cuda::selftest::same_bits;

use super::Tally;
use crate::dev::{Backend, CudaBackend, CudaWeights, Gpu, LoadOptions, LogitRows, Model};
use crate::dev_fixture::{Manifest, VARIANTS};
use crate::placement::Placement;
use crate::Numerics;

/// Sequence b: its first half as one batched forward, a 4-row step of which 2 rows
/// are kept, then token by token.
fn script(weights: &Arc<CudaWeights>, tokens: &[u32], numerics: Numerics) -> Result<Vec<f32>> {
    let mut b = CudaBackend::new(weights, 4096, numerics)?;
    let split = tokens.len() / 2;
    let mut out = b.forward(&tokens[..split], LogitRows::All)?;
    out.extend(b.step_rows(&tokens[split..split + 4])?);
    b.commit_rows(2)?;
    b.set_batched(false);
    out.extend(b.forward(&tokens[split + 2..], LogitRows::All)?);
    Ok(out)
}

/// Each fixture model uploaded twice, resident and with every layer's experts and the
/// embedding in host memory; both numeric modes must give the same bits.
pub fn check_offload(
    gpu: &Arc<Gpu>,
    dir: &std::path::Path,
    line: &mut dyn FnMut(&str),
) -> Result<Tally> {
    let manifest = Manifest::load(dir)?;
    let tokens = manifest.tokens("b");
    let mut tally = Tally::default();
    line("\nexpert offload: every layer's experts and the embedding in mapped host memory");
    for (variant, file, _) in VARIANTS {
        let model = Model::load(dir.join(file), LoadOptions::default())?;
        let n_layer = model.config().n_layer;
        let resident = Arc::new(CudaWeights::upload(gpu, &model, &|_| {})?);
        let all = Placement {
            experts_on_host: vec![true; n_layer],
            embedding_on_host: true,
        };
        let offloaded = Arc::new(CudaWeights::upload_placed(
            gpu,
            &model,
            all,
            0..n_layer,
            true,
            &|_| {},
        )?);
        let moved = offloaded.host_bytes;
        for numerics in [Numerics::Exact, Numerics::Fast] {
            let want = script(&resident, &tokens, numerics)?;
            let got = script(&offloaded, &tokens, numerics)?;
            let d = same_bits(&got, &want);
            tally.record(
                line,
                d.same() && moved > 0,
                format_args!(
                    "{variant:<6} offload {:<6}: {} of {} logits differ ({moved} bytes on the host; must be bit-identical)",
                    format!("{numerics:?}"),
                    d.differ,
                    d.total
                ),
            );
        }
    }
    Ok(tally)
}
