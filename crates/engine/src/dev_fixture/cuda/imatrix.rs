//! Imatrix collection on the CUDA backend (`cuda/imatrix.rs`) against the CPU's
//! (`Backend::forward_observed` on both, the same tokens): `gpu-selftest`'s check.
//!
//! The two backends sum in other orders, so the per-expert mean-square vectors differ
//! by rounding (Exact) or by the quantised activations' noise (Fast); a route on a
//! near-tie may also flip, which moves a few experts' means further. The check: the
//! same entries, the same number of routes, and at least 95% of the expert vectors
//! routed on both sides within the mode's relative bound.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;

use super::super::{Manifest, VARIANTS};
use super::Tally;
use crate::dev::{Backend, CpuBackend, CudaBackend, CudaWeights, Gpu, LoadOptions, Model};
use crate::imatrix::{Imatrix, ImatrixCollector};
use crate::Numerics;

/// Relative L2 distance an expert's vector may show between the backends.
fn bound(numerics: Numerics) -> f64 {
    match numerics {
        Numerics::Exact => 1e-3,
        Numerics::Fast => 5e-2,
    }
}

fn collect(b: &mut dyn Backend, model: &Model, tokens: &[u32]) -> Result<(Imatrix, u64)> {
    let mut c = ImatrixCollector::new(model.config());
    // Two calls: the second starts mid-window, as a chunked prompt does.
    b.forward_observed(&tokens[..37], &mut c)?;
    b.forward_observed(&tokens[37..], &mut c)?;
    Ok((c.to_imatrix("check"), c.routes()))
}

/// Relative L2 distances of the expert vectors routed on both sides (an unrouted
/// expert's vector is all 1.0 exactly), and how many were routed on one side only.
fn distances(got: &Imatrix, want: &Imatrix, n_expert: usize) -> (Vec<f64>, usize) {
    let (mut d, mut one_sided) = (Vec::new(), 0);
    for (g, w) in got.entries.iter().zip(&want.entries) {
        let cols = w.values.len() / n_expert;
        for ex in 0..n_expert {
            let (a, b) = (
                &g.values[ex * cols..(ex + 1) * cols],
                &w.values[ex * cols..(ex + 1) * cols],
            );
            let unrouted = |v: &[f32]| v.iter().all(|&x| x == 1.0);
            match (unrouted(a), unrouted(b)) {
                (true, true) => {}
                (false, false) => {
                    let (mut num, mut den) = (0.0f64, 0.0f64);
                    for (x, y) in a.iter().zip(b) {
                        num += (*x as f64 - *y as f64).powi(2);
                        den += (*y as f64).powi(2);
                    }
                    d.push((num / den.max(1e-30)).sqrt());
                }
                _ => one_sided += 1,
            }
        }
    }
    (d, one_sided)
}

/// `gpu-selftest`'s imatrix checks: each fixture model, both numeric modes, on
/// sequence `b`.
pub fn check_imatrix(gpu: &Arc<Gpu>, dir: &Path, line: &mut dyn FnMut(&str)) -> Result<Tally> {
    let manifest = Manifest::load(dir)?;
    let tokens = manifest.tokens("b");
    let mut tally = Tally::default();
    line("\nImatrix collection: CUDA against the CPU (per-expert mean squares)");
    for (variant, file, _) in VARIANTS {
        let model = Model::load(dir.join(file), LoadOptions::default())?;
        let weights = Arc::new(CudaWeights::upload(gpu, &model, &|_| {})?);
        for numerics in [Numerics::Exact, Numerics::Fast] {
            let mut cpu = CpuBackend::new(&model, 4096, numerics);
            let mut cuda = CudaBackend::new(&weights, 4096, numerics)?;
            let (want, want_routes) = collect(&mut cpu, &model, &tokens)?;
            let (got, got_routes) = collect(&mut cuda, &model, &tokens)?;
            let names = |m: &Imatrix| m.entries.iter().map(|e| e.name.clone()).collect::<Vec<_>>();
            let same_shape = names(&got) == names(&want)
                && got
                    .entries
                    .iter()
                    .zip(&want.entries)
                    .all(|(a, b)| a.values.len() == b.values.len())
                && got_routes == want_routes;
            let n_expert = model.config().n_expert;
            let (mut d, one_sided) = if same_shape {
                distances(&got, &want, n_expert)
            } else {
                (Vec::new(), 0)
            };
            d.sort_by(f64::total_cmp);
            let b = bound(numerics);
            let within = d.iter().filter(|&&x| x <= b).count();
            let total = d.len() + one_sided;
            let ok = same_shape && total > 0 && within * 100 >= total * 95;
            let q = |f: f64| {
                d.get(((d.len() as f64 - 1.0) * f) as usize)
                    .copied()
                    .unwrap_or(0.0)
            };
            tally.record(
                line,
                ok,
                format_args!(
                    "{variant:<6} imatrix {:<6}: {within}/{total} expert vectors within {b:.0e} (median {:.1e}, p95 {:.1e}, max {:.1e}; {one_sided} routed on one side only){}",
                    format!("{numerics:?}"),
                    q(0.5),
                    q(0.95),
                    q(1.0),
                    if same_shape { "" } else { "; entries or route counts differ" }
                ),
            );
        }
    }
    Ok(tally)
}
