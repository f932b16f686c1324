//! Random tensor contents: quantised blocks with scales set for a target RMS, norm and
//! bias vectors near their usual values, and the hash-routing table.

use ds4_engine::config::Config;
use ds4_engine::layout::{Role, TensorSpec};
use ds4_gguf::quant::f32_to_f16;
use ds4_gguf::GgmlType;

use crate::rng::Rng;

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

/// Random quantised (or dense) blocks whose dequantised values have RMS ≈ `rms`.
pub fn fill_blocks(ty: GgmlType, rms: f32, buf: &mut [u8], rng: &mut Rng) {
    let f16 = |x: f32| f32_to_f16(x).to_le_bytes();
    match ty {
        GgmlType::F32 => {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&(rms * rng.normal()).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(&f16(rms * rng.normal()));
            }
        }
        GgmlType::Q8_0 => {
            // Uniform quants in [-127, 127] have RMS 127/√3.
            let d = f16(rms / 73.32);
            for b in buf.chunks_exact_mut(34) {
                b[0..2].copy_from_slice(&d);
                rng.fill_bytes(&mut b[2..34]);
                for q in &mut b[2..34] {
                    if *q == 0x80 {
                        *q = 0x81;
                    }
                }
            }
        }
        GgmlType::IQ2_XXS => {
            let d = f16(rms / iq2_xxs_unit_rms());
            for b in buf.chunks_exact_mut(66) {
                b[0..2].copy_from_slice(&d);
                rng.fill_bytes(&mut b[2..66]);
            }
        }
        GgmlType::Q2_K => {
            // Scales 1..=10 with min = round(1.5·scale) centre each sub-block:
            // value = d·(sc·q − m) ≈ d·sc·(q − 1.5), RMS ≈ d·1.118·rms(sc).
            let d = rms / (1.118 * 6.2);
            for b in buf.chunks_exact_mut(84) {
                for s in &mut b[0..16] {
                    let sc = 1 + rng.below(10) as u8;
                    let m = ((1.5 * sc as f32).round() as u8).min(15);
                    *s = sc | (m << 4);
                }
                rng.fill_bytes(&mut b[16..80]);
                b[80..82].copy_from_slice(&f16(d));
                b[82..84].copy_from_slice(&f16(d));
            }
        }
        GgmlType::Q4_K => {
            // Scales 1..=8 with min = round(7.5·scale): value ≈ d·sc·(q − 7.5).
            let d = rms / (4.61 * 5.1);
            for b in buf.chunks_exact_mut(144) {
                b[0..2].copy_from_slice(&f16(d));
                b[2..4].copy_from_slice(&f16(d));
                let mut sc = [0u8; 8];
                let mut mn = [0u8; 8];
                for j in 0..8 {
                    sc[j] = 1 + rng.below(8) as u8;
                    mn[j] = (7.5 * sc[j] as f32).round() as u8;
                }
                let s = &mut b[4..16];
                for j in 0..4 {
                    s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
                    s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
                    s[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
                }
                rng.fill_bytes(&mut b[16..144]);
            }
        }
        GgmlType::I32 => buf.fill(0),
        other => unreachable!("the DS4 layout has no {other} tensors"),
    }
}

/// RMS of IQ2_XXS values for d = 1 with uniformly random grid indices, signs and
/// 4-bit scales: 0.25 · rms(0.5 + ls) · rms(grid).
fn iq2_xxs_unit_rms() -> f32 {
    let ls: f32 = (0..16).map(|l| (0.5 + l as f32).powi(2)).sum::<f32>() / 16.0;
    let mut buf = [0u8; 66];
    buf[0..2].copy_from_slice(&f32_to_f16(1.0).to_le_bytes());
    // One block holding grid indices 0..255 (8 groups × 4) probes the grid's RMS.
    let mut sum = 0.0f64;
    let mut out = [0.0f32; 256];
    for start in (0..256).step_by(32) {
        for g in 0..8 {
            for l in 0..4 {
                buf[2 + 8 * g + l] = ((start + 4 * g + l) % 256) as u8;
            }
            buf[6 + 8 * g..10 + 8 * g].copy_from_slice(&0u32.to_le_bytes());
        }
        ds4_gguf::quant::dequantize(GgmlType::IQ2_XXS, &buf, &mut out).expect("one block");
        // With ls = 0 each value is 0.5·0.25·grid.
        sum += out.iter().map(|&v| (v as f64 / 0.125).powi(2)).sum::<f64>();
    }
    let grid_rms = (sum / (8.0 * 256.0)).sqrt() as f32;
    0.25 * ls.sqrt() * grid_rms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rms_of(ty: GgmlType, target: f32) -> f32 {
        let be = ty.block_elems();
        let n = be * 64;
        let mut buf = vec![0u8; ty.bytes_for(n as u64).unwrap() as usize];
        fill_blocks(ty, target, &mut buf, &mut Rng::stream(1, 2, 3));
        let v = ds4_gguf::quant::dequantize_to_vec(ty, &buf, n).unwrap();
        (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / n as f64).sqrt() as f32
    }

    #[test]
    fn random_blocks_hit_their_target_rms() {
        for ty in [
            GgmlType::F16,
            GgmlType::Q8_0,
            GgmlType::IQ2_XXS,
            GgmlType::Q2_K,
            GgmlType::Q4_K,
        ] {
            let r = rms_of(ty, 0.02);
            assert!((0.012..0.03).contains(&r), "{ty}: rms {r}");
        }
    }
}
