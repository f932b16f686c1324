//! Random weights in every block format of the DS4 layout, at a target RMS, and the
//! small, fast, seedable generator behind them: the synthetic models of `ds4-tool
//! synth` / `ds4-bench --synthetic-weights` and the CUDA kernel checks
//! (`ds4_cuda::selftest`) draw from the same code. Streams are derived from
//! (seed, tensor, chunk) so parallel generation is deterministic.

use crate::quant::{dequantize, f32_to_f16};
use crate::GgmlType;

#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A stream for one (seed, a, b) triple.
    pub fn stream(seed: u64, a: u64, b: u64) -> Rng {
        let mut r = Rng(seed ^ 0x9e37_79b9_7f4a_7c15);
        r.0 ^= r
            .next_u64()
            .wrapping_add(a.wrapping_mul(0xd1b5_4a32_d192_ed03));
        r.0 ^= r
            .next_u64()
            .wrapping_add(b.wrapping_mul(0x8cb9_2ba7_2f3d_8dd7));
        r
    }

    /// SplitMix64.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, n).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() >> 32) * n) >> 32
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Approximately standard normal (sum of four uniforms, rescaled): cheap, bounded,
    /// and plenty for random weights.
    #[inline]
    pub fn normal(&mut self) -> f32 {
        let x = self.next_u64();
        let s: u32 = (0..4).map(|i| ((x >> (16 * i)) & 0xffff) as u32).sum();
        (s as f32 / 65535.0 - 2.0) * 1.732_050_8
    }

    pub fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let v = self.next_u64().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&v[..n]);
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
        dequantize(GgmlType::IQ2_XXS, &buf, &mut out).expect("one block");
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
        let v = crate::quant::dequantize_to_vec(ty, &buf, n).unwrap();
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
