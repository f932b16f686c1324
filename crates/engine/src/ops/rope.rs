//! Rotary embeddings: interleaved (GPT-J) pairs on the last `rope_dim` dims of a head,
//! with YaRN frequency interpolation on compressed layers.
//!
//! Angles follow the official reference: per-pair frequencies computed once in f32
//! (`1/base^(2k/d)`, blended by the YaRN ramp), angle = `pos·freq` in f32. ds4's
//! repeated-multiplication form differs only in the last bits (≈1e-5 on logits).

use crate::config::Config;

#[derive(Clone, Debug)]
pub struct Rope {
    /// One frequency per rotated pair.
    freqs: Vec<f32>,
}

/// Cosines and sines of one position, one per pair.
#[derive(Clone, Debug, Default)]
pub struct RopeAngles {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl Rope {
    /// Plain RoPE with `base`, or YaRN-blended frequencies when `yarn` is given as
    /// (factor, original context, beta_fast, beta_slow).
    pub fn new(dim: usize, base: f32, yarn: Option<(f32, u64, f32, f32)>) -> Rope {
        let half = dim / 2;
        let mut freqs: Vec<f32> = (0..half)
            .map(|k| 1.0 / (base.powf((2 * k) as f32 / dim as f32)))
            .collect();
        if let Some((factor, orig, beta_fast, beta_slow)) = yarn {
            let (low, high) = yarn_range(dim, base, orig, beta_fast, beta_slow);
            let span = if low == high {
                0.001
            } else {
                (high - low) as f32
            };
            for (k, f) in freqs.iter_mut().enumerate() {
                let ramp = ((k as f32 - low as f32) / span).clamp(0.0, 1.0);
                let smooth = 1.0 - ramp;
                *f = *f / factor * (1.0 - smooth) + *f * smooth;
            }
        }
        Rope { freqs }
    }

    /// The rope of layer `il`: base 10000 without YaRN on ratio-0 layers, the
    /// compressed base with YaRN elsewhere.
    pub fn for_layer(cfg: &Config, il: usize) -> Rope {
        if cfg.compress_ratios[il] == 0 {
            Rope::new(cfg.rope_dim, cfg.rope_freq_base, None)
        } else {
            Rope::new(
                cfg.rope_dim,
                cfg.compress_rope_freq_base,
                Some((
                    cfg.rope_scaling_factor,
                    cfg.rope_orig_ctx,
                    cfg.yarn_beta_fast,
                    cfg.yarn_beta_slow,
                )),
            )
        }
    }

    pub fn dim(&self) -> usize {
        2 * self.freqs.len()
    }

    pub fn freqs(&self) -> &[f32] {
        &self.freqs
    }

    pub fn angles(&self, pos: usize) -> RopeAngles {
        let t = pos as f32;
        let mut a = RopeAngles {
            cos: Vec::with_capacity(self.freqs.len()),
            sin: Vec::with_capacity(self.freqs.len()),
        };
        for &f in &self.freqs {
            let th = t * f;
            a.cos.push(th.cos());
            a.sin.push(th.sin());
        }
        a
    }
}

/// Pairs `[low, high]` over which YaRN ramps from original to interpolated frequency:
/// floor/ceil of `d·ln(orig/(β·2π)) / (2·ln base)`, clamped to `[0, d−1]`.
pub fn yarn_range(dim: usize, base: f32, orig: u64, beta_fast: f32, beta_slow: f32) -> (i64, i64) {
    let corr = |rot: f64| {
        dim as f64 * (orig as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * (base as f64).ln())
    };
    let low = corr(beta_fast as f64).floor() as i64;
    let high = corr(beta_slow as f64).ceil() as i64;
    (low.max(0), high.min(dim as i64 - 1))
}

/// Rotates the interleaved pairs of `x` (length = 2·pairs) by the angles; `inverse`
/// rotates backwards (complex conjugate).
#[inline]
pub fn apply(x: &mut [f32], a: &RopeAngles, inverse: bool) {
    for (k, pair) in x.chunks_exact_mut(2).enumerate() {
        let (c, s) = (a.cos[k], if inverse { -a.sin[k] } else { a.sin[k] });
        let (x0, x1) = (pair[0], pair[1]);
        pair[0] = x0 * c - x1 * s;
        pair[1] = x0 * s + x1 * c;
    }
}

/// Applies the rotation to the last `rope_dim` dims of every `head_dim` slice of `x`.
pub fn apply_heads(x: &mut [f32], head_dim: usize, a: &RopeAngles, inverse: bool) {
    let rd = 2 * a.cos.len();
    for h in x.chunks_exact_mut(head_dim) {
        apply(&mut h[head_dim - rd..], a, inverse);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_yarn_ramp_is_pairs_7_to_13() {
        assert_eq!(yarn_range(32, 160000.0, 65536, 32.0, 1.0), (7, 13));
        // Flash: 64 dims → 15..25 (model-spec.md §5.3).
        assert_eq!(yarn_range(64, 160000.0, 65536, 32.0, 1.0), (15, 25));
    }

    #[test]
    fn yarn_keeps_fast_pairs_and_interpolates_slow_ones() {
        let plain = Rope::new(32, 160000.0, None);
        let yarn = Rope::new(32, 160000.0, Some((16.0, 65536, 32.0, 1.0)));
        for k in 0..=7 {
            assert_eq!(plain.freqs()[k], yarn.freqs()[k]);
        }
        for k in 13..16 {
            assert!((yarn.freqs()[k] - plain.freqs()[k] / 16.0).abs() < 1e-12);
        }
    }

    #[test]
    fn inverse_undoes_rotation() {
        let rope = Rope::new(32, 160000.0, Some((16.0, 65536, 32.0, 1.0)));
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        for pos in [0usize, 1, 17, 700, 65535] {
            let a = rope.angles(pos);
            let mut y = x.clone();
            apply_heads(&mut y, 64, &a, false);
            if pos > 0 {
                assert_ne!(x, y);
            }
            assert_eq!(&x[..32], &y[..32], "nope dims untouched");
            apply_heads(&mut y, 64, &a, true);
            for (p, q) in x.iter().zip(&y) {
                assert!((p - q).abs() < 1e-5, "pos {pos}");
            }
        }
    }
}
