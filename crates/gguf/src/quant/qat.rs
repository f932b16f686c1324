//! Simulations of the model's quantisation-aware training: FP8 E4M3 on KV nope dims,
//! FP4 E2M1 (after a Hadamard rotation) on indexer queries and index rows. Both use
//! power-of-two (UE8M0) block scales. The CPU forward pass (`ds4_engine::ops::qat`
//! re-exports this module) and the CUDA kernel checks share them.

/// `ceil(log2(x))` for a positive normal f32, from the bits. The official kernels use
/// this exact form; `ceilf(log2f(x))` can be off by one a few ulp above a power of two.
#[inline]
pub fn ceil_log2(x: f32) -> i32 {
    let bits = x.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let man = bits & 0x7f_ffff;
    if exp == 0 {
        // Subnormal: only reached for pathological inputs; fall back to the float form.
        return x.log2().ceil() as i32;
    }
    exp - 127 + i32::from(man != 0)
}

/// 2^e as f32 (e within the normal range or slightly below; computed exactly).
#[inline]
fn pow2(e: i32) -> f32 {
    (e as f64).exp2() as f32
}

/// Rounds |v| ≤ 448 to the nearest E4M3FN value, ties to the even encoding.
#[inline]
pub fn round_e4m3(v: f32) -> f32 {
    let a = v.abs();
    if a == 0.0 {
        return 0.0;
    }
    // Quantum: 2^-9 in the subnormal range (< 2^-6), otherwise 3 mantissa bits.
    let e = if a < 0.015625 {
        -6
    } else {
        ((a.to_bits() >> 23) & 0xff) as i32 - 127
    };
    let q = pow2(e - 3);
    // a/q is exact (power of two); the rounded quotient's parity is the encoding's.
    let r = (a / q).round_ties_even() * q;
    r.min(448.0).copysign(v)
}

/// Rounds |v| ≤ 6 to the nearest E2M1 value {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the
/// even encoding.
#[inline]
pub fn round_e2m1(v: f32) -> f32 {
    let a = v.abs();
    let r: f32 = if a <= 0.25 {
        0.0
    } else if a < 0.75 {
        0.5
    } else if a <= 1.25 {
        1.0
    } else if a < 1.75 {
        1.5
    } else if a <= 2.5 {
        2.0
    } else if a < 3.5 {
        3.0
    } else if a <= 5.0 {
        4.0
    } else {
        6.0
    };
    r.copysign(v)
}

/// FP8 E4M3 simulation in blocks of `block` (64 in the model): amax floor 1e-4,
/// scale `2^ceil(log2(amax/448))`.
pub fn fp8_e4m3_inplace(x: &mut [f32], block: usize) {
    for b in x.chunks_mut(block) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
        let s = pow2(ceil_log2(amax / 448.0));
        for v in b.iter_mut() {
            let q = (*v / s).clamp(-448.0, 448.0);
            *v = round_e4m3(q) * s;
        }
    }
}

/// FP4 E2M1 simulation in blocks of `block` (32): amax floor 6·2^-126, scale
/// `2^ceil(log2(amax/6))`.
pub fn fp4_e2m1_inplace(x: &mut [f32], block: usize) {
    const FLOOR: f32 = 6.0 * f32::MIN_POSITIVE;
    for b in x.chunks_mut(block) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(FLOOR);
        let s = pow2(ceil_log2(amax / 6.0));
        for v in b.iter_mut() {
            let q = (*v / s).clamp(-6.0, 6.0);
            *v = round_e2m1(q) * s;
        }
    }
}

/// In-place Walsh–Hadamard transform (Sylvester order) scaled by 1/√n; n is a power of two.
pub fn hadamard_inplace(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut stride = 1;
    while stride < n {
        for base in (0..n).step_by(2 * stride) {
            for i in base..base + stride {
                let (a, b) = (x[i], x[i + stride]);
                x[i] = a + b;
                x[i + stride] = a - b;
            }
        }
        stride *= 2;
    }
    let scale = (n as f64).powf(-0.5) as f32;
    for v in x.iter_mut() {
        *v *= scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every E4M3FN magnitude: index i → e = i>>3, m = i&7.
    fn e4m3_values() -> Vec<f32> {
        (0..127)
            .map(|i| {
                let (e, m) = (i >> 3, i & 7);
                if e == 0 {
                    m as f32 * 2f32.powi(-9)
                } else {
                    (1.0 + m as f32 / 8.0) * 2f32.powi(e - 7)
                }
            })
            .collect()
    }

    #[test]
    fn e4m3_values_are_fixed_points_and_midpoints_go_to_even() {
        let vals = e4m3_values();
        for (i, &v) in vals.iter().enumerate() {
            assert_eq!(round_e4m3(v), v, "value {i}");
            assert_eq!(round_e4m3(-v), -v);
            if i + 1 < vals.len() {
                let mid = (v + vals[i + 1]) / 2.0;
                let even = if i % 2 == 0 { v } else { vals[i + 1] };
                assert_eq!(round_e4m3(mid), even, "midpoint after index {i}");
                // Just off the midpoint goes to the nearer value.
                assert_eq!(round_e4m3(mid.next_down()), v);
                assert_eq!(round_e4m3(mid.next_up()), vals[i + 1]);
            }
        }
        assert_eq!(round_e4m3(448.0), 448.0);
    }

    #[test]
    fn e2m1_ties_go_to_even_encoding() {
        let cases = [
            (0.25, 0.0),
            (0.26, 0.5),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (5.01, 6.0),
            (6.0, 6.0),
            (-2.5, -2.0),
            (-0.74, -0.5),
        ];
        for (x, want) in cases {
            assert_eq!(round_e2m1(x), want, "{x}");
        }
    }

    #[test]
    fn fp8_block_scale_is_a_power_of_two() {
        let mut x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.37).collect();
        let amax = 31.5 * 0.37f32;
        fp8_e4m3_inplace(&mut x, 64);
        let s = 2f32.powi((amax / 448.0).log2().ceil() as i32);
        for v in &x {
            let q = v / s;
            assert_eq!(round_e4m3(q), q, "{v} is not on the scaled grid");
        }
        // An all-zero block stays zero (amax floor avoids a zero scale).
        let mut z = vec![0.0f32; 64];
        fp8_e4m3_inplace(&mut z, 64);
        assert!(z.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn fp4_clamps_to_six_scales() {
        let mut x = vec![12.0f32, -3.0, 0.1, 1.4];
        x.resize(32, 0.0);
        fp4_e2m1_inplace(&mut x, 32);
        // amax 12 → scale 2: 12/2 = 6, -3/2 = -1.5, 0.05 → 0, 0.7 → 0.5.
        assert_eq!(&x[..4], &[12.0, -3.0, 0.0, 1.0]);
    }

    #[test]
    fn ceil_log2_is_exact_at_powers_of_two() {
        assert_eq!(ceil_log2(1.0), 0);
        assert_eq!(ceil_log2(1.0f32.next_up()), 1);
        assert_eq!(ceil_log2(0.5), -1);
        assert_eq!(ceil_log2(0.75), 0);
        assert_eq!(ceil_log2(f32::MIN_POSITIVE), -126);
    }

    #[test]
    fn hadamard_is_orthonormal_and_self_inverse() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 7 % 13) as f32 - 6.0) / 3.0).collect();
        let mut y = x.clone();
        hadamard_inplace(&mut y);
        let nx: f32 = x.iter().map(|v| v * v).sum();
        let ny: f32 = y.iter().map(|v| v * v).sum();
        assert!((nx - ny).abs() < 1e-4 * nx);
        hadamard_inplace(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5);
        }
        // First row of H is all ones: y[0] = Σx/√n.
        let mut e = vec![0.0f32; 4];
        e[1] = 1.0;
        hadamard_inplace(&mut e);
        assert_eq!(e, vec![0.5, -0.5, 0.5, -0.5]);
    }
}
