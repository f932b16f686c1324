//! `indexer_step` (fusion `idx_step`): a decode token's indexer query, scores and top-k
//! in one launch, against the three-launch chain it replaces (`indexer_q`,
//! `indexer_scores`, `topk_select`, each in its default variant and on the FMA pipes)
//! bit for bit: the scores of every live row and the selection. Rows and queries as
//! the model makes them (FP4-simulated rows, raw queries that the kernels round), on
//! both tile shapes, at top-k (nothing selected: `sel` untouched), at the most keys the
//! top-k holds in registers and past them, and a step of three tokens. Each case runs
//! the fused kernel twice: its block counters must be back at zero for the second
//! launch.

use anyhow::Result;
use ds4_gguf::quant::qat::fp4_e2m1_inplace;
use ds4_gguf::quant::random::Rng;

use super::common::{bit_identical, normal, rope_freqs, same_bits, upload_rope, Check};
use crate::{Launcher, Variant, INDEXER_STEP_MAX_ROWS};

pub(super) fn check_indexer_step(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    const HEADS: usize = 64;
    const DIM: usize = 128;
    const RATIO: usize = 4;
    const K: usize = 512;
    let max_rows = INDEXER_STEP_MAX_ROWS;
    let stride = max_rows + 16;
    let mut rng = Rng::stream(seed, 0x1f, 0);
    let mut rows = normal(&mut rng, max_rows * DIM, 1.0);
    fp4_e2m1_inplace(&mut rows, 32);
    let d_rows = gpu.upload(&rows)?;
    let (_freqs, rope) = upload_rope(gpu, &rope_freqs(64))?;
    let wscale = ((DIM as f64).powf(-0.5) * (HEADS as f64).powf(-0.5)) as f32;
    // The chain on the FMA kernels (a batch would otherwise score on tensor cores).
    let chain_gpu = gpu.with(Variant::IdxMma, false);
    let mut checks = Vec::new();
    // 525 rows (16-row tiles); 511 (≤ top-k: nothing selected); 2,050 (64-row tiles);
    // 8,192 (the most keys the top-k holds in registers); 8,194 (its memory path);
    // three tokens.
    let cases: [&[usize]; 6] = [
        &[2100],
        &[2047],
        &[8199],
        &[32767],
        &[max_rows * RATIO - 1],
        &[2100, 2047, 6001],
    ];
    for positions in cases {
        let n_tok = positions.len();
        let q = normal(&mut rng, n_tok * HEADS * DIM, 1.0);
        let wt = normal(&mut rng, n_tok * HEADS, 1.0);
        let steps: Vec<i32> = positions.iter().flat_map(|&p| [p as i32, 0]).collect();
        let (d_steps, d_wt) = (gpu.upload(&steps)?, gpu.upload(&wt)?);
        let untouched_sel = vec![-1i32; n_tok * K];
        // (scores, selections) of the chain.
        let chain = {
            let g = &chain_gpu;
            let d_q = g.upload(&q)?;
            let scores = g.upload(&vec![f32::NAN; n_tok * stride])?;
            let sel = g.upload(&untouched_sel)?;
            g.indexer_q(n_tok, g.ptr(&d_steps), g.ptr(&d_q), HEADS, DIM, rope)?;
            g.indexer_scores(
                n_tok,
                g.ptr(&d_steps),
                g.ptr(&d_rows),
                g.ptr(&d_q),
                g.ptr(&d_wt),
                HEADS,
                DIM,
                wscale,
                RATIO,
                K,
                g.ptr(&scores),
                stride,
                0,
            )?;
            g.topk_select(
                n_tok,
                g.ptr(&d_steps),
                g.ptr(&scores),
                stride,
                RATIO,
                K,
                g.ptr(&sel),
            )?;
            (g.download(&scores)?, g.download(&sel)?)
        };
        let d_q = gpu.upload(&q)?;
        let done = gpu.upload(&vec![0i32; n_tok])?;
        let mut runs = Vec::new();
        for _ in 0..2 {
            let scores = gpu.upload(&vec![f32::NAN; n_tok * stride])?;
            let sel = gpu.upload(&untouched_sel)?;
            gpu.indexer_step(
                n_tok,
                gpu.ptr(&d_steps),
                gpu.ptr(&d_rows),
                gpu.ptr(&d_q),
                gpu.ptr(&d_wt),
                rope,
                wscale,
                RATIO,
                K,
                gpu.ptr(&scores),
                (stride, max_rows),
                gpu.ptr(&sel),
                gpu.ptr(&done),
                0,
            )?;
            runs.push((gpu.download(&scores)?, gpu.download(&sel)?));
        }
        let q_kept = same_bits(&gpu.download(&d_q)?, &q).same();
        let counters_zero = gpu.download(&done)?.iter().all(|&c| c == 0);
        for (run, (scores, sel)) in runs.iter().enumerate() {
            // Live rows only: past them both leave NaN, and NaN bits may differ.
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for (t, &pos) in positions.iter().enumerate() {
                let n = (pos + 1) / RATIO;
                if n > K {
                    a.extend_from_slice(&chain.0[t * stride..t * stride + n]);
                    b.extend_from_slice(&scores[t * stride..t * stride + n]);
                }
            }
            let mut diff = same_bits(&a, &b);
            let sel_differ = chain.1.iter().zip(sel).filter(|(x, y)| x != y).count();
            diff.differ += sel_differ;
            diff.total += sel.len();
            let name = format!(
                "indexer_step = indexer_q + indexer_scores + topk_select at {positions:?}, launch {} \
                 (scores and selection; raw queries kept: {q_kept}; counters back at zero: {counters_zero})",
                run + 1
            );
            if !q_kept || !counters_zero {
                diff.differ += 1;
            }
            checks.push(bit_identical(name, diff));
        }
    }
    Ok(checks)
}
