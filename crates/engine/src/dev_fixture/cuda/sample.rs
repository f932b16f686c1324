//! The device's sampled picks (`ds4-cuda` `kernels/sample.cu`) against the host's
//! sampler (`sampling/fixed.rs`): the kernel on rows built to stress it (the full
//! vocabulary peaked and flat, ties, NaN, ±inf, a list past the kernel's shared-memory
//! copy) under every filter, where it must pick the host's token for the same draw;
//! and `Session::sample_run` on the fixture models against the plain sampled loop.

use std::sync::Arc;

use anyhow::Result;
use ds4_cuda::DecodePlan;

use super::{spread_tokens, Case, Tally};
use crate::cuda::device_sample_settings;
use crate::dev::Gpu;
use crate::sampling::{fixed, PickParams, Rng};
use crate::{argmax, SamplerConfig};

/// Rows of `n` logits: (name, values).
fn rows(rng: &mut Rng, n: usize) -> Vec<(String, Vec<f32>)> {
    let mut gauss = |s: f64| {
        let (a, b) = (rng.next_f64().max(1e-300), rng.next_f64());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos() * s) as f32
    };
    let peaked: Vec<f32> = (0..n).map(|_| gauss(3.0)).collect();
    let flat: Vec<f32> = (0..n).map(|_| gauss(0.3)).collect();
    let ties: Vec<f32> = peaked.iter().map(|v| (v * 2.0).floor()).collect();
    let mut odd = peaked.clone();
    odd[n / 3] = f32::NAN;
    odd[n / 2] = f32::NEG_INFINITY;
    if n > 8 {
        odd[7] = -0.0;
        odd[8] = 0.0;
    }
    let mut inf = peaked.clone();
    inf[n - 1] = f32::INFINITY;
    vec![
        (format!("{n} peaked"), peaked),
        (format!("{n} flat"), flat),
        (format!("{n} coarse ties"), ties),
        (format!("{n} NaN -inf ±0"), odd),
        (format!("{n} +inf"), inf),
        (format!("{n} all NaN"), vec![f32::NAN; n]),
        (format!("{n} all -inf"), vec![f32::NEG_INFINITY; n]),
    ]
}

/// The sampled pick kernel against [`fixed::pick`] (the argmax when nothing is kept):
/// rows × settings × draws, each the same token and the step buffer advanced to it.
pub fn check_sampling(gpu: &Arc<Gpu>, line: &mut dyn FnMut(&str)) -> Result<Tally> {
    let g = gpu.launcher(DecodePlan::default());
    let mut tally = Tally::default();
    let mut rng = Rng::new(0x5a3b1e);
    let configs = [
        (1.0, 0, 1.0, 0.05),
        (0.7, 40, 0.95, 0.05),
        (1.0, 0, 0.9, 0.0),
        (1.5, 0, 1.0, 0.0),
        (100.0, 0, 1.0, 0.0),
        (0.3, 5, 1.0, 0.0),
        (1.0, 3000, 0.5, 0.0),
        (1.0, 0, 1.0, 1.5),
        (1e-3, 0, 0.01, 0.9),
    ];
    let ring = gpu.sample_ring(129_280)?;
    let mut pos = 100usize;
    line("\nsampled picks on the device against the host's sampler (fixed.rs):");
    for n in [129_280usize, 3_000, 5] {
        for (name, row) in rows(&mut rng, n) {
            let d = gpu.upload(&row)?;
            let (mut checks, mut bad) = (0, Vec::new());
            let mut spent = std::time::Duration::ZERO;
            for &(t, top_k, top_p, min_p) in &configs {
                let cfg = SamplerConfig {
                    temperature: t,
                    top_k,
                    top_p,
                    min_p,
                    seed: 0,
                };
                let p = PickParams::new(&cfg);
                ring.set(&device_sample_settings(&p));
                for u in [0.0, 0.5, 0.999_999_999, rng.next_f64(), rng.next_f64()] {
                    pos += 1;
                    let step = gpu.upload(&[pos as i32, 7])?;
                    ring.set_draw(pos, u);
                    let t0 = std::time::Instant::now();
                    g.sample_pick(g.ptr(&step), g.ptr(&d), n, &ring)?;
                    gpu.synchronize()?;
                    spent += t0.elapsed();
                    let (token, nan) = ring.read(pos);
                    let stepped: Vec<i32> = gpu.download(&step)?;
                    let want = fixed::pick(&p, &row, u).unwrap_or_else(|| argmax(&row));
                    let want_nan = row.iter().any(|v| v.is_nan());
                    checks += 1;
                    if token != want || nan != want_nan || stepped != [pos as i32 + 1, want as i32]
                    {
                        bad.push(format!(
                            "T {t} k {top_k} p {top_p} min-p {min_p} u {u}: {token} against {want}"
                        ));
                    }
                }
            }
            tally.record(
                line,
                bad.is_empty(),
                format_args!(
                    "sample_pick {name:<22} {checks} picks = the host's ({:.0} µs a pick with its launch and wait){}",
                    spent.as_secs_f64() * 1e6 / checks as f64,
                    bad.first().map_or(String::new(), |b| format!(
                        "; {} differ, first: {b}",
                        bad.len()
                    ))
                ),
            );
        }
    }
    Ok(tally)
}

/// [`Session::sample_run`] (the device's sampled picks, one token ahead) against the
/// plain sampled loop on host logits, from a 40-token prompt over 48 picks, with a
/// flat sampler and one with every filter.
pub(super) fn sampled_on_device(
    case: &Case,
    tally: &mut Tally,
    line: &mut dyn FnMut(&str),
) -> Result<()> {
    let prompt = spread_tokens(40, case.vocab(), 7, 3);
    for cfg in super::super::run_samplers() {
        let r = super::super::sample_run_identity(&mut || case.prompted(&prompt), 48, &cfg);
        tally.record(
            line,
            r.is_ok(),
            format_args!(
                "{:<6} sample {:<6} device picks = the plain loop's over 48 tokens (T {}, top-k {}, top-p {}, min-p {}; budget, refused){}",
                case.variant,
                format!("{:?}", case.numerics),
                cfg.temperature,
                cfg.top_k,
                cfg.top_p,
                cfg.min_p,
                r.err().map_or(String::new(), |e| format!(": {e}"))
            ),
        );
    }
    Ok(())
}
