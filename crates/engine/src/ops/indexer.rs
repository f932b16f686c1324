//! The lightning indexer of ratio-4 layers: scores every index row against the
//! token's FP4-simulated query heads and keeps the top-k compressed rows.

use rayon::prelude::*;

use super::dot::dot;

/// Rows per parallel task when scoring many index rows.
const PAR_ROWS: usize = 1024;

/// `score[c] = Σ_h max(0, k_c·q_h)·w_h` for every index row `k_c`. Rows are scored
/// in parallel; each score is one thread's sequential sum over heads.
pub fn scores(index_rows: &[f32], dim: usize, q: &[f32], w: &[f32]) -> Vec<f32> {
    let score = |k: &[f32]| {
        let mut s = 0.0f32;
        for (qh, &wh) in q.chunks_exact(dim).zip(w) {
            s += dot(k, qh).max(0.0) * wh;
        }
        s
    };
    let n = index_rows.len() / dim;
    if n < 2 * PAR_ROWS {
        return index_rows.chunks_exact(dim).map(score).collect();
    }
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(PAR_ROWS)
        .zip(index_rows.par_chunks(PAR_ROWS * dim))
        .for_each(|(o, ks)| {
            for (ov, k) in o.iter_mut().zip(ks.chunks_exact(dim)) {
                *ov = score(k);
            }
        });
    out
}

/// The `k` highest scores as a mask over rows. Ties go to the lower index (the set
/// that repeated strict-`>` argmax picks); only the set matters to attention.
pub fn top_k_mask(scores: &[f32], k: usize) -> Vec<bool> {
    let n = scores.len();
    let mut mask = vec![false; n];
    if k >= n {
        mask.fill(true);
        return mask;
    }
    let mut idx: Vec<usize> = (0..n).collect();
    let order = |a: &usize, b: &usize| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b));
    if k > 0 {
        idx.select_nth_unstable_by(k - 1, order);
        for &i in &idx[..k] {
            mask[i] = true;
        }
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_ties_go_to_lowest_index() {
        let s = [1.0, 3.0, 2.0, 3.0, 3.0, 0.5];
        let m = top_k_mask(&s, 2);
        assert_eq!(m, vec![false, true, false, true, false, false]);
        let m = top_k_mask(&s, 4);
        assert_eq!(m, vec![false, true, true, true, true, false]);
        assert!(top_k_mask(&s, 6).iter().all(|&b| b));
        assert!(top_k_mask(&s, 9).iter().all(|&b| b));
    }

    #[test]
    fn top_k_equals_repeated_argmax() {
        let s: Vec<f32> = (0..200).map(|i| ((i * 37 % 23) as f32).sin()).collect();
        let mut taken = vec![false; s.len()];
        for _ in 0..17 {
            let mut best = None;
            for (i, &v) in s.iter().enumerate() {
                if !taken[i] && best.is_none_or(|b: usize| v > s[b]) {
                    best = Some(i);
                }
            }
            taken[best.unwrap()] = true;
        }
        assert_eq!(top_k_mask(&s, 17), taken);
    }

    #[test]
    fn scores_use_relu_per_head() {
        let rows = [1.0, 0.0, 0.0, 1.0];
        let q = [2.0, -1.0, -3.0, 0.5]; // two heads of dim 2
        let w = [1.0, 10.0];
        let s = scores(&rows, 2, &q, &w);
        assert_eq!(s, vec![2.0, 5.0]);
    }
}
