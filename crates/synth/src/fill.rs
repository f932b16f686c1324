//! Random tensor contents: quantised blocks with scales set for a target RMS, norm and
//! bias vectors near their usual values, and the hash-routing table.

use ds4_engine::dev::config::Config;
use ds4_engine::dev::layout::{Role, TensorSpec};
use ds4_gguf::quant::f32_to_f16;
use ds4_gguf::GgmlType;

use crate::rng::Rng;
pub use ds4_gguf::quant::random::fill_blocks;

/// Target RMS of a tensor's values. Projections get gain/√fan-in; output-side
/// projections are small so the residual (HC) streams stay bounded over 43 layers.
fn target_rms(spec: &TensorSpec) -> f32 {
    let short = spec
        .name
        .rsplit_once('.')
        .map(|(a, _)| a.rsplit('.').next().unwrap_or(a))
        .unwrap_or(&spec.name);
    let base = spec.name.split('.').nth(2).unwrap_or(short);
    let fan_in = spec.dims[0] as f32;
    let gain = match base {
        "attn_output_b" => 0.1,
        "ffn_down_shexp" => 0.05,
        "ffn_down_exps" => 0.07,
        "ffn_gate_inp" => 2.0,
        "attn_compressor_ape" | "indexer_compressor_ape" => return 0.5,
        _ if spec.name == "token_embd.weight" => return 1.0,
        _ if spec.name == "output.weight" => 2.5,
        _ => 1.0,
    };
    gain / fan_in.sqrt()
}

/// Fills `buf` (bytes `start..start+buf.len()` of the tensor) with random data.
pub(crate) fn fill_tensor_chunk(
    spec: &TensorSpec,
    cfg: &Config,
    start: usize,
    buf: &mut [u8],
    rng: &mut Rng,
) {
    match spec.role {
        Role::TokenTable => fill_tid2eid(cfg, start, buf, rng),
        Role::Vector => fill_vector(spec, buf, rng),
        _ => fill_blocks(spec.published, target_rms(spec), buf, rng),
    }
}

fn fill_vector(spec: &TensorSpec, buf: &mut [u8], rng: &mut Rng) {
    let name = spec.name.as_str();
    let gen = |rng: &mut Rng| -> f32 {
        if name.contains("norm") {
            1.0 + 0.1 * rng.normal()
        } else if name.contains("attn_sinks") {
            0.5 + rng.normal()
        } else if name.contains("exp_probs_b") {
            0.2 * rng.normal()
        } else if name.contains("_scale") {
            0.5 + 0.25 * rng.uniform()
        } else {
            0.5 * rng.normal()
        }
    };
    match spec.published {
        GgmlType::F32 => {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&gen(rng).to_le_bytes());
            }
        }
        _ => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(&f32_to_f16(gen(rng)).to_le_bytes());
            }
        }
    }
}

/// Hash routing table: each token gets `n_expert_used` distinct experts.
fn fill_tid2eid(cfg: &Config, start: usize, buf: &mut [u8], rng: &mut Rng) {
    let k = cfg.n_expert_used;
    debug_assert_eq!(start % (4 * k), 0, "chunks hold whole rows");
    let mut chosen = Vec::with_capacity(k);
    for row in buf.chunks_exact_mut(4 * k) {
        chosen.clear();
        while chosen.len() < k {
            let e = rng.below(cfg.n_expert as u64) as i32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        for (c, e) in row.chunks_exact_mut(4).zip(&chosen) {
            c.copy_from_slice(&e.to_le_bytes());
        }
    }
}
