//! The multi-token products of a multi-row step (`tokens`): n ≤ 16 tokens of a plain
//! Q8_0 matrix (int8 activations), of a grouped Q8_0 stack, or of an F16 matrix in one
//! pass over the weights must give each token the bits its own one-token launch gives —
//! that is what makes a step's rows equal decode's products.

use anyhow::Result;
use ds4_gguf::quant::random::Rng;
use ds4_gguf::GgmlType;

use super::common::{bit_identical, random_matrix, random_vec, same_bits, BitDiff, Check};
use crate::{Batch, DeviceMatrix, Launcher, MatSel};

/// Token counts: the smallest, a ragged one, one past a power of two, the most.
const COUNTS: [usize; 4] = [2, 3, 5, 16];

pub(super) fn check_tokens(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x70c, 0);
    let mut checks = Vec::new();
    // Rows a warp: 4 (≤ 1,024 columns), 2 (longer rows), and split K (few rows: 2 or 4
    // warps a row), each with a ragged row count.
    for (rows, cols) in [
        (4100usize, 1024usize),
        (4104, 2048),
        (1030, 4096),
        (2050, 512),
    ] {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, 1, &mut rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, 1)?;
        let mut same = BitDiff::default();
        for n in COUNTS {
            let x = random_vec(n * cols, &mut rng);
            let mut want = Vec::with_capacity(n * rows);
            for t in 0..n {
                let xt = gpu.upload(&x[t * cols..(t + 1) * cols])?;
                let mut qa = gpu.alloc_quant_act(1, cols)?;
                gpu.quantize_act(gpu.ptr(&xt), &mut qa)?;
                let y = gpu.upload(&vec![f32::NAN; rows])?;
                gpu.matvec_q8act(&m, &qa, gpu.ptr(&y), 1, MatSel::default())?;
                want.extend(gpu.download(&y)?);
            }
            let xa = gpu.upload(&x)?;
            let mut qa = gpu.alloc_quant_act(n, cols)?;
            gpu.quantize_act(gpu.ptr(&xa), &mut qa)?;
            let y = gpu.upload(&vec![f32::NAN; n * rows])?;
            let sel = MatSel {
                ids: 0,
                x_stride: cols as i64,
                y_stride: rows as i64,
            };
            gpu.matvec_q8act(&m, &qa, gpu.ptr(&y), n, sel)?;
            same = same.merge(same_bits(&gpu.download(&y)?, &want));
        }
        checks.push(bit_identical(
            format!("matvec_q8_0_q8_t* ({COUNTS:?} tokens) = one token each, {rows}x{cols}"),
            same,
        ));
    }
    checks.push(check_groups(gpu, &mut rng)?);
    for (rows, cols) in [(256usize, 4096usize), (37, 512), (1024, 4096)] {
        let w = random_matrix(GgmlType::F16, rows, cols, 1, &mut rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::F16, &w, rows, cols, 1)?;
        let mut same = BitDiff::default();
        for n in COUNTS {
            let x = random_vec(n * cols, &mut rng);
            let mut want = Vec::with_capacity(n * rows);
            for t in 0..n {
                let xt = gpu.upload(&x[t * cols..(t + 1) * cols])?;
                let y = gpu.upload(&vec![f32::NAN; rows])?;
                gpu.matvec(&m, gpu.ptr(&xt), gpu.ptr(&y), 1, MatSel::default())?;
                want.extend(gpu.download(&y)?);
            }
            let xa = gpu.upload(&x)?;
            let y = gpu.upload(&vec![f32::NAN; n * rows])?;
            let sel = MatSel {
                ids: 0,
                x_stride: cols as i64,
                y_stride: rows as i64,
            };
            gpu.matvec(&m, gpu.ptr(&xa), gpu.ptr(&y), n, sel)?;
            same = same.merge(same_bits(&gpu.download(&y)?, &want));
        }
        checks.push(bit_identical(
            format!("matvec_f16_t* ({COUNTS:?} tokens) = one token each, {rows}x{cols}"),
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
        let b = Batch {
            n_tok: n,
            x_tok,
            y_tok,
            n_groups: groups,
            x_grp: cols,
            y_grp: rows,
        };
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
