//! KV compressors: gated softmax pooling of `ratio` consecutive tokens into one row,
//! with the two-lane overlap of ratio-4 layers (each row also pools the previous
//! window through the first lane).

use crate::kv::Frontier;

/// The pooling geometry of one compressor.
#[derive(Clone, Copy, Debug)]
pub struct Pool<'a> {
    pub ratio: usize,
    /// 2 for the overlapping ratio-4 compressor, else 1.
    pub lanes: usize,
    pub dim: usize,
    /// `ape[q·lanes·dim + j]`: score bias of window slot q, column j.
    pub ape: &'a [f32],
}

/// Stores one token's projections (`kv`, `score` = gate output; both `lanes·dim`)
/// at position `pos`. When the token closes a window, returns the pooled row
/// (`dim` values, before norm/RoPE/QAT) and advances the frontier.
pub fn step(
    st: &mut Frontier,
    w: Pool<'_>,
    kv: &[f32],
    score: &[f32],
    pos: usize,
) -> Option<Vec<f32>> {
    let r = w.ratio;
    let d = w.dim;
    let width = w.lanes * d;
    let q = pos % r;
    let slot = if w.lanes == 2 { r + q } else { q };
    let ape = &w.ape[q * width..(q + 1) * width];
    st.kv[slot * width..(slot + 1) * width].copy_from_slice(kv);
    for ((s, &g), &a) in st.score[slot * width..(slot + 1) * width]
        .iter_mut()
        .zip(score)
        .zip(ape)
    {
        *s = g + a;
    }
    if !(pos + 1).is_multiple_of(r) {
        return None;
    }
    let mut out = vec![0.0f32; d];
    // Candidate (row, column offset) pairs in visiting order.
    let cands: Vec<(usize, usize)> = if w.lanes == 2 {
        (0..r)
            .map(|i| (i, 0))
            .chain((0..r).map(|i| (r + i, d)))
            .collect()
    } else {
        (0..r).map(|i| (i, 0)).collect()
    };
    let mut e = vec![0.0f32; cands.len()];
    for (j, o) in out.iter_mut().enumerate() {
        let mut mx = crate::kv::NEG_INF;
        for &(row, off) in &cands {
            mx = mx.max(st.score[row * width + off + j]);
        }
        if mx <= -5e29 {
            *o = 0.0;
            continue;
        }
        let mut den = 0.0f32;
        for (ei, &(row, off)) in e.iter_mut().zip(&cands) {
            *ei = (st.score[row * width + off + j] - mx).exp();
            den += *ei;
        }
        let mut acc = 0.0f32;
        for (ei, &(row, off)) in e.iter().zip(&cands) {
            acc += (ei / den) * st.kv[row * width + off + j];
        }
        *o = acc;
    }
    if w.lanes == 2 {
        // The closed window becomes the overlap lane of the next one.
        st.kv.copy_within(r * width..2 * r * width, 0);
        st.score.copy_within(r * width..2 * r * width, 0);
        st.clear_rows(r, 2 * r);
    } else {
        st.clear_rows(0, r);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(ratio: usize, lanes: usize, dim: usize, ape: &[f32]) -> Pool<'_> {
        Pool {
            ratio,
            lanes,
            dim,
            ape,
        }
    }

    #[test]
    fn ratio_4_overlaps_previous_window() {
        let (r, d) = (4, 2);
        let ape = vec![0.0; r * 2 * d];
        let w = pool(r, 2, d, &ape);
        let mut st = Frontier::new(r, 2, d);
        let mut rows = Vec::new();
        for pos in 0..8 {
            // Equal scores: the pooled value is the mean of the candidates.
            let kv = [pos as f32, 100.0 + pos as f32, 1000.0 + pos as f32, 2000.0];
            if let Some(row) = step(&mut st, w, &kv, &[0.0; 4], pos) {
                rows.push(row);
            }
        }
        assert_eq!(rows.len(), 2);
        // Row 0: previous lane empty; current lane = columns d.. of tokens 0..3.
        assert_eq!(rows[0], vec![1001.5, 2000.0]);
        // Row 1: previous lane = columns 0..d of tokens 0..3, current = d.. of 4..7.
        let want0 = (0.0 + 1.0 + 2.0 + 3.0 + 1004.0 + 1005.0 + 1006.0 + 1007.0) / 8.0;
        let want1 = (100.0 + 101.0 + 102.0 + 103.0 + 4.0 * 2000.0) / 8.0;
        assert!((rows[1][0] - want0).abs() < 1e-3);
        assert!((rows[1][1] - want1).abs() < 1e-3);
    }

    #[test]
    fn gate_scores_and_ape_weight_the_pool() {
        let (r, d) = (2, 1);
        // APE adds ln 2 to slot 1.
        let ape = [0.0, 2f32.ln()];
        let w = pool(r, 1, d, &ape);
        let mut st = Frontier::new(r, 1, d);
        assert!(step(&mut st, w, &[1.0], &[0.0], 0).is_none());
        let row = step(&mut st, w, &[3.0], &[0.0], 1).unwrap();
        // weights 1/3 and 2/3
        assert!((row[0] - (1.0 / 3.0 + 2.0)).abs() < 1e-6);
        // The window restarts empty.
        assert!(st.score.iter().all(|&s| s == crate::kv::NEG_INF));
    }
}
