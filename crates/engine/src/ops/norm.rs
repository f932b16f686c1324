//! RMS normalisation and the small scalar functions of the model.

/// `1/sqrt(mean(x²) + eps)`; the sum of squares is accumulated in f64 (as ds4 does),
/// which keeps the scale independent of summation order to within f32 rounding.
#[inline]
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    1.0 / (((ss / x.len() as f64) as f32) + eps).sqrt()
}

/// `out = (x·scale)·w`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let s = rms_scale(x, eps);
    for ((o, &v), &wv) in out.iter_mut().zip(x).zip(w) {
        *o = (v * s) * wv;
    }
}

pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let s = rms_scale(x, eps);
    for (v, &wv) in x.iter_mut().zip(w) {
        *v = (*v * s) * wv;
    }
}

/// Unweighted RMS normalisation in place.
pub fn rmsnorm_plain_inplace(x: &mut [f32], eps: f32) {
    let s = rms_scale(x, eps);
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// Row-wise weighted RMS normalisation of a `[rows][w.len()]` matrix.
pub fn rmsnorm_rows_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        rmsnorm_inplace(row, w, eps);
    }
}

/// Numerically stable logistic function.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// torch's softplus (beta 1, threshold 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_unit_rms() {
        let x = [3.0f32, -4.0, 0.0, 5.0];
        let mut y = [0.0; 4];
        rmsnorm(&x, &[1.0; 4], 0.0, &mut y);
        let ms: f32 = y.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn sigmoid_is_symmetric_and_finite() {
        for x in [-100.0f32, -3.0, 0.0, 2.5, 100.0] {
            let s = sigmoid(x);
            assert!(s.is_finite());
            assert!((s + sigmoid(-x) - 1.0).abs() < 1e-6);
        }
        assert_eq!(softplus(30.0), 30.0);
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
    }
}
