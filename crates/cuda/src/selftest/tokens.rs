//! The multi-token products of a multi-row step (`tokens`): n ≤ 16 tokens of a plain
//! Q8_0 matrix (int8 activations), of a grouped Q8_0 stack, or of an F16 matrix in one
//! pass over the weights must give each token the bits its own one-token launch gives —
//! that is what makes a step's rows equal decode's products.

use anyhow::Result;
use ds4_gguf::quant::random::Rng;
use ds4_gguf::GgmlType;

use super::common::{
    bit_identical, random_matrix, random_vec, rel_err, same_bits, BitDiff, Check, BOUND_F32,
};
use crate::{Batch, DeviceBuf, DeviceMatrix, Launcher, MatSel, Variant};

/// Token counts: the smallest, the 3- and 5-token kernels' (`tokens3`, `tokens5`), 6 and
/// 7 on the 8-token ones, the most.
const COUNTS: [usize; 6] = [2, 3, 5, 6, 7, 16];

pub(super) fn check_tokens(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x70c, 0);
    let mut checks = Vec::new();
    // The tensor-core Q8_0 form first (against the dp4a kernels), then the dp4a
    // kernels' bit identity with the one-token launch.
    checks.extend(check_tokens_mma(gpu, &mut rng)?);
    checks.extend(check_f16_mma(gpu, &mut rng)?);
    let gpu = &gpu
        .with(Variant::TokensMma, false)
        .with(Variant::F16Mma, false);
    // Rows a warp: 4 (≤ 1,024 columns), 2 (longer rows), and split K (few rows: 2 or 4
    // warps a row), each with a ragged row count.
    // Q8_0 rows a warp: 4 (≤ 1,024 columns), 2 (longer rows), and split K (few rows: 2
    // or 4 warps a row), each with a ragged row count; the products take int8
    // activations quantised from the same rows.
    // And a matrix past Q8_TOKENS_R4_ROWS (the output head's 4 rows a warp at 2
    // tokens, against the one-token launch's 2).
    let q8_shapes = [
        (4100, 1024),
        (4104, 2048),
        (1030, 4096),
        (2050, 512),
        (crate::tokens::Q8_TOKENS_R4_ROWS + 6, 1056),
    ];
    checks.extend(tokens_against_one(
        gpu,
        &mut rng,
        GgmlType::Q8_0,
        &q8_shapes,
        "matvec_q8_0_q8_t*",
        &|m, x, n, y, sel| {
            let mut qa = gpu.alloc_quant_act(n, m.cols)?;
            gpu.quantize_act(gpu.ptr(x), &mut qa)?;
            gpu.matvec_q8act(m, &qa, y, n, sel)
        },
    )?);
    checks.push(check_groups(gpu, &mut rng)?);
    checks.extend(check_pair(gpu, &mut rng)?);
    checks.push(check_quantize_rep(gpu, &mut rng)?);
    let f16_shapes = [(256, 4096), (37, 512), (1024, 4096)];
    checks.extend(tokens_against_one(
        gpu,
        &mut rng,
        GgmlType::F16,
        &f16_shapes,
        "matvec_f16_t*",
        &|m, x, n, y, sel| gpu.matvec(m, gpu.ptr(x), y, n, sel),
    )?);
    Ok(checks)
}

/// One launch's product of `n` rows of `x` into `y` (`n` = 1: the plain one-token form).
type Product<'a> =
    dyn Fn(&DeviceMatrix, &DeviceBuf<f32>, usize, u64, MatSel) -> Result<(), crate::CudaError> + 'a;

/// For each (rows, cols) of `shapes`: a random matrix of type `ty`, and for every token
/// count of COUNTS one `product` over all the tokens against one `product` per token,
/// bit for bit (`kernel` names the multi-token kernels in the result line).
fn tokens_against_one(
    gpu: &Launcher,
    rng: &mut Rng,
    ty: GgmlType,
    shapes: &[(usize, usize)],
    kernel: &str,
    product: &Product,
) -> Result<Vec<Check>> {
    let mut checks = Vec::new();
    for &(rows, cols) in shapes {
        let w = random_matrix(ty, rows, cols, 1, rng);
        let m = DeviceMatrix::upload(gpu, ty, &w, rows, cols, 1)?;
        let mut same = BitDiff::default();
        for n in COUNTS {
            let x = random_vec(n * cols, rng);
            let mut want = Vec::with_capacity(n * rows);
            for t in 0..n {
                let xt = gpu.upload(&x[t * cols..(t + 1) * cols])?;
                let y = gpu.upload(&vec![f32::NAN; rows])?;
                product(&m, &xt, 1, gpu.ptr(&y), MatSel::default())?;
                want.extend(gpu.download(&y)?);
            }
            let xa = gpu.upload(&x)?;
            let y = gpu.upload(&vec![f32::NAN; n * rows])?;
            let sel = MatSel {
                ids: 0,
                x_stride: cols as i64,
                y_stride: rows as i64,
            };
            product(&m, &xa, n, gpu.ptr(&y), sel)?;
            same = same.merge(same_bits(&gpu.download(&y)?, &want));
        }
        checks.push(bit_identical(
            format!("{kernel} ({COUNTS:?} tokens) = one token each, {rows}x{cols}"),
            same,
        ));
    }
    Ok(checks)
}

/// The grouped output projection (8 groups of 1,024 × 4,096): `matvec_q8act_groups`
/// over n tokens against each token's one-token launch over its 8 selections.
fn check_groups(gpu: &Launcher, rng: &mut Rng) -> Result<Check> {
    let (groups, rows, cols) = (8usize, 1024usize, 4096usize);
    let w = random_matrix(GgmlType::Q8_0, rows, cols, groups, rng);
    let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, groups)?;
    let ids = gpu.upload(&(0..groups as i32).collect::<Vec<_>>())?;
    let (x_tok, y_tok) = (groups * cols, groups * rows);
    let mut same = BitDiff::default();
    for n in COUNTS {
        let x = random_vec(n * x_tok, rng);
        let mut want = Vec::with_capacity(n * y_tok);
        for t in 0..n {
            let xt = gpu.upload(&x[t * x_tok..(t + 1) * x_tok])?;
            let mut qa = gpu.alloc_quant_act(groups, cols)?;
            gpu.quantize_act(gpu.ptr(&xt), &mut qa)?;
            let y = gpu.upload(&vec![f32::NAN; y_tok])?;
            let sel = MatSel {
                ids: gpu.ptr(&ids),
                x_stride: cols as i64,
                y_stride: rows as i64,
            };
            gpu.matvec_q8act(&m, &qa, gpu.ptr(&y), groups, sel)?;
            want.extend(gpu.download(&y)?);
        }
        let xa = gpu.upload(&x)?;
        let mut qa = gpu.alloc_quant_act(n * groups, cols)?;
        gpu.quantize_act(gpu.ptr(&xa), &mut qa)?;
        let y = gpu.upload(&vec![f32::NAN; n * y_tok])?;
        let b = Batch::grouped(n, groups, cols, rows);
        gpu.matvec_q8act_groups(&m, &qa, gpu.ptr(&y), b)?;
        same = same.merge(same_bits(&gpu.download(&y)?, &want));
    }
    Ok(bit_identical(
        format!(
            "matvec_q8act_groups ({COUNTS:?} tokens) = one token each, {groups}x({rows}x{cols})"
        ),
        same,
    ))
}

/// `tokens_pair`: the shared expert's gate and up over n tokens in one launch of two
/// groups (two matrices wherever they were allocated) against each token's decode pair
/// launch (`matvec_q8act_pair` of one token), bit for bit: at the shared expert's
/// shape (2 rows a warp) and a short ragged one (two warps a row).
fn check_pair(gpu: &Launcher, rng: &mut Rng) -> Result<Vec<Check>> {
    let gpu = &gpu.with(Variant::TokensPair, true);
    let mut checks = Vec::new();
    for (rows, cols) in [(2048usize, 4096usize), (1030, 1024)] {
        let up_first = rows == 1030; // the second matrix below the first in memory, maybe
        let (wa, wb) = (
            random_matrix(GgmlType::Q8_0, rows, cols, 1, rng),
            random_matrix(GgmlType::Q8_0, rows, cols, 1, rng),
        );
        let b = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &wb, rows, cols, 1)?;
        let a = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &wa, rows, cols, 1)?;
        let (gate, up) = if up_first { (&b, &a) } else { (&a, &b) };
        // The gate and up of `n` inputs in `x` through one pair call.
        let pair = |x: &[f32], n: usize| -> Result<(Vec<f32>, Vec<f32>)> {
            let xa = gpu.upload(x)?;
            let mut qa = gpu.alloc_quant_act(n, cols)?;
            gpu.quantize_act(gpu.ptr(&xa), &mut qa)?;
            let yg = gpu.upload(&vec![f32::NAN; n * rows])?;
            let yu = gpu.upload(&vec![f32::NAN; n * rows])?;
            let sel = MatSel {
                ids: 0,
                x_stride: cols as i64,
                y_stride: rows as i64,
            };
            gpu.matvec_q8act_pair((gate, gpu.ptr(&yg)), (up, gpu.ptr(&yu)), &qa, n, sel)?;
            Ok((gpu.download(&yg)?, gpu.download(&yu)?))
        };
        let mut same = BitDiff::default();
        for n in [2usize, 3, 5] {
            let x = random_vec(n * cols, rng);
            let (mut want_g, mut want_u) = (Vec::new(), Vec::new());
            for xt in x.chunks_exact(cols) {
                let (g, u) = pair(xt, 1)?;
                want_g.extend(g);
                want_u.extend(u);
            }
            let (got_g, got_u) = pair(&x, n)?;
            same = same
                .merge(same_bits(&got_g, &want_g))
                .merge(same_bits(&got_u, &want_u));
        }
        checks.push(bit_identical(
            format!("tokens_pair ([2, 3, 5] tokens) = a decode pair each, 2x({rows}x{cols})"),
            same,
        ));
    }
    Ok(checks)
}

/// `tokens_mma` (kernels/mma_tokens.cu) against the dp4a multi-token kernels on the same
/// int8 activations: the integer block sums are exact in both, so only the f32
/// accumulation order differs (BOUND_F32). Plain matrices of the shapes that pick 1, 2,
/// 4 and 8 warps a tile (ragged row counts too) and the grouped output projection, at
/// 8 (one 8-token tile), 9, 13 and 16 tokens (it serves 8 and more).
fn check_tokens_mma(gpu: &Launcher, rng: &mut Rng) -> Result<Vec<Check>> {
    let mut checks = Vec::new();
    let shapes = [
        (32768, 1024, 1),
        (4100, 2048, 1),
        (2050, 4096, 1),
        (530, 4096, 1),
        (1024, 4096, 8),
    ];
    for (rows, cols, groups) in shapes {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, groups, rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, groups)?;
        let (x_tok, y_tok) = (groups * cols, groups * rows);
        // (Batch::grouped's strides: the check must reach the tensor-core kernel.)
        anyhow::ensure!(
            crate::tokens::tokens_mma_fits(cols, x_tok, cols),
            "{rows}x{cols}: not a tensor-core token product"
        );
        let mut worst = 0.0f64;
        for n in [8usize, 9, 13, 16] {
            let x = random_vec(n * x_tok, rng);
            let xa = gpu.upload(&x)?;
            let mut qa = gpu.alloc_quant_act(n * groups, cols)?;
            gpu.quantize_act(gpu.ptr(&xa), &mut qa)?;
            let b = Batch::grouped(n, groups, cols, rows);
            let run = |l: &Launcher| -> Result<Vec<f32>> {
                let y = l.upload(&vec![f32::NAN; n * y_tok])?;
                if groups > 1 {
                    l.matvec_q8act_groups(&m, &qa, l.ptr(&y), b)?;
                } else {
                    let sel = MatSel {
                        ids: 0,
                        x_stride: cols as i64,
                        y_stride: rows as i64,
                    };
                    l.matvec_q8act(&m, &qa, l.ptr(&y), n, sel)?;
                }
                Ok(l.download(&y)?)
            };
            let want = run(&gpu.with(Variant::TokensMma, false))?;
            let got = run(&gpu.with(Variant::TokensMma, true))?;
            let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            worst = worst.max(rel_err(&got, &want));
        }
        checks.push(Check {
            name: format!("matvec_q8_0_q8_mma* = t* kernels, {groups}x({rows}x{cols})"),
            rel_err: worst,
            bound: BOUND_F32,
        });
    }
    Ok(checks)
}

/// `quantize_rows_rep` (a step's expert input: each token's row quantised once and
/// written to its k pair rows) against the Q8_K quantisation of the k copies of every
/// row, bit for bit, values and scales; one 256-block of zeros included.
fn check_quantize_rep(gpu: &Launcher, rng: &mut Rng) -> Result<Check> {
    let (n, k, cols) = (3usize, 6usize, 4096usize);
    let mut x = random_vec(n * cols, rng);
    x[cols + 512..cols + 768].fill(0.0);
    let copies: Vec<f32> = x
        .chunks_exact(cols)
        .flat_map(|row| (0..k).flat_map(move |_| row.iter().copied()))
        .collect();
    let (xd, cd) = (gpu.upload(&x)?, gpu.upload(&copies)?);
    let mut want = gpu.alloc_quant_act(n * k, cols)?;
    gpu.quantize_rows(gpu.ptr(&cd), &mut want, n * k, crate::ActRule::Q8K)?;
    let mut got = gpu.alloc_quant_act(n * k, cols)?;
    gpu.quantize_rows_rep(gpu.ptr(&xd), &mut got, n, k)?;
    let as_f32 = |q: &[i8]| q.iter().map(|&v| v as f32).collect::<Vec<_>>();
    let diff = same_bits(
        &as_f32(&gpu.download(&got.q)?),
        &as_f32(&gpu.download(&want.q)?),
    )
    .merge(same_bits(&gpu.download(&got.d)?, &gpu.download(&want.d)?));
    Ok(bit_identical(
        format!("quantize_q8_k32_rep {n}x{cols} x {k} = quantize_q8_k32 of the copies"),
        diff,
    ))
}

/// The F16 tensor-core products (`f16_mma`, 8..=16 tokens) against an f64 product of
/// the same weights and activations and against the FMA kernels (`matvec_f16_t*`), at
/// the step's F16 shapes (router, compressor, indexer) with ragged row counts.
fn check_f16_mma(gpu: &Launcher, rng: &mut Rng) -> Result<Vec<Check>> {
    let mut checks = Vec::new();
    for (rows, cols) in [
        (256usize, 4096usize),
        (1030, 4096),
        (64, 4096),
        (8200, 1024),
    ] {
        let w = random_matrix(GgmlType::F16, rows, cols, 1, rng);
        let wf: Vec<f64> = w
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect();
        let m = DeviceMatrix::upload(gpu, GgmlType::F16, &w, rows, cols, 1)?;
        anyhow::ensure!(
            crate::tokens::f16_mma_fits(cols),
            "{rows}x{cols}: not a tensor-core F16 token product"
        );
        let (mut vs_f64, mut vs_fma) = (0.0f64, 0.0f64);
        for n in [8usize, 9, 13, 16] {
            let x = random_vec(n * cols, rng);
            let xa = gpu.upload(&x)?;
            let sel = MatSel {
                ids: 0,
                x_stride: cols as i64,
                y_stride: rows as i64,
            };
            let run = |l: &Launcher| -> Result<Vec<f32>> {
                let y = l.upload(&vec![f32::NAN; n * rows])?;
                l.matvec(&m, l.ptr(&xa), l.ptr(&y), n, sel)?;
                Ok(l.download(&y)?)
            };
            let got = run(&gpu.with(Variant::F16Mma, true))?;
            let fma: Vec<f64> = run(&gpu.with(Variant::F16Mma, false))?
                .iter()
                .map(|&v| v as f64)
                .collect();
            let want: Vec<f64> = (0..n * rows)
                .map(|i| {
                    let (t, r) = (i / rows, i % rows);
                    let (wr, xt) = (&wf[r * cols..][..cols], &x[t * cols..][..cols]);
                    wr.iter().zip(xt).map(|(&a, &b)| a * b as f64).sum()
                })
                .collect();
            vs_f64 = vs_f64.max(rel_err(&got, &want));
            vs_fma = vs_fma.max(rel_err(&got, &fma));
        }
        let name = format!("matvec_f16_mma* {rows}x{cols}, 8..16 tokens");
        checks.push(Check {
            name: format!("{name} vs f64"),
            rel_err: vs_f64,
            bound: BOUND_F32,
        });
        checks.push(Check {
            name: format!("{name} vs t* kernels"),
            rel_err: vs_fma,
            bound: BOUND_F32,
        });
    }
    Ok(checks)
}
