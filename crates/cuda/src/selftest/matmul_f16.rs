//! Checks of the fp16 prefill products: Q8_0 (`matmul_q8act_f16`, variant `q8_f16`) and
//! F16 (`matmul_f16_split`, variant `f16_split`).
//!
//! Q8_0: the CPU twin rounds exactly as the kernels do — each weight q·d to fp16, each
//! activation q·(d/s_t) to fp16 with s_t the power of two at or below the token's
//! largest block scale — and sums the products in f64, so only the tensor cores' f32
//! summation differs (bound 1e-5). The int8 GEMM on the same inputs differs by the two
//! fp16 roundings of every term (bound: the fp16 tensor-core bound).
//!
//! F16: the weights are exact in fp16 and the activation is split into fp16 hi + lo
//! (22 bits), so the product is compared with the f64 product of the exact weights and
//! f32 activations, and with the tf32-split kernels, both within `BOUND_F16_SPLIT` (the
//! tensor cores' f32 accumulation, not the operands, sets it).

use anyhow::Result;
use ds4_gguf::quant::random::Rng;
use ds4_gguf::GgmlType;
use half::f16;
use rayon::prelude::*;

use super::common::{
    gather, gathered_err, random_matrix, random_vec, rel_err, Check, BOUND_F16_SPLIT, BOUND_F32,
    BOUND_FP16_MMA,
};
use crate::{Batch, DeviceMatrix, F16Slot, Launcher, QuantAct, Variant};

/// The power of two s with s ≤ m < 2s (m > 0 and normal), else 1: `pow2_floor` of the
/// kernel.
fn pow2_floor(m: f32) -> f32 {
    let e = m.to_bits() & 0x7f80_0000;
    if e == 0 || e == 0x7f80_0000 {
        1.0
    } else {
        f32::from_bits(e)
    }
}

/// The fp16 weights of a Q8_0 stack (34-byte blocks: f16 scale, 32 int8), as f64.
fn weights16(w: &[u8]) -> Vec<f64> {
    w.chunks_exact(34)
        .flat_map(|b| {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            b[2..]
                .iter()
                .map(move |&q| f16::from_f32(q as i8 as f32 * d).to_f64())
        })
        .collect()
}

/// The fp16 activations of `qa` (q·(d/s_t)) and the token scales s_t.
fn acts16(gpu: &Launcher, qa: &QuantAct, n_tok: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let (q, d) = (gpu.download(&qa.q)?, gpu.download(&qa.d)?);
    let nb = qa.cols / 32;
    let mut x = Vec::with_capacity(n_tok * qa.cols);
    let mut s = Vec::with_capacity(n_tok);
    for t in 0..n_tok {
        let dt = &d[t * nb..(t + 1) * nb];
        let st = pow2_floor(dt.iter().fold(0.0f32, |m, v| m.max(v.abs())));
        for (i, &v) in q[t * qa.cols..(t + 1) * qa.cols].iter().enumerate() {
            let dd = dt[i / 32] * (1.0 / st);
            x.push(f16::from_f32(v as f32 * dd).to_f64());
        }
        s.push(st as f64);
    }
    Ok((x, s))
}

/// Every check, through the mma.sync GEMM and (sm_90a) the wgmma one.
pub(super) fn check_f16_gemm(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let work = gpu.alloc_f16_work(&[(8 << 20, 4 << 20, 2048)])?;
    let slot = &work.slots()[0];
    let mut out = Vec::new();
    for wgmma in [false, true] {
        let mut rng = Rng::stream(seed, 0x7f16, 0);
        let g = gpu.with(Variant::F16Wgmma, wgmma);
        let mut checks = check_products(&g, &mut rng, slot)?;
        checks.extend(check_split(&g, &mut rng, slot)?);
        if wgmma {
            for c in &mut checks {
                c.name = format!("{} wg", c.name);
            }
        }
        out.extend(checks);
    }
    Ok(out)
}

/// The Q8_0 products and a refused shape.
fn check_products(gpu: &Launcher, rng: &mut Rng, slot: &F16Slot) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    // (rows, cols, tokens, groups, output pad, activation scale)
    for &(rows, cols, n_tok, groups, pad, scale) in &[
        (256usize, 4096usize, 300usize, 1usize, 0usize, 1.0f32),
        (1024, 1024, 7, 1, 3, 1.0),
        (128, 512, 1000, 8, 0, 1.0),
        // Activations far past fp16's range: the token scale keeps them in it.
        (384, 2048, 129, 1, 5, 3.0e6),
        // Enough 256-row tiles to fill 132 SMs: the wide wgmma tile.
        (4096, 512, 1100, 1, 0, 1.0),
    ] {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, groups, rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, groups)?;
        let g = Batch::grouped(n_tok, groups, cols, rows);
        let b = Batch {
            y_tok: g.y_tok + pad,
            ..g
        };
        let mut x: Vec<f32> = random_vec(n_tok * b.x_tok, rng)
            .into_iter()
            .map(|v| v * scale)
            .collect();
        // One all-zero token (scale 1).
        x[b.x_tok * (n_tok / 2)..b.x_tok * (n_tok / 2 + 1)].fill(0.0);
        let xd = gpu.upload(&x)?;
        let mut qa = gpu.alloc_quant_act(n_tok, b.x_tok)?;
        gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
        let ylen = n_tok * b.y_tok;
        let yd = gpu.upload(&vec![f32::NAN; ylen])?;
        gpu.matmul_q8act_f16(&m, &qa, gpu.ptr(&yd), b, slot)?;
        let (got, canaries) = gather(&gpu.download(&yd)?, &b, rows);
        let w16 = weights16(&w);
        let (x16, s) = acts16(gpu, &qa, n_tok)?;
        let want: Vec<f64> = (0..n_tok)
            .into_par_iter()
            .flat_map_iter(|t| {
                let (w16, x16, s) = (&w16, &x16, &s);
                (0..groups).flat_map(move |gi| {
                    let xs = &x16[t * b.x_tok + gi * b.x_grp..][..cols];
                    (0..rows).map(move |r| {
                        let wr = &w16[(gi * rows + r) * cols..][..cols];
                        s[t] * wr.iter().zip(xs).map(|(a, b)| a * b).sum::<f64>()
                    })
                })
            })
            .collect();
        let name = format!("matmul_q8act_f16 {groups}x{rows}x{cols} n{n_tok}");
        let e = gathered_err(&got, &want, canaries);
        out.push(Check {
            name: format!("{name} vs fp16 f64"),
            rel_err: e,
            bound: BOUND_F32,
        });
        // The int8 GEMM on the same activations.
        let y8 = gpu.upload(&vec![f32::NAN; ylen])?;
        gpu.matmul_q8act(&m, &qa, gpu.ptr(&y8), b)?;
        let (int8, _) = gather(&gpu.download(&y8)?, &b, rows);
        let int8: Vec<f64> = int8.iter().map(|&v| v as f64).collect();
        out.push(Check {
            name: format!("{name} vs int8"),
            rel_err: rel_err(&got, &int8),
            bound: BOUND_FP16_MMA,
        });
    }
    // What the shapes the kernel cannot take give: an error, nothing launched.
    let w = random_matrix(GgmlType::Q8_0, 100, 512, 1, rng);
    let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, 100, 512, 1)?;
    let qa = gpu.alloc_quant_act(4, 512)?;
    let yd = gpu.upload(&vec![0.0f32; 400])?;
    let refused = gpu
        .matmul_q8act_f16(&m, &qa, gpu.ptr(&yd), Batch::plain(4, 512, 100), slot)
        .is_err();
    out.push(Check {
        name: "matmul_q8act_f16 refuses 100 rows".into(),
        rel_err: if refused { 0.0 } else { f64::NAN },
        bound: BOUND_F32,
    });
    Ok(out)
}

/// The F16 products: exact weights × f32 activations in f64, and the tf32-split kernel.
fn check_split(gpu: &Launcher, rng: &mut Rng, slot: &F16Slot) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    // (rows, cols, tokens, input pad, output pad, activation scale)
    for &(rows, cols, n_tok, xpad, ypad, scale) in &[
        (256usize, 4096usize, 300usize, 0usize, 0usize, 1.0f32),
        (1024, 1024, 7, 64, 3, 1.0),
        (128, 64, 1000, 0, 0, 1.0),
        // Far past fp16's range, and far below its normal range.
        (384, 2048, 129, 4, 5, 3.0e9),
        (128, 512, 65, 0, 0, 1.0e-30),
        (4096, 512, 1100, 0, 1, 1.0),
    ] {
        let wf: Vec<f32> = random_vec(rows * cols, rng);
        let w16: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let bytes: Vec<u8> = w16.iter().flat_map(|h| h.to_le_bytes()).collect();
        let m = DeviceMatrix::upload(gpu, GgmlType::F16, &bytes, rows, cols, 1)?;
        let b = Batch {
            x_tok: cols + xpad,
            y_tok: rows + ypad,
            ..Batch::plain(n_tok, cols, rows)
        };
        let mut x: Vec<f32> = random_vec(n_tok * b.x_tok, rng)
            .into_iter()
            .map(|v| v * scale)
            .collect();
        // One all-zero token; one with a single value far above the rest.
        x[b.x_tok * (n_tok / 2)..b.x_tok * (n_tok / 2) + cols].fill(0.0);
        x[b.x_tok * (n_tok - 1) + cols / 3] *= 1.0e4;
        let xd = gpu.upload(&x)?;
        let ylen = n_tok * b.y_tok;
        let yd = gpu.upload(&vec![f32::NAN; ylen])?;
        gpu.matmul_f16_split(&m, gpu.ptr(&xd), gpu.ptr(&yd), b, slot)?;
        let (got, canaries) = gather(&gpu.download(&yd)?, &b, rows);
        let want: Vec<f64> = (0..n_tok)
            .into_par_iter()
            .flat_map_iter(|t| {
                let (w16, x) = (&w16, &x);
                (0..rows).map(move |r| {
                    let xs = &x[t * b.x_tok..][..cols];
                    let wr = &w16[r * cols..][..cols];
                    wr.iter()
                        .zip(xs)
                        .map(|(a, &v)| a.to_f64() * v as f64)
                        .sum::<f64>()
                })
            })
            .collect();
        let name = format!("matmul_f16_split {rows}x{cols} n{n_tok} x{scale:e}");
        let e = gathered_err(&got, &want, canaries);
        out.push(Check {
            name: format!("{name} vs f64"),
            rel_err: e,
            bound: BOUND_F16_SPLIT,
        });
        let y2 = gpu.upload(&vec![f32::NAN; ylen])?;
        gpu.matmul_f32_opts(&m, gpu.ptr(&xd), gpu.ptr(&y2), b, None, Some(true))?;
        let (tf32, _) = gather(&gpu.download(&y2)?, &b, rows);
        let tf32: Vec<f64> = tf32.iter().map(|&v| v as f64).collect();
        out.push(Check {
            name: format!("{name} vs tf32 split"),
            rel_err: rel_err(&got, &tf32),
            bound: BOUND_F16_SPLIT,
        });
    }
    Ok(out)
}
