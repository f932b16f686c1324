//! Sink attention of one query head over a list of K(=V) rows.

use super::dot::{axpy, dot};

/// `out = Σ_r softmax([s_r…, sink])_r · row_r` with `s_r = q·row_r·scale`: the sink
/// takes part in the normalisation but contributes no value.
pub fn attend_head(
    q: &[f32],
    rows: &[&[f32]],
    sink: f32,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    scores.clear();
    let mut m = sink;
    for row in rows {
        let s = dot(q, row) * scale;
        m = m.max(s);
        scores.push(s);
    }
    let mut den = (sink - m).exp();
    out.fill(0.0);
    for (s, row) in scores.iter().zip(rows) {
        let w = (s - m).exp();
        den += w;
        axpy(out, w, row);
    }
    let inv = 1.0 / den;
    for v in out.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sink_absorbs_weight() {
        let q = [1.0f32, 0.0];
        let r0 = [0.0f32, 2.0];
        let rows: Vec<&[f32]> = vec![&r0];
        let mut sc = Vec::new();
        let mut out = [0.0f32; 2];
        // s = 0, sink = 0: half the mass on the sink.
        attend_head(&q, &rows, 0.0, 1.0, &mut sc, &mut out);
        assert!((out[1] - 1.0).abs() < 1e-6);
        // Very negative sink: plain softmax.
        attend_head(&q, &rows, -1e4, 1.0, &mut sc, &mut out);
        assert!((out[1] - 2.0).abs() < 1e-6);
    }
}
