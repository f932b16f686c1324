//! Hyper-connections (mHC): `n_hc` residual streams mixed by a Sinkhorn-normalised
//! matrix around every sublayer, and the sigmoid-weighted collapse before the head.

use super::norm::sigmoid;

/// Mixing coefficients of one token for one sublayer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HcMix {
    /// Weights of the streams in the sublayer input.
    pub pre: Vec<f32>,
    /// Weight of the sublayer output in each destination stream.
    pub post: Vec<f32>,
    /// `comb[i·n + j]`: weight of source stream i in destination stream j.
    pub comb: Vec<f32>,
}

/// Splits the `2n + n²` mixes into pre/post/comb and runs the Sinkhorn normalisation
/// (row softmax + eps, column normalise, then `iters − 1` row/column rounds).
pub fn split_sinkhorn(
    mix: &[f32],
    scale: &[f32],
    base: &[f32],
    n: usize,
    iters: usize,
    eps: f32,
) -> HcMix {
    let pre = (0..n)
        .map(|i| sigmoid(mix[i] * scale[0] + base[i]) + eps)
        .collect();
    let post = (0..n)
        .map(|i| 2.0 * sigmoid(mix[n + i] * scale[1] + base[n + i]))
        .collect();
    let mut c: Vec<f32> = (0..n * n)
        .map(|k| mix[2 * n + k] * scale[2] + base[2 * n + k])
        .collect();
    for row in c.chunks_exact_mut(n) {
        let mx = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut sum = 0.0f32;
        for v in row.iter_mut() {
            *v = (*v - mx).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v = *v / sum + eps;
        }
    }
    normalize_cols(&mut c, n, eps);
    for _ in 1..iters {
        for row in c.chunks_exact_mut(n) {
            let s: f32 = row.iter().sum::<f32>() + eps;
            for v in row.iter_mut() {
                *v /= s;
            }
        }
        normalize_cols(&mut c, n, eps);
    }
    HcMix { pre, post, comb: c }
}

fn normalize_cols(c: &mut [f32], n: usize, eps: f32) {
    for j in 0..n {
        let s: f32 = (0..n).map(|i| c[i * n + j]).sum::<f32>() + eps;
        for i in 0..n {
            c[i * n + j] /= s;
        }
    }
}

/// `y = Σ_i pre_i·H_i` (streams of `d` values each).
pub fn weighted_sum(h: &[f32], pre: &[f32], y: &mut [f32]) {
    let d = y.len();
    y.fill(0.0);
    for (i, &p) in pre.iter().enumerate() {
        for (o, &v) in y.iter_mut().zip(&h[i * d..(i + 1) * d]) {
            *o += p * v;
        }
    }
}

/// `H'_j = post_j·out + Σ_i comb[i][j]·H_i`.
pub fn post(out: &[f32], h: &[f32], mix: &HcMix, h_new: &mut [f32]) {
    let n = mix.post.len();
    let d = out.len();
    for j in 0..n {
        let dst = &mut h_new[j * d..(j + 1) * d];
        for (o, &v) in dst.iter_mut().zip(out) {
            *o = mix.post[j] * v;
        }
        for i in 0..n {
            let w = mix.comb[i * n + j];
            for (o, &v) in dst.iter_mut().zip(&h[i * d..(i + 1) * d]) {
                *o += w * v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_is_nearly_doubly_stochastic() {
        let n = 4;
        let mix: Vec<f32> = (0..24)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7)
            .collect();
        let scale = [0.5f32, 0.8, 1.3];
        let base: Vec<f32> = (0..24).map(|i| (i as f32 * 0.1).cos()).collect();
        let m = split_sinkhorn(&mix, &scale, &base, n, 20, 1e-6);
        for i in 0..n {
            let row: f32 = m.comb[i * n..(i + 1) * n].iter().sum();
            let col: f32 = (0..n).map(|k| m.comb[k * n + i]).sum();
            assert!((row - 1.0).abs() < 1e-3, "row {i}: {row}");
            assert!((col - 1.0).abs() < 1e-5, "col {i}: {col}");
        }
        assert!(m.pre.iter().all(|&p| p > 0.0 && p <= 1.0 + 1e-6));
        assert!(m.post.iter().all(|&p| p > 0.0 && p < 2.0));
    }

    #[test]
    fn one_iteration_is_softmax_then_columns() {
        let n = 2;
        let mix = [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0];
        let m = split_sinkhorn(&mix, &[1.0; 3], &[0.0; 8], n, 1, 0.0);
        let e = std::f32::consts::E;
        let r0 = [e / (e + 1.0), 1.0 / (e + 1.0)];
        let c0 = r0[0] + 0.5;
        let c1 = r0[1] + 0.5;
        let want = [r0[0] / c0, r0[1] / c1, 0.5 / c0, 0.5 / c1];
        for (a, b) in m.comb.iter().zip(want) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn post_mixes_sources_into_destinations() {
        let mix = HcMix {
            pre: vec![1.0, 0.0],
            post: vec![1.0, 2.0],
            comb: vec![0.0, 1.0, 1.0, 0.0],
        };
        let h = [1.0f32, 2.0];
        let mut out = [0.0f32; 2];
        post(&[10.0], &h, &mix, &mut out);
        assert_eq!(out, [10.0 + 2.0, 20.0 + 1.0]);
    }
}
