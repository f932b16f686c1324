//! The sampler's definition in integers: a token's weight `e^((l − max)/T)` as a
//! fixed-point integer (the top token weighs [`ONE`] = 2^46), so that every sum the
//! filters and the draw need is exact in any order. The device's sampled pick
//! (`ds4-cuda` `kernels/sample.cu`, radix selections over an unsorted candidate list)
//! and this host code then choose the same token from the same logits and the same
//! uniform draw, bit for bit: the host's sorted walk and the device's order-free sums
//! agree because integer addition does not depend on its order. `exp_fixed` uses only
//! IEEE additions, subtractions and multiplications in a fixed order (no fused
//! multiply-add, no library call), so its bits are the same on every platform and on
//! the GPU (`sample.cu` repeats it operation for operation).
//!
//! The semantics, in the candidates' order (descending logit, ties to the lower id):
//! * weights `W = round(e^x · 2^46)` with `x = (l − max)/T` (0 for the maximum itself),
//!   0 below `x = −40` or for NaN; tokens of weight 0 never count;
//! * top-k keeps the first `k`; top-p the shortest prefix whose weight reaches
//!   `⌈top_p · Z_k⌉` (`Z_k` the top-k set's total); min-p the tokens with
//!   `W ≥ ⌈min_p · 2^46⌉`; all three are prefixes, so their intersection is one;
//! * the draw `u ∈ [0, 1)` picks the first kept token whose running weight exceeds
//!   `⌊u · Z⌋` (`Z` the kept total). No kept token (every logit NaN, min-p above 1):
//!   `None` (the caller falls back to the argmax).
//!
//! Against exact real arithmetic this drops tokens under `e^−40` of the top one and
//! rounds each weight to 2^−46 of the top's: nothing a 129k vocabulary can notice.

use super::{max_ignoring_nan, SamplerConfig};

/// The top token's weight.
pub const ONE: u64 = 1 << 46;

/// Log-weights below this weigh nothing.
const X_FLOOR: f64 = -40.0;

/// The Taylor coefficients 1/n!, n = 13 down to 0 (bit patterns: `sample.cu` has the
/// same words).
const TAYLOR: [u64; 14] = [
    0x3de6_1246_13a8_6d09,
    0x3e21_eed8_eff8_d898,
    0x3e5a_e645_67f5_44e4,
    0x3e92_7e4f_b778_9f5c,
    0x3ec7_1de3_a556_c734,
    0x3efa_01a0_1a01_a01a,
    0x3f2a_01a0_1a01_a01a,
    0x3f56_c16c_16c1_6c17,
    0x3f81_1111_1111_1111,
    0x3fa5_5555_5555_5555,
    0x3fc5_5555_5555_5555,
    0x3fe0_0000_0000_0000,
    0x3ff0_0000_0000_0000,
    0x3ff0_0000_0000_0000,
];
const LOG2E: u64 = 0x3ff7_1547_652b_82fe;
/// ln 2 in two parts: the high part's low 21 bits are zero, so `k · LN2_HI` is exact.
const LN2_HI: u64 = 0x3fe6_2e42_fee0_0000;
const LN2_LO: u64 = 0x3dea_39ef_3579_3c76;
/// 1.5 · 2^52: adding and subtracting it rounds to an integer (ties to even).
const SHIFTER: f64 = 6_755_399_441_055_744.0;

/// `e^x` for `x` in [−40, 0] (accurate to a few ulp): `x = k·ln 2 + r` with `|r| ≤ ln 2 / 2`,
/// a degree-13 Taylor polynomial in `r` by Horner's rule, times `2^k`.
pub fn exp_fixed(x: f64) -> f64 {
    let f = f64::from_bits;
    let kf = (x * f(LOG2E) + SHIFTER) - SHIFTER;
    let r = (x - kf * f(LN2_HI)) - kf * f(LN2_LO);
    let mut p = f(TAYLOR[0]);
    for &c in &TAYLOR[1..] {
        p = p * r + f(c);
    }
    // k ∈ [−58, 0]: 2^k is a normal number.
    let k = kf as i64;
    p * f(((1023 + k) as u64) << 52)
}

/// A token's weight against the row's maximum `mx` at temperature `t`.
pub fn weight(l: f32, mx: f32, t: f64) -> u64 {
    let x = if l == mx {
        0.0
    } else {
        (l as f64 - mx as f64) / t
    };
    // Also NaN (a NaN logit or temperature).
    if x.is_nan() || x < X_FLOOR {
        return 0;
    }
    (exp_fixed(x) * ONE as f64 + 0.5) as u64
}

/// The candidates' order key: descending logit (as `f32::total_cmp`), then ascending id.
/// The device packs it as `(desc << 17) | id` (vocabularies up to 2^17).
pub fn order_key(l: f32, id: u32) -> (u32, u32) {
    let b = l.to_bits();
    let ord = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    (!ord, id)
}

/// A sampled pick's settings as both sides take them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PickParams {
    /// Temperature (> 0).
    pub t: f64,
    /// 0: off.
    pub top_k: u32,
    /// 1: off.
    pub top_p: f64,
    /// The least weight min-p keeps (1: off).
    pub w_min: u64,
}

impl PickParams {
    pub fn new(c: &SamplerConfig) -> PickParams {
        let w_min = if c.min_p > 0.0 {
            // Saturates (min-p above 1 keeps nothing).
            ((c.min_p as f64) * ONE as f64).ceil().max(1.0) as u64
        } else {
            1
        };
        PickParams {
            t: c.temperature as f64,
            top_k: c.top_k.min(u32::MAX as usize) as u32,
            top_p: if c.top_p < 1.0 { c.top_p as f64 } else { 1.0 },
            w_min,
        }
    }
}

/// The kept tokens in the candidates' order, with their weights.
pub fn kept(p: &PickParams, logits: &[f32]) -> Vec<(u32, u64)> {
    let mx = max_ignoring_nan(logits);
    let top_p = p.top_p < 1.0;
    // Only tokens that can weigh anything (top-p needs the top-k set's whole total),
    // or without top-p reach min-p, are looked at: a bound on l with a margin, the
    // weight itself decides.
    let x_low = if top_p || p.w_min <= 1 {
        X_FLOOR - 1.0
    } else {
        (p.w_min as f64 / ONE as f64).ln() - 0.01
    };
    let bound = mx as f64 + p.t * x_low;
    let filter = mx.is_finite() && p.t.is_finite() && bound.is_finite();
    let least = if top_p { 1 } else { p.w_min };
    let mut s: Vec<(u32, u64)> = logits
        .iter()
        .enumerate()
        .filter(|&(_, &l)| !filter || l as f64 >= bound)
        .filter_map(|(i, &l)| {
            let w = weight(l, mx, p.t);
            (w >= least).then_some((i as u32, w))
        })
        .collect();
    s.sort_unstable_by_key(|&(i, _)| order_key(logits[i as usize], i));
    if p.top_k > 0 {
        s.truncate(p.top_k as usize);
    }
    if top_p {
        let z: u64 = s.iter().map(|e| e.1).sum();
        let need = (p.top_p * z as f64).ceil().max(1.0) as u64;
        let mut cum = 0u64;
        let n = s
            .iter()
            .position(|e| {
                cum += e.1;
                cum >= need
            })
            .map_or(s.len(), |i| i + 1);
        s.truncate(n);
    }
    // A prefix: weights do not increase along the order.
    let m = s.iter().take_while(|e| e.1 >= p.w_min).count();
    s.truncate(m);
    s
}

/// The token the draw `u ∈ [0, 1)` picks among [`kept`]; `None` when nothing is kept.
pub fn pick(p: &PickParams, logits: &[f32], u: f64) -> Option<u32> {
    let s = kept(p, logits);
    let z: u64 = s.iter().map(|e| e.1).sum();
    if z == 0 {
        return None;
    }
    let target = ((u * z as f64) as u64).min(z - 1);
    let mut cum = 0u64;
    s.iter()
        .find(|e| {
            cum += e.1;
            cum > target
        })
        .map(|e| e.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_fixed_is_exp() {
        assert_eq!(exp_fixed(0.0), 1.0);
        assert_eq!(weight(3.0, 3.0, 0.7), ONE);
        let mut worst = 0.0f64;
        let mut x = -40.0;
        while x <= 0.0 {
            let rel = (exp_fixed(x) - x.exp()).abs() / x.exp();
            worst = worst.max(rel);
            x += 0.001_37;
        }
        assert!(worst < 1e-14, "{worst:e}");
    }

    /// The words behind `exp_fixed` against their decimal meaning (a typo in a bit
    /// pattern would still give a plausible e^x at a few points).
    #[test]
    fn constants_are_what_they_say() {
        let mut f = 1.0f64;
        for (i, &c) in TAYLOR.iter().rev().enumerate() {
            if i > 0 {
                f *= i as f64;
            }
            assert!((f64::from_bits(c) * f - 1.0).abs() < 1e-15, "1/{i}!");
        }
        assert_eq!(f64::from_bits(LOG2E), std::f64::consts::LOG2_E);
        let ln2 = f64::from_bits(LN2_HI) + f64::from_bits(LN2_LO);
        assert_eq!(ln2, std::f64::consts::LN_2);
        assert_eq!(LN2_HI & ((1 << 21) - 1), 0);
    }

    #[test]
    fn weights_and_order() {
        assert_eq!(weight(f32::NAN, 1.0, 1.0), 0);
        assert_eq!(weight(1.0, 1.0, f64::NAN), ONE);
        assert_eq!(weight(0.0, 1.0, f64::NAN), 0);
        assert_eq!(weight(-100.0, 0.0, 1.0), 0);
        assert_eq!(weight(f32::INFINITY, f32::INFINITY, 1.0), ONE);
        assert_eq!(weight(5.0, f32::INFINITY, 1.0), 0);
        assert_eq!(weight(f32::NEG_INFINITY, f32::NEG_INFINITY, 1.0), ONE);
        let w = weight(0.0, 1.0, 1.0);
        assert!((w as f64 / ONE as f64 - (-1f64).exp()).abs() < 1e-13);
        // Descending logits, ties by id, -0.0 after +0.0 (total_cmp).
        let mut v = [
            (1.0f32, 3u32),
            (2.0, 5),
            (1.0, 1),
            (-0.0, 0),
            (0.0, 9),
            (-3.0, 2),
        ];
        v.sort_by_key(|&(l, i)| order_key(l, i));
        let ids: Vec<u32> = v.iter().map(|e| e.1).collect();
        assert_eq!(ids, vec![5, 1, 3, 9, 0, 2]);
    }
}
