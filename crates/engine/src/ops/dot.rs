//! f32 dot products for dense (dequantised or F16/F32) weight rows.
//!
//! The workspace's dev profile builds this crate at opt-level 1 and without target
//! features, where `f32::mul_add` is a libm call; so the hot loop is written with
//! AVX2/FMA intrinsics behind runtime detection. The reduction order is fixed per
//! machine (8 lanes × 4 accumulators, then a fixed tree), and one output is always
//! computed by one call, so results never depend on batching or thread count.

#[cfg(target_arch = "x86_64")]
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// `Σ a[i]·b[i]`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_scalar(a, b)
}

/// Portable fallback with the same lane structure (8 × 4 accumulators).
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [[0.0f32; 8]; 4];
    let main = n / 32 * 32;
    let mut i = 0;
    while i < main {
        for (u, lane) in acc.iter_mut().enumerate() {
            for (l, v) in lane.iter_mut().enumerate() {
                let k = i + 8 * u + l;
                *v += a[k] * b[k];
            }
        }
        i += 32;
    }
    let mut s = [0.0f32; 8];
    for l in 0..8 {
        s[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    }
    let mut t = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    for k in main..n {
        t += a[k] * b[k];
    }
    t
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let pa = a.as_ptr();
    let pb = b.as_ptr();
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut acc2 = _mm256_setzero_ps();
    let mut acc3 = _mm256_setzero_ps();
    let main = n / 32 * 32;
    let mut i = 0;
    while i < main {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 8)),
            _mm256_loadu_ps(pb.add(i + 8)),
            acc1,
        );
        acc2 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 16)),
            _mm256_loadu_ps(pb.add(i + 16)),
            acc2,
        );
        acc3 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 24)),
            _mm256_loadu_ps(pb.add(i + 24)),
            acc3,
        );
        i += 32;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
    let lo = _mm256_castps256_ps128(s);
    let hi = _mm256_extractf128_ps(s, 1);
    let q = _mm_add_ps(lo, hi); // lanes (0+4, 1+5, 2+6, 3+7)
    let h = _mm_add_ps(q, _mm_movehl_ps(q, q)); // (0+4)+(2+6), (1+5)+(3+7)
    let r = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    let mut t = _mm_cvtss_f32(r);
    for k in main..n {
        t += *pa.add(k) * *pb.add(k);
    }
    t
}

/// `y[i] += a·x[i]`.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_f64_reference() {
        for n in [0usize, 1, 7, 31, 32, 33, 64, 160, 257, 1024] {
            let a: Vec<f32> = (0..n)
                .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.25)
                .collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.5).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            // Inputs are small dyadic numbers: every path is exact.
            assert_eq!(dot(&a, &b) as f64, want, "n={n}");
            assert_eq!(dot_scalar(&a, &b) as f64, want, "n={n}");
        }
    }
}
