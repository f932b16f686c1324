//! Checks of the fp16 routed-expert GEMM (`matmul_experts_f16`, variant `exp_f16`).
//!
//! Against the f64 product of the dequantised weights and the int8 activations' values,
//! and against the int8 expert GEMM on the same plan and inputs. Both differ from the
//! fp16 path by its roundings — each weight rounded once to fp16 after its scales
//! (IQ2_XXS ±g·d·(2ls+1)/8, Q2_K q·d·sc − dmin·m, both formed in f32), each activation
//! to fp16 — hence the fp16 tensor-core bound (measured ~3e-4). Every output
//! starts as NaN, so a pair or row the kernel skips fails the check. Plans of 64- and
//! 32-pair items, gate/up (one input row per token) and down (a row per pair) inputs.

use anyhow::Result;
use ds4_gguf::quant::random::Rng;
use ds4_gguf::GgmlType;

use super::common::{bit_identical, random_matrix, rel_err, same_bits, Check, BOUND_FP16_MMA};
use super::matmul::{expert_inputs, expert_reference, ExpertInputs};
use crate::{DeviceMatrix, Launcher, Variant, EXP_VARIANT_WIDE};

/// Every check; none where the GPU cannot run the sm_90a kernels.
pub(super) fn check_exp_f16(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    if !gpu.has_wgmma() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for qs in [false, true] {
        let mut checks = check_products(&gpu.with(Variant::ExpF16Qs, qs), seed)?;
        if qs {
            for c in &mut checks {
                c.name = format!("{} qs", c.name);
            }
        }
        out.extend(checks);
    }
    Ok(out)
}

/// Every check through one form of the kernels.
fn check_products(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0xe16, 0);
    let work = gpu.alloc_f16_work(&[(8, 4 << 20, 8192)])?;
    let slot = &work.slots()[0];
    let mut out = Vec::new();
    // (experts, rows, cols, tokens, one input row per token)
    for &(n_expert, rows, cols, n_tok, shared) in &[
        (8usize, 256usize, 512usize, 100usize, true),
        (8, 384, 1024, 130, false),
        (16, 128, 2048, 40, true),
        // Over 64 pairs an expert on average: several items an expert.
        (8, 128, 256, 200, false),
    ] {
        for ty in [GgmlType::IQ2_XXS, GgmlType::Q2_K] {
            let shape = (n_expert, rows, cols, n_tok);
            let ExpertInputs {
                k,
                n_pairs,
                w,
                m,
                ids,
                idd,
                qa,
                _xd,
            } = expert_inputs(gpu, &mut rng, ty, shape, shared, true)?;
            let dims = (n_expert, rows, cols);
            let want = expert_reference(gpu, ty, &w, &ids, &qa, (k, shared), dims)?;
            let mut plan = gpu.alloc_route_plan(n_pairs, n_expert)?;
            for tile in [64, 32] {
                gpu.route_plan_tile(gpu.ptr(&idd), n_pairs, n_expert, &mut plan, tile)?;
                let yd = gpu.upload(&vec![f32::NAN; n_pairs * rows])?;
                gpu.matmul_experts_f16(&m, &qa, &plan, k, shared, gpu.ptr(&yd), slot)?;
                let got = gpu.download(&yd)?;
                let name = format!(
                    "matmul_experts_f16 {ty} {n_expert}x{rows}x{cols} n{n_tok} {} tile {tile}",
                    if shared { "shared" } else { "per-pair" }
                );
                out.push(Check {
                    name: format!("{name} vs f64"),
                    rel_err: rel_err(&got, &want),
                    bound: BOUND_FP16_MMA,
                });
                let y8 = gpu.upload(&vec![f32::NAN; n_pairs * rows])?;
                let v = if tile == 64 { EXP_VARIANT_WIDE } else { 0 };
                gpu.matmul_experts_q8act(&m, &qa, &plan, k, shared, gpu.ptr(&y8), Some(v))?;
                let int8: Vec<f64> = gpu.download(&y8)?.iter().map(|&v| v as f64).collect();
                out.push(Check {
                    name: format!("{name} vs int8"),
                    rel_err: rel_err(&got, &int8),
                    bound: BOUND_FP16_MMA,
                });
            }
        }
    }
    out.push(check_gate_up(gpu, &mut rng, &work)?);
    // A stack the kernels do not take: an error, nothing launched.
    // (k = 6 distinct experts a token: at least 6 experts.)
    let shape = (8, 128, 256, 8);
    let e = expert_inputs(gpu, &mut rng, GgmlType::Q8_0, shape, true, true)?;
    let mut plan = gpu.alloc_route_plan(e.n_pairs, 8)?;
    gpu.route_plan_tile(gpu.ptr(&e.idd), e.n_pairs, 8, &mut plan, 64)?;
    let yd = gpu.upload(&vec![0.0f32; e.n_pairs * 128])?;
    let refused = gpu
        .matmul_experts_f16(&e.m, &e.qa, &plan, e.k, true, gpu.ptr(&yd), slot)
        .is_err();
    out.push(Check {
        name: "matmul_experts_f16 refuses Q8_0".into(),
        rel_err: if refused { 0.0 } else { f64::NAN },
        bound: BOUND_FP16_MMA,
    });
    Ok(out)
}

/// `matmul_experts_gate_up` through a launcher with fp16 buffers (the engine's call):
/// bit-identical to the two products run one at a time through the same slot.
fn check_gate_up(gpu: &Launcher, rng: &mut Rng, work: &crate::F16Work) -> Result<Check> {
    let slot = &work.slots()[0];
    let (ty, n_expert, rows, cols, n_tok) = (GgmlType::IQ2_XXS, 8, 256, 512, 150);
    let e = expert_inputs(gpu, rng, ty, (n_expert, rows, cols, n_tok), true, true)?;
    let w_up = random_matrix(ty, rows, cols, n_expert, rng);
    let up = DeviceMatrix::upload(gpu, ty, &w_up, rows, cols, n_expert)?;
    let mut plan = gpu.alloc_route_plan(e.n_pairs, n_expert)?;
    gpu.route_plan_tile(gpu.ptr(&e.idd), e.n_pairs, n_expert, &mut plan, 64)?;
    let len = e.n_pairs * rows;
    let (yg, yu) = (
        gpu.upload(&vec![f32::NAN; len])?,
        gpu.upload(&vec![f32::NAN; len])?,
    );
    // The variant on whatever DS4_CUDA_FUSE says: with it off the engine's call takes
    // the int8 GEMMs, which this check is not about.
    let on = gpu.with(Variant::ExpF16, true);
    let g = on.with_f16(Some(work));
    g.matmul_experts_gate_up((&e.m, g.ptr(&yg)), (&up, g.ptr(&yu)), &e.qa, &plan, e.k)?;
    let (pg, pu) = (gpu.download(&yg)?, gpu.download(&yu)?);
    let (sg, su) = (
        gpu.upload(&vec![f32::NAN; len])?,
        gpu.upload(&vec![f32::NAN; len])?,
    );
    gpu.matmul_experts_f16(&e.m, &e.qa, &plan, e.k, true, gpu.ptr(&sg), slot)?;
    gpu.matmul_experts_f16(&up, &e.qa, &plan, e.k, true, gpu.ptr(&su), slot)?;
    let diff = same_bits(&pg, &gpu.download(&sg)?).merge(same_bits(&pu, &gpu.download(&su)?));
    Ok(bit_identical(
        format!("matmul_experts_gate_up {ty} {n_expert}x{rows}x{cols} = two fp16 products"),
        diff,
    ))
}
