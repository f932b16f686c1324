//! Checks and benchmarks of the batched (prefill) GEMMs of `src/matmul.rs`
//! (`matmul_q8act`, `matmul_experts_q8act`, `route_plan`, `matmul_f32`).
//!
//! Every product is compared with an f64 CPU product of the exactly dequantized weights
//! and the activations the GPU actually used (its int8 values × scales, downloaded), and
//! with the decode matvec kernels on the same inputs. Both bounds are 1e-5 relative
//! (‖Δ‖/‖ref‖): only the f32 summation order differs.

use anyhow::Result;
use ds4_gguf::quant::dequantize_to_vec;
use ds4_gguf::quant::random::Rng;
use ds4_gguf::GgmlType;
use rayon::prelude::*;

use super::common::{
    bit_identical, gather, gathered_err, random_matrix, random_vec, rel_err, same_bits, Check,
    Timing, BOUND_F32, Q8_SHAPES,
};
use crate::{Batch, DeviceBuf, DeviceMatrix, Launcher, MatSel, QuantAct, Variant};

const BOUND: f64 = BOUND_F32;

fn upload(
    gpu: &Launcher,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    mats: usize,
) -> Result<DeviceMatrix> {
    Ok(if ty == GgmlType::BF16 {
        DeviceMatrix::upload_bf16(gpu, w, rows, cols, mats)?
    } else {
        DeviceMatrix::upload(gpu, ty, w, rows, cols, mats)?
    })
}

/// Dequantized matrices of a stack, `[mats][rows·cols]`.
fn dequant_stack(ty: GgmlType, w: &[u8], rows: usize, cols: usize, mats: usize) -> Vec<Vec<f32>> {
    let per = w.len() / mats;
    (0..mats)
        .map(|i| dequantize_to_vec(ty, &w[i * per..(i + 1) * per], rows * cols).unwrap())
        .collect()
}

/// The activations the GPU uses: q·d in f64.
fn act_values(gpu: &Launcher, qa: &QuantAct) -> Result<Vec<f64>> {
    let (q, d) = (gpu.download(&qa.q)?, gpu.download(&qa.d)?);
    Ok(q.iter()
        .enumerate()
        .map(|(i, &v)| v as f64 * d[i / 32] as f64)
        .collect())
}

fn dot(w: &[f32], x: &[f64]) -> f64 {
    w.iter().zip(x).map(|(&a, &b)| a as f64 * b).sum()
}

/// f64 reference of a batch: `[t][g][r]`.
fn reference_batch(w: &[Vec<f32>], x: &[f64], b: &Batch, rows: usize, cols: usize) -> Vec<f64> {
    (0..b.n_tok)
        .into_par_iter()
        .flat_map_iter(|t| {
            (0..b.n_groups).flat_map(move |g| {
                let xs = &x[t * b.x_tok + g * b.x_grp..][..cols];
                (0..rows).map(move |r| dot(&w[g][r * cols..(r + 1) * cols], xs))
            })
        })
        .collect()
}

fn check(name: String, rel_err: f64) -> Check {
    Check {
        name,
        rel_err,
        bound: BOUND,
    }
}

/// The "`name` vs f64" check of a gathered batch output; NaN (a failure) where the
/// kernel also wrote outside its addressed slots (`canaries` false, see [`gather`]).
fn vs_f64(name: &str, got: &[f32], want: &[f64], canaries: bool) -> Check {
    check(format!("{name} vs f64"), gathered_err(got, want, canaries))
}

/// Every check of the batched GEMMs.
pub fn check_matmul(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x6e4d, 0);
    let mut out = Vec::new();
    // Dense Q8_0: every tile shape, token counts 1/7/64/512, partial tiles in rows and k.
    for &(rows, cols, n_tok, tile) in &[
        (37usize, 512usize, 1usize, None),
        (256, 4096, 7, None),
        (129, 2048, 64, Some(0usize)),
        (129, 2080, 64, Some(1)),
        (200, 1024, 512, Some(0)),
        (200, 1024, 512, Some(1)),
        (200, 1024, 512, Some(2)),
        (1024, 4096, 512, None),
    ] {
        out.extend(check_dense(
            gpu,
            &mut rng,
            GgmlType::Q8_0,
            (rows, cols, n_tok, 1),
            false,
            tile,
        )?);
    }
    // Grouped (attn_output_a layout) and padded strides.
    out.extend(check_dense(
        gpu,
        &mut rng,
        GgmlType::Q8_0,
        (64, 512, 33, 3),
        false,
        None,
    )?);
    out.extend(check_dense(
        gpu,
        &mut rng,
        GgmlType::Q8_0,
        (64, 512, 70, 2),
        true,
        Some(0),
    )?);
    // Non-Q8_0 weights through the expert kernel in dense mode.
    for ty in [GgmlType::IQ2_XXS, GgmlType::Q2_K, GgmlType::Q4_K] {
        out.extend(check_dense(
            gpu,
            &mut rng,
            ty,
            (129, 2048, 64, 1),
            false,
            None,
        )?);
        out.extend(check_dense(gpu, &mut rng, ty, (64, 512, 7, 2), true, None)?);
    }
    // Routed experts.
    for ty in [
        GgmlType::IQ2_XXS,
        GgmlType::Q2_K,
        GgmlType::Q4_K,
        GgmlType::Q8_0,
    ] {
        for &(n_tok, shared) in &[(1usize, true), (7, false), (64, true), (512, false)] {
            let shape = (16, 160, 1024, n_tok);
            out.extend(check_experts(gpu, &mut rng, ty, shape, shared, true, None)?);
        }
        // Every occupancy variant of the kernel; IQ2_XXS also on the per-k-step path.
        for v in 0..3 {
            for &(n_tok, shared, k_rule) in
                &[(64usize, true, true), (512, false, true), (64, true, false)]
            {
                if !k_rule && ty != GgmlType::IQ2_XXS {
                    continue;
                }
                let shape = (16, 160, 1024, n_tok);
                out.extend(check_experts(
                    gpu,
                    &mut rng,
                    ty,
                    shape,
                    shared,
                    k_rule,
                    Some(v),
                )?);
            }
        }
        // Q8_0-rule activations (scales vary within 256 values: the per-k-step path).
        let shape = (8, 128, 512, 64);
        out.extend(check_experts(gpu, &mut rng, ty, shape, true, false, None)?);
        // The 64-pair tile (exp_wide) against the 32-pair tile, on both plans.
        for &(n_tok, shared, k_rule) in
            &[(64usize, true, true), (512, false, true), (64, true, false)]
        {
            if !k_rule && ty != GgmlType::IQ2_XXS && ty != GgmlType::Q8_0 {
                continue;
            }
            let shape = (16, 160, 1024, n_tok);
            out.push(check_experts_wide(
                gpu, &mut rng, ty, shape, shared, k_rule,
            )?);
        }
    }
    out.push(check_plan(gpu, &mut rng)?);
    // f32 activations.
    for ty in [GgmlType::F16, GgmlType::F32, GgmlType::BF16, GgmlType::Q8_0] {
        for &(rows, cols, n_tok, groups, pad) in &[
            (37usize, 512usize, 7usize, 1usize, false),
            (256, 4096, 64, 1, false),
            (96, 1024, 130, 1, false),
            (64, 256, 33, 3, true),
        ] {
            // F16 / BF16 run on tensor cores by default; check both kernels.
            let tc_too = matches!(ty, GgmlType::F16 | GgmlType::BF16);
            for tc in [false, true].into_iter().filter(|&tc| !tc || tc_too) {
                out.extend(check_f32(
                    gpu,
                    &mut rng,
                    ty,
                    (rows, cols, n_tok, groups),
                    pad,
                    tc,
                )?);
            }
        }
    }
    for ty in [GgmlType::F16, GgmlType::Q8_0] {
        for sk in [1usize, 2, 4, 8] {
            for tc in [false, true]
                .into_iter()
                .filter(|&tc| !tc || ty == GgmlType::F16)
            {
                out.extend(check_f32_split(gpu, &mut rng, ty, sk, tc)?);
            }
        }
    }
    out.push(check_invalid(gpu)?);
    Ok(out)
}

/// The inputs of a dense check: a random stack of `groups` matrices (host bytes and
/// device copy), its batch layout and random f32 activations (host and device).
struct Dense {
    w: Vec<u8>,
    m: DeviceMatrix,
    b: Batch,
    x: Vec<f32>,
    xd: DeviceBuf<f32>,
}

impl Dense {
    fn new(
        gpu: &Launcher,
        rng: &mut Rng,
        ty: GgmlType,
        (rows, cols, n_tok, groups): (usize, usize, usize, usize),
        pad: bool,
    ) -> Result<Dense> {
        let w = random_matrix(ty, rows, cols, groups, rng);
        let m = upload(gpu, ty, &w, rows, cols, groups)?;
        let b = layout(rows, cols, n_tok, groups, pad);
        let x = random_vec(n_tok * b.x_tok, rng);
        let xd = gpu.upload(&x)?;
        Ok(Dense { w, m, b, x, xd })
    }
}

/// Layout of a dense check: groups side by side, optionally padded token strides.
fn layout(rows: usize, cols: usize, n_tok: usize, groups: usize, pad: bool) -> Batch {
    let b = Batch::grouped(n_tok, groups, cols, rows);
    Batch {
        x_tok: b.x_tok + if pad { 256 } else { 0 },
        y_tok: b.y_tok + if pad { 3 } else { 0 },
        ..b
    }
}

fn check_dense(
    gpu: &Launcher,
    rng: &mut Rng,
    ty: GgmlType,
    (rows, cols, n_tok, groups): (usize, usize, usize, usize),
    pad: bool,
    tile: Option<usize>,
) -> Result<Vec<Check>> {
    let Dense { w, m, b, xd, .. } = Dense::new(gpu, rng, ty, (rows, cols, n_tok, groups), pad)?;
    let mut qa = gpu.alloc_quant_act(n_tok, b.x_tok)?;
    if ty == GgmlType::Q8_0 {
        gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
    } else {
        gpu.quantize_act_k(gpu.ptr(&xd), &mut qa)?;
    }
    let ylen = n_tok * b.y_tok;
    let yd = gpu.upload(&vec![f32::NAN; ylen])?;
    gpu.matmul_q8act_tiled(&m, &qa, gpu.ptr(&yd), b, tile)?;
    let (got, canaries) = gather(&gpu.download(&yd)?, &b, rows);
    let xv = act_values(gpu, &qa)?;
    let want = reference_batch(
        &dequant_stack(ty, &w, rows, cols, groups),
        &xv,
        &b,
        rows,
        cols,
    );
    let tname = tile.map_or(String::new(), |t| format!(" tile{t}"));
    let name = format!(
        "matmul_q8act {ty} {groups}x{rows}x{cols} n{n_tok}{}{tname}",
        if pad { " padded" } else { "" }
    );
    let mut out = vec![vs_f64(&name, &got, &want, canaries)];
    if !pad {
        // The decode kernel on the same int8 inputs (selection i = t·G + g).
        let ids: Vec<i32> = (0..n_tok * groups).map(|i| (i % groups) as i32).collect();
        let idd = gpu.upload(&ids)?;
        let y2 = gpu.upload(&vec![f32::NAN; ylen])?;
        let sel = MatSel {
            ids: gpu.ptr(&idd),
            x_stride: cols as i64,
            y_stride: rows as i64,
        };
        gpu.matvec_q8act(&m, &qa, gpu.ptr(&y2), n_tok * groups, sel)?;
        let mv: Vec<f64> = gpu.download(&y2)?.iter().map(|&v| v as f64).collect();
        out.push(check(format!("{name} vs matvec_q8act"), rel_err(&got, &mv)));
    }
    Ok(out)
}

/// `k` distinct experts per token from the first `n_expert - 2` (two stay unused), with
/// expert 0 picked by about half the tokens (so it spans several 32-pair tiles).
fn route(rng: &mut Rng, n_tok: usize, k: usize, n_expert: usize) -> Vec<i32> {
    // k distinct ids below n_expert − 2 (the last two experts get no pairs).
    assert!(
        n_expert >= k + 2,
        "route: {k} experts a token of {n_expert}"
    );
    let mut ids = Vec::with_capacity(n_tok * k);
    for _ in 0..n_tok {
        let mut sel: Vec<i32> = Vec::with_capacity(k);
        if rng.below(2) == 0 {
            sel.push(0);
        }
        while sel.len() < k {
            let e = rng.below(n_expert as u64 - 2) as i32;
            if !sel.contains(&e) {
                sel.push(e);
            }
        }
        ids.extend(sel);
    }
    ids
}

/// A routed-expert GEMM's inputs: `n_expert` random matrices of `ty`, k = 6 experts a
/// token (`route`), and the activations quantised by the Q8_K rule (`k_rule`) or Q8_0's.
pub(super) struct ExpertInputs {
    pub(super) k: usize,
    pub(super) n_pairs: usize,
    pub(super) w: Vec<u8>,
    pub(super) m: DeviceMatrix,
    pub(super) ids: Vec<i32>,
    pub(super) idd: DeviceBuf<i32>,
    pub(super) qa: QuantAct,
    /// The f32 activations `qa` was quantised from (kept while the GPU may read them).
    pub(super) _xd: DeviceBuf<f32>,
}

pub(super) fn expert_inputs(
    gpu: &Launcher,
    rng: &mut Rng,
    ty: GgmlType,
    (n_expert, rows, cols, n_tok): (usize, usize, usize, usize),
    shared: bool,
    k_rule: bool,
) -> Result<ExpertInputs> {
    let k = 6;
    let n_pairs = n_tok * k;
    let w = random_matrix(ty, rows, cols, n_expert, rng);
    let m = upload(gpu, ty, &w, rows, cols, n_expert)?;
    let ids = route(rng, n_tok, k, n_expert);
    let idd = gpu.upload(&ids)?;
    let in_rows = if shared { n_tok } else { n_pairs };
    let xd = gpu.upload(&random_vec(in_rows * cols, rng))?;
    let mut qa = gpu.alloc_quant_act(in_rows, cols)?;
    if k_rule {
        gpu.quantize_act_k(gpu.ptr(&xd), &mut qa)?;
    } else {
        gpu.quantize_act(gpu.ptr(&xd), &mut qa)?;
    }
    Ok(ExpertInputs {
        k,
        n_pairs,
        w,
        m,
        ids,
        idd,
        qa,
        _xd: xd,
    })
}

/// The f64 outputs `[pair][row]` of a routed-expert GEMM: each pair's expert (`ids`)
/// of the dequantised stack `w` times its input row of `qa`'s values (row p / k when
/// `shared`, else p).
pub(super) fn expert_reference(
    gpu: &Launcher,
    ty: GgmlType,
    w: &[u8],
    ids: &[i32],
    qa: &QuantAct,
    (k, shared): (usize, bool),
    (n_expert, rows, cols): (usize, usize, usize),
) -> Result<Vec<f64>> {
    let xv = act_values(gpu, qa)?;
    let wd = dequant_stack(ty, w, rows, cols, n_expert);
    Ok((0..ids.len())
        .into_par_iter()
        .flat_map_iter(|p| {
            let row = if shared { p / k } else { p };
            let xs = &xv[row * cols..(row + 1) * cols];
            let we = &wd[ids[p] as usize];
            (0..rows).map(move |r| dot(&we[r * cols..(r + 1) * cols], xs))
        })
        .collect())
}

/// How an expert check's inputs were made, for its result line: one input row per token
/// (`shared`) or per pair, and Q8_0-rule activations unless `k_rule`.
fn inputs_tag(shared: bool, k_rule: bool) -> String {
    let rows = if shared { "shared" } else { "per-pair" };
    format!("{rows}{}", if k_rule { "" } else { " q8_0-act" })
}

fn check_experts(
    gpu: &Launcher,
    rng: &mut Rng,
    ty: GgmlType,
    shape: (usize, usize, usize, usize),
    shared: bool,
    k_rule: bool,
    variant: Option<usize>,
) -> Result<Vec<Check>> {
    let (n_expert, rows, cols, n_tok) = shape;
    let ExpertInputs {
        k,
        n_pairs,
        w,
        m,
        ids,
        idd,
        qa,
        _xd,
    } = expert_inputs(gpu, rng, ty, shape, shared, k_rule)?;
    let mut plan = gpu.alloc_route_plan(n_pairs + 5, n_expert)?;
    gpu.route_plan(gpu.ptr(&idd), n_pairs, n_expert, &mut plan)?;
    let run = || -> Result<Vec<f32>> {
        let yd = gpu.upload(&vec![f32::NAN; n_pairs * rows])?;
        gpu.matmul_experts_q8act(&m, &qa, &plan, k, shared, gpu.ptr(&yd), variant)?;
        Ok(gpu.download(&yd)?)
    };
    let got = run()?;
    let want = expert_reference(gpu, ty, &w, &ids, &qa, (k, shared), (n_expert, rows, cols))?;
    let name = format!(
        "matmul_experts {ty} {n_expert}x{rows}x{cols} n{n_tok} k{k} {}{}",
        inputs_tag(shared, k_rule),
        variant.map_or(String::new(), |v| format!(" v{v}"))
    );
    let mut out = vec![check(format!("{name} vs f64"), rel_err(&got, &want))];
    // The decode kernel over the same int8 rows, expanded to one row per pair.
    let (q, d) = (gpu.download(&qa.q)?, gpu.download(&qa.d)?);
    let (mut eq, mut ed) = (Vec::new(), Vec::new());
    for p in 0..n_pairs {
        let row = if shared { p / k } else { p };
        eq.extend_from_slice(&q[row * cols..(row + 1) * cols]);
        ed.extend_from_slice(&d[row * cols / 32..(row + 1) * cols / 32]);
    }
    let qe = QuantAct {
        q: gpu.upload(&eq)?,
        d: gpu.upload(&ed)?,
        rows: n_pairs,
        cols,
    };
    let y2 = gpu.upload(&vec![f32::NAN; n_pairs * rows])?;
    let sel = MatSel {
        ids: gpu.ptr(&idd),
        x_stride: cols as i64,
        y_stride: rows as i64,
    };
    gpu.matvec_q8act(&m, &qe, gpu.ptr(&y2), n_pairs, sel)?;
    let mv: Vec<f64> = gpu.download(&y2)?.iter().map(|&v| v as f64).collect();
    out.push(check(format!("{name} vs matvec_q8act"), rel_err(&got, &mv)));
    Ok(out)
}

/// The wide expert GEMM (64 pairs a block) and the 32-pair one on plans of 32- and
/// 64-pair items: every value bit-identical to the 32-pair kernel on the 32-pair plan
/// (each output sums the same k-steps in the same order; only the tiling differs).
fn check_experts_wide(
    gpu: &Launcher,
    rng: &mut Rng,
    ty: GgmlType,
    shape: (usize, usize, usize, usize),
    shared: bool,
    k_rule: bool,
) -> Result<Check> {
    let (n_expert, rows, cols, n_tok) = shape;
    let ExpertInputs {
        k,
        n_pairs,
        m,
        idd,
        qa,
        _xd,
        ..
    } = expert_inputs(gpu, rng, ty, shape, shared, k_rule)?;
    let mut plan = gpu.alloc_route_plan(n_pairs, n_expert)?;
    let mut run = |tile: usize, variant: Option<usize>| -> Result<Vec<f32>> {
        gpu.route_plan_tile(gpu.ptr(&idd), n_pairs, n_expert, &mut plan, tile)?;
        let yd = gpu.upload(&vec![f32::NAN; n_pairs * rows])?;
        gpu.matmul_experts_q8act(&m, &qa, &plan, k, shared, gpu.ptr(&yd), variant)?;
        Ok(gpu.download(&yd)?)
    };
    let want = run(32, None)?;
    let wide = Some(crate::EXP_VARIANT_WIDE);
    let diff = same_bits(&run(64, wide)?, &want)
        .merge(same_bits(&run(32, wide)?, &want))
        .merge(same_bits(&run(64, None)?, &want))
        .merge(same_bits(&run(64, Some(0))?, &want));
    Ok(bit_identical(
        format!(
            "mm_exp wide = 32-pair {ty} {n_expert}x{rows}x{cols} n{n_tok} {}, plans of 32/64",
            inputs_tag(shared, k_rule),
        ),
        diff,
    ))
}

/// The plan lists every valid pair exactly once under its expert (bad ids dropped).
fn check_plan(gpu: &Launcher, rng: &mut Rng) -> Result<Check> {
    let (n_expert, k, n_tok) = (256usize, 6usize, 512usize);
    let mut ids = route(rng, n_tok, k, n_expert);
    ids[5] = -1;
    ids[77] = n_expert as i32;
    let idd = gpu.upload(&ids)?;
    let mut plan = gpu.alloc_route_plan(ids.len(), n_expert)?;
    gpu.route_plan(gpu.ptr(&idd), ids.len(), n_expert, &mut plan)?;
    let off = gpu.download(&plan.offsets)?;
    let pairs = gpu.download(&plan.pairs)?;
    let mut bad = 0usize;
    let mut seen = vec![0u32; ids.len()];
    for e in 0..n_expert {
        let (a, b) = (off[e] as usize, off[e + 1] as usize);
        bad += usize::from(a > b);
        for &p in &pairs[a..b.max(a)] {
            bad += usize::from(ids[p as usize] != e as i32);
            seen[p as usize] += 1;
        }
    }
    for (p, &s) in seen.iter().enumerate() {
        let valid = (0..n_expert as i32).contains(&ids[p]);
        bad += usize::from(s != u32::from(valid));
    }
    Ok(Check {
        name: "route_plan 512x6 over 256 experts (exact)".into(),
        rel_err: bad as f64,
        bound: 0.0,
    })
}

/// The f64 reference of a batch of f32 inputs `x` through the `groups` matrices `w`.
fn f32_reference(
    ty: GgmlType,
    w: &[u8],
    x: &[f32],
    b: &Batch,
    (rows, cols, groups): (usize, usize, usize),
) -> Vec<f64> {
    let xv: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    reference_batch(
        &dequant_stack(ty, w, rows, cols, groups),
        &xv,
        b,
        rows,
        cols,
    )
}

fn check_f32(
    gpu: &Launcher,
    rng: &mut Rng,
    ty: GgmlType,
    (rows, cols, n_tok, groups): (usize, usize, usize, usize),
    pad: bool,
    tensor_cores: bool,
) -> Result<Vec<Check>> {
    let Dense { w, m, b, x, xd } = Dense::new(gpu, rng, ty, (rows, cols, n_tok, groups), pad)?;
    let ylen = n_tok * b.y_tok;
    let yd = gpu.upload(&vec![f32::NAN; ylen])?;
    gpu.matmul_f32_opts(&m, gpu.ptr(&xd), gpu.ptr(&yd), b, None, Some(tensor_cores))?;
    let (got, canaries) = gather(&gpu.download(&yd)?, &b, rows);
    let want = f32_reference(ty, &w, &x, &b, (rows, cols, groups));
    let name = format!(
        "matmul_{} {ty} {groups}x{rows}x{cols} n{n_tok}{}",
        if tensor_cores { "tc" } else { "f32" },
        if pad { " padded" } else { "" }
    );
    let mut out = vec![vs_f64(&name, &got, &want, canaries)];
    if !pad && ty != GgmlType::BF16 {
        let y2 = gpu.upload(&vec![f32::NAN; ylen])?;
        let sel = MatSel {
            ids: 0,
            x_stride: cols as i64,
            y_stride: rows as i64,
        };
        gpu.matvec(&m, gpu.ptr(&xd), gpu.ptr(&y2), n_tok, sel)?;
        let mv: Vec<f64> = gpu.download(&y2)?.iter().map(|&v| v as f64).collect();
        out.push(check(format!("{name} vs matvec"), rel_err(&got, &mv)));
    }
    Ok(out)
}

/// matmul_f32 with a forced split-K factor (cluster reduction) on a 2-group padded batch;
/// on tensor cores also the conflict-free tile layout (`mm_pitch`) against the plain one
/// bit for bit.
fn check_f32_split(
    gpu: &Launcher,
    rng: &mut Rng,
    ty: GgmlType,
    sk: usize,
    tensor_cores: bool,
) -> Result<Vec<Check>> {
    let (rows, cols, n_tok, groups) = (100, 2048, 70, 2);
    let Dense { w, m, b, x, xd } = Dense::new(gpu, rng, ty, (rows, cols, n_tok, groups), true)?;
    let run = |spread: bool| -> Result<Vec<f32>> {
        let yd = gpu.upload(&vec![f32::NAN; n_tok * b.y_tok])?;
        gpu.with(Variant::MmPitch, spread).matmul_f32_opts(
            &m,
            gpu.ptr(&xd),
            gpu.ptr(&yd),
            b,
            Some(sk),
            Some(tensor_cores),
        )?;
        Ok(gpu.download(&yd)?)
    };
    let plain = run(false)?;
    let (got, canaries) = gather(&plain, &b, rows);
    let want = f32_reference(ty, &w, &x, &b, (rows, cols, groups));
    let name = format!(
        "matmul_{} {ty} {groups}x{rows}x{cols} n{n_tok} padded split-K {sk}",
        if tensor_cores { "tc" } else { "f32" }
    );
    let mut out = vec![vs_f64(&name, &got, &want, canaries)];
    if tensor_cores {
        out.push(bit_identical(
            format!("mm_tc_*_p = mm_tc_* {ty} {groups}x{rows}x{cols} n{n_tok} split-K {sk}"),
            same_bits(&run(true)?, &plain),
        ));
    }
    Ok(out)
}

/// Bad sizes are errors, never launches.
fn check_invalid(gpu: &Launcher) -> Result<Check> {
    let mut rng = Rng::stream(1, 2, 3);
    let w = random_matrix(GgmlType::Q8_0, 64, 512, 2, &mut rng);
    let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, 64, 512, 2)?;
    let qa = gpu.alloc_quant_act(4, 512)?;
    let y = gpu.zeros::<f32>(1 << 12)?;
    let yp = gpu.ptr(&y);
    let mut accepted = 0usize;
    let b = Batch::plain(5, 512, 64); // 5 tokens of 4 rows
    accepted += usize::from(gpu.matmul_q8act(&m, &qa, yp, b).is_ok());
    let b = Batch {
        n_groups: 3,
        x_grp: 0,
        ..Batch::plain(1, 512, 64)
    };
    accepted += usize::from(gpu.matmul_q8act(&m, &qa, yp, b).is_ok());
    let b = Batch {
        x_tok: 500,
        ..Batch::plain(2, 512, 64)
    };
    accepted += usize::from(gpu.matmul_q8act(&m, &qa, yp, b).is_ok());
    let plan = gpu.alloc_route_plan(8, 4)?;
    accepted += usize::from(gpu.alloc_route_plan(8, 2000).is_ok());
    let mut plan2 = gpu.alloc_route_plan(8, 4)?;
    accepted += usize::from(gpu.route_plan(0, 9, 4, &mut plan2).is_ok());
    // A plan over 4 experts for a stack of 2.
    let ids = gpu.upload(&[0i32, 1, 2, 3])?;
    let mut plan3 = plan;
    gpu.route_plan(gpu.ptr(&ids), 4, 4, &mut plan3)?;
    accepted += usize::from(
        gpu.matmul_experts_q8act(&m, &qa, &plan3, 1, false, yp, None)
            .is_ok(),
    );
    gpu.synchronize()?;
    Ok(Check {
        name: "matmul launchers reject bad sizes (accepted)".into(),
        rel_err: accepted as f64,
        bound: 0.0,
    })
}

fn timing(name: String, bytes: usize, ops: f64, ms: f64, unit: &str) -> Timing {
    Timing {
        name: format!("{name} {:.1} {unit}", ops / ms / 1e9),
        bytes: bytes as f64,
        ms,
    }
}

/// Prefill GEMMs at DeepSeek V4 Flash shapes, 512 tokens: µs, TOPS (2·rows·cols per
/// token or pair), GB/s of weight bytes (each weight read once per call).
pub fn bench_matmul(gpu: &Launcher, seed: u64) -> Result<Vec<Timing>> {
    let mut rng = Rng::stream(seed, 0xbe4d, 0);
    let mut out = Vec::new();
    let n_tok = 512;
    let (warm, reps) = (3, 20);
    for &(name, rows, cols, groups) in Q8_SHAPES {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, groups, &mut rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, groups)?;
        let b = layout(rows, cols, n_tok, groups, false);
        let x = gpu.upload(&random_vec(n_tok * b.x_tok, &mut rng))?;
        let mut qa = gpu.alloc_quant_act(n_tok, b.x_tok)?;
        gpu.quantize_act(gpu.ptr(&x), &mut qa)?;
        let y = gpu.zeros::<f32>(n_tok * b.y_tok)?;
        let yp = gpu.ptr(&y);
        let ms = gpu.time_ms(warm, reps, |_| gpu.matmul_q8act(&m, &qa, yp, b))?;
        let ops = 2.0 * (rows * cols * groups * n_tok) as f64;
        out.push(timing(
            format!("mm Q8_0 {name} n{n_tok}"),
            m.bytes(),
            ops,
            ms,
            "TOPS",
        ));
        for (t, tname) in ["128x128", "128x64", "64x64"].iter().enumerate() {
            let ms = gpu.time_ms(warm, reps, |_| {
                gpu.matmul_q8act_tiled(&m, &qa, yp, b, Some(t))
            })?;
            out.push(timing(
                format!("  tile {tname}"),
                m.bytes(),
                ops,
                ms,
                "TOPS",
            ));
        }
        if name.starts_with("attn_q_b") {
            // Today's batched path: one decode matvec per token.
            let sel = MatSel {
                ids: 0,
                x_stride: cols as i64,
                y_stride: rows as i64,
            };
            let ms = gpu.time_ms(1, 3, |_| gpu.matvec_q8act(&m, &qa, yp, n_tok, sel))?;
            out.push(timing(
                format!("  (matvec_q8act x{n_tok}: {name})"),
                m.bytes(),
                ops,
                ms,
                "TOPS",
            ));
        }
    }
    let f16: &[(&str, usize, usize)] = &[
        ("compressor kv 4096->1024", 1024, 4096),
        ("compressor 4096->256", 256, 4096),
        ("indexer q_b 1024->8192", 8192, 1024),
        ("indexer proj 4096->64", 64, 4096),
        ("ffn_gate_inp 4096->256", 256, 4096),
    ];
    for &(name, rows, cols) in f16 {
        let w = random_matrix(GgmlType::F16, rows, cols, 1, &mut rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::F16, &w, rows, cols, 1)?;
        let b = Batch::plain(n_tok, cols, rows);
        let x = gpu.upload(&random_vec(n_tok * cols, &mut rng))?;
        let y = gpu.zeros::<f32>(n_tok * rows)?;
        let (xp, yp) = (gpu.ptr(&x), gpu.ptr(&y));
        let ops = 2.0 * (rows * cols * n_tok) as f64;
        for tc in [false, true] {
            let ms = gpu.time_ms(warm, reps, |_| {
                gpu.matmul_f32_opts(&m, xp, yp, b, None, Some(tc))
            })?;
            out.push(timing(
                format!("mm_{} F16 {name} n{n_tok}", if tc { "tc" } else { "f32" }),
                m.bytes(),
                ops,
                ms,
                "TFLOPS",
            ));
        }
        for sk in [1usize, 2, 4, 8] {
            let ms = gpu.time_ms(warm, reps, |_| {
                gpu.matmul_f32_opts(&m, xp, yp, b, Some(sk), None)
            })?;
            out.push(timing(
                format!("  split-K {sk}"),
                m.bytes(),
                ops,
                ms,
                "TFLOPS",
            ));
        }
    }
    // Routed experts: 256 experts, 6 distinct per token, uniform.
    let (n_expert, k) = (256usize, 6usize);
    let n_pairs = n_tok * k;
    let mut ids = Vec::with_capacity(n_pairs);
    for _ in 0..n_tok {
        let mut sel: Vec<i32> = Vec::new();
        while sel.len() < k {
            let e = rng.below(n_expert as u64) as i32;
            if !sel.contains(&e) {
                sel.push(e);
            }
        }
        ids.extend(sel);
    }
    let used = {
        let mut u = ids.clone();
        u.sort_unstable();
        u.dedup();
        u.len()
    };
    let idd = gpu.upload(&ids)?;
    let mut plan = gpu.alloc_route_plan(n_pairs, n_expert)?;
    let ip = gpu.ptr(&idd);
    let ms = gpu.time_ms(warm, reps, |_| {
        gpu.route_plan(ip, n_pairs, n_expert, &mut plan)
    })?;
    out.push(Timing {
        name: format!("route_plan {n_tok}x{k} over {n_expert}"),
        bytes: 0.0,
        ms,
    });
    let exps: &[(&str, GgmlType, usize, usize, bool)] = &[
        (
            "gate IQ2_XXS 4096->2048",
            GgmlType::IQ2_XXS,
            2048,
            4096,
            true,
        ),
        ("down Q2_K 2048->4096", GgmlType::Q2_K, 4096, 2048, false),
        ("gate Q4_K 4096->2048", GgmlType::Q4_K, 2048, 4096, true),
        ("down Q4_K 2048->4096", GgmlType::Q4_K, 4096, 2048, false),
    ];
    for &(name, ty, rows, cols, shared) in exps {
        let w = random_matrix(ty, rows, cols, n_expert, &mut rng);
        let m = DeviceMatrix::upload(gpu, ty, &w, rows, cols, n_expert)?;
        drop(w);
        let in_rows = if shared { n_tok } else { n_pairs };
        let x = gpu.upload(&random_vec(in_rows * cols, &mut rng))?;
        let mut qa = gpu.alloc_quant_act(in_rows, cols)?;
        gpu.quantize_act_k(gpu.ptr(&x), &mut qa)?;
        let y = gpu.zeros::<f32>(n_pairs * rows)?;
        let yp = gpu.ptr(&y);
        let ms = gpu.time_ms(warm, reps, |_| {
            gpu.matmul_experts_q8act(&m, &qa, &plan, k, shared, yp, None)
        })?;
        let ops = 2.0 * (rows * cols * n_pairs) as f64;
        let bytes = m.bytes_per_matrix() * used;
        out.push(timing(
            format!("mm experts {name} {n_tok}x{k}"),
            bytes,
            ops,
            ms,
            "TOPS",
        ));
        for v in 0..3 {
            let ms = gpu.time_ms(warm, reps, |_| {
                gpu.matmul_experts_q8act(&m, &qa, &plan, k, shared, yp, Some(v))
            })?;
            let label = format!("  variant min {} blocks/SM", v + 2);
            out.push(timing(label, bytes, ops, ms, "TOPS"));
        }
        if ty == GgmlType::IQ2_XXS {
            // Today's batched path: the decode kernel with one selection per pair.
            let qe = if shared {
                let mut e = gpu.alloc_quant_act(n_pairs, cols)?;
                let xe = gpu.upload(&random_vec(n_pairs * cols, &mut rng))?;
                gpu.quantize_act_k(gpu.ptr(&xe), &mut e)?;
                e
            } else {
                qa
            };
            let sel = MatSel {
                ids: ip,
                x_stride: cols as i64,
                y_stride: rows as i64,
            };
            let ms = gpu.time_ms(1, 3, |_| gpu.matvec_q8act(&m, &qe, yp, n_pairs, sel))?;
            out.push(timing(
                format!("  (matvec_q8act x{n_pairs}: {name})"),
                bytes,
                ops,
                ms,
                "TOPS",
            ));
        }
    }
    Ok(out)
}
