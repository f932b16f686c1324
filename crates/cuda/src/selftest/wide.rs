//! The `layer_wide.cu` kernels (variant `wide`: one block a token) against the kernels
//! they replace, through the same launchers with the variant off and on, at the Flash
//! shapes and for few tokens (a token's work split over blocks) and many (one block a
//! token): the attention output's inverse RoPE + Q8_0 (`rope_tail_q8`: the rotation's
//! FMA contraction differs, so within BOUND_F32 and a few flipped Q8_0 roundings),
//! the query norm + RoPE (`head_norm_rope_t`: the norm sums in decode's order, so within
//! the f32 bound), and the experts' swiglu + Q8_K (`swiglu_q8k_w`, bit-identical, with
//! ties of |v| and an all-zero block) the wide Q8_0 (`quantize_q8_32x4`) and HC post
//! (`hc_post_x4`), bit-identical.

use anyhow::Result;
use ds4_gguf::quant::random::Rng;

use super::common::{
    both, dequant_q8, normal, rel_err, rope_freqs, same_both, upload_rope, Check, BOUND_F32,
};
use crate::{AttnInput, AttnTail, Launcher, Variant};

/// Dequantised Q8_0 outputs of inputs within BOUND_F32: a value on a rounding boundary
/// may land one step (1/127 of its block's largest) the other way.
const BOUND_Q8_FLIPS: f64 = 1e-3;

const HEADS: usize = 64;
const HD: usize = 512;

pub(super) fn check_wide(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x71de, 0);
    let mut checks = Vec::new();
    let freqs: Vec<f32> = rope_freqs(64)
        .into_iter()
        .map(|f| f * (0.5 + rng.uniform()))
        .collect();
    let (_freqs, rope) = upload_rope(gpu, &freqs)?;
    for n in [3usize, 300] {
        let steps: Vec<i32> = (0..n).flat_map(|t| [(17 + 37 * t) as i32, 0]).collect();
        let step = gpu.upload(&steps)?;
        let x = normal(&mut rng, n * HEADS * HD, 1.0);

        // The rotation's FMA contraction differs between the kernels (layer_wide.cu), so
        // the values within BOUND_F32 and their Q8_0 forms (dequantised) within a few
        // flipped roundings.
        let (plain, wide) = both(gpu, Variant::Wide, |gpu| {
            let out = gpu.upload(&x)?;
            let q = gpu.zeros::<i8>(x.len())?;
            let d = gpu.upload(&vec![f32::NAN; x.len() / 32])?;
            let a = tail_input(n, gpu.ptr(&step));
            let t = AttnTail {
                rope,
                q: gpu.ptr(&q),
                d: gpu.ptr(&d),
            };
            gpu.attention_tail(&a, &t, gpu.ptr(&out))?;
            let deq = dequant_q8(&gpu.download(&q)?, &gpu.download(&d)?);
            Ok((gpu.download(&out)?, deq))
        })?;
        checks.push(Check {
            name: format!("rope_tail_q8 ~ rope_tail {HEADS}x{HD}, {n} tokens (values)"),
            rel_err: rel_err(&wide.0, &f64s(&plain.0)),
            bound: BOUND_F32,
        });
        checks.push(Check {
            name: format!("rope_tail_q8 ~ quantize_q8_32 {HEADS}x{HD}, {n} tokens (Q8_0)"),
            rel_err: rel_err(&wide.1, &f64s(&plain.1)),
            bound: BOUND_Q8_FLIPS,
        });

        let (plain, wide) = both(gpu, Variant::Wide, |gpu| {
            let xb = gpu.upload(&x)?;
            gpu.head_norm_rope(n, gpu.ptr(&step), gpu.ptr(&xb), HD, HEADS, 1e-6, rope)?;
            Ok(gpu.download(&xb)?)
        })?;
        checks.push(Check {
            name: format!("head_norm_rope_t ~ head_norm_rope {HEADS}x{HD}, {n} tokens"),
            rel_err: rel_err(&wide, &f64s(&plain)),
            bound: BOUND_F32,
        });
    }

    // hc_post of 70 tokens (4 streams of 4,096; WIDE_MIN_TOKENS is 64), without parts
    // (attention) and with 7.
    let (n_tok, n_hc, n_embd) = (70usize, 4usize, 4096usize);
    let h = gpu.upload(&normal(&mut rng, n_tok * n_hc * n_embd, 1.0))?;
    let out = gpu.upload(&normal(&mut rng, n_tok * n_embd, 1.0))?;
    let parts = gpu.upload(&normal(&mut rng, n_tok * 7 * n_embd, 1.0))?;
    let hcp = gpu.upload(&normal(&mut rng, n_tok * (n_hc + n_hc * n_hc), 0.5))?;
    for (parts_p, n_parts) in [(0u64, 0usize), (gpu.ptr(&parts), 7)] {
        let name = format!("hc_post_x4 = hc_post_pl {n_tok} tokens, {n_parts} parts");
        checks.push(same_both(gpu, Variant::Wide, name, |gpu| {
            let h_out = gpu.upload(&vec![f32::NAN; n_tok * n_hc * n_embd])?;
            let (hp, op, cp) = (gpu.ptr(&h), gpu.ptr(&out), gpu.ptr(&hcp));
            gpu.hc_post(
                n_tok,
                hp,
                op,
                parts_p,
                n_parts,
                cp,
                n_hc,
                n_embd,
                gpu.ptr(&h_out),
            )?;
            Ok(gpu.download(&h_out)?)
        })?);
    }

    // Q8_0 of 300 rows of 8,192 (the output projection's second input).
    let (rows, cols) = (300usize, 8192usize);
    let x = normal(&mut rng, rows * cols, 1.0);
    let name = format!("quantize_q8_32x4 = quantize_q8_32 {rows}x{cols}");
    checks.push(same_both(gpu, Variant::Wide, name, |gpu| {
        let xb = gpu.upload(&x)?;
        let mut qa = gpu.alloc_quant_act(rows, cols)?;
        gpu.quantize_act(gpu.ptr(&xb), &mut qa)?;
        let mut all: Vec<f32> = gpu.download(&qa.q)?.iter().map(|&v| v as f32).collect();
        all.extend(gpu.download(&qa.d)?);
        Ok(all)
    })?);

    // swiglu + Q8_K over 130 expert rows of 2,048 (1,040 blocks of 256: the launcher
    // takes the warp kernel from WIDE_SWIGLU_BLOCKS): values on a coarse grid, so |v|
    // ties (also between v and −v) inside the 256-blocks, and one all-zero block.
    let (n, n_sel) = (2048usize, 130usize);
    let level = |r: &mut Rng| (r.below(9) as f32 - 4.0) * 0.5;
    let mut gate: Vec<f32> = (0..n * n_sel).map(|_| level(&mut rng)).collect();
    let up: Vec<f32> = (0..n * n_sel).map(|_| level(&mut rng)).collect();
    gate[3 * 256..4 * 256].fill(0.0);
    let weights: Vec<f32> = (0..n_sel).map(|_| 0.25 + rng.uniform()).collect();
    let (g, u, w) = (gpu.upload(&gate)?, gpu.upload(&up)?, gpu.upload(&weights)?);
    let name = format!("swiglu_q8k_w = swiglu_q8k {n_sel}x{n} (mid, Q8_K), ties");
    checks.push(same_both(gpu, Variant::Wide, name, |gpu| {
        let mid = gpu.upload(&vec![f32::NAN; n * n_sel])?;
        let mut qa = gpu.alloc_quant_act(n_sel, n)?;
        let (gp, up, wp) = (gpu.ptr(&g), gpu.ptr(&u), gpu.ptr(&w));
        gpu.swiglu_quant(gp, up, wp, n, n_sel, 10.0, gpu.ptr(&mid), &mut qa, true)?;
        let mut all = gpu.download(&mid)?;
        all.extend(gpu.download(&qa.q)?.iter().map(|&v| v as f32));
        all.extend(gpu.download(&qa.d)?);
        Ok(all)
    })?);
    Ok(checks)
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// The attention input `attention_tail` reads: tokens, their steps and the head shape.
fn tail_input(n_tok: usize, step: u64) -> AttnInput {
    AttnInput {
        n_tok,
        step,
        q: 0,
        ring: 0,
        raw_cap: 0,
        window: 0,
        comp: 0,
        ratio: 0,
        sel: 0,
        top_k: 0,
        sinks: 0,
        heads: HEADS,
        hd: HD,
        scale: 1.0,
        q_norm: None,
        kvt: 0,
        window_at: 0,
    }
}
