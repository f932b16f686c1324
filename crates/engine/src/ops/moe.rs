//! Expert routing: sqrt(softplus) scores, hash or biased top-k selection, weights from
//! the unbiased scores, normalised and scaled.

use super::norm::softplus;

/// Selected experts and their weights for one token.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Routes one token. `hash`: the token's `tid2eid` row (layers < n_hash_layer);
/// otherwise the top `k` of `probs + bias` (strict `>`, ties to the lower index).
pub fn route(
    logits: &[f32],
    bias: Option<&[f32]>,
    hash: Option<&[i32]>,
    k: usize,
    scale: f32,
    normalize: bool,
) -> Route {
    let probs: Vec<f32> = logits.iter().map(|&x| softplus(x).sqrt()).collect();
    let experts: Vec<usize> = match hash {
        Some(ids) => ids.iter().map(|&e| e as usize).collect(),
        None => {
            let biased: Vec<f32> = match bias {
                Some(b) => probs.iter().zip(b).map(|(p, b)| p + b).collect(),
                None => probs.clone(),
            };
            top_k(&biased, k)
        }
    };
    let mut weights: Vec<f32> = experts.iter().map(|&e| probs[e]).collect();
    if normalize {
        // ds4 floors the sum at 2^-14; the official code has no floor (never reached).
        let sum = weights.iter().sum::<f32>().max(6.103_515_6e-5);
        for w in weights.iter_mut() {
            *w /= sum;
        }
    }
    for w in weights.iter_mut() {
        *w *= scale;
    }
    Route { experts, weights }
}

/// Indices of the `k` largest values, in descending order; equal values keep the
/// lower index first (insertion with strict `>`).
pub fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut sel: Vec<usize> = Vec::with_capacity(k + 1);
    for (i, &x) in v.iter().enumerate() {
        let pos = sel.iter().position(|&j| x > v[j]).unwrap_or(sel.len());
        if pos < k {
            sel.insert(pos, i);
            sel.truncate(k);
        }
    }
    sel
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_stable_on_ties() {
        assert_eq!(top_k(&[1.0, 5.0, 5.0, 3.0, 5.0], 2), vec![1, 2]);
        assert_eq!(top_k(&[1.0, 5.0, 5.0, 3.0, 5.0], 4), vec![1, 2, 4, 3]);
        assert_eq!(top_k(&[2.0, 2.0], 3), vec![0, 1]);
    }

    #[test]
    fn bias_selects_but_does_not_weight() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let bias = [10.0f32, 0.0, 0.0, 0.0];
        let r = route(&logits, Some(&bias), None, 2, 1.5, true);
        assert_eq!(r.experts, vec![0, 3]);
        let p0 = softplus(0.0).sqrt();
        let p3 = softplus(3.0).sqrt();
        assert!((r.weights[0] - 1.5 * p0 / (p0 + p3)).abs() < 1e-6);
        assert!((r.weights.iter().sum::<f32>() - 1.5).abs() < 1e-6);
    }

    #[test]
    fn hash_routing_uses_the_table() {
        let r = route(&[0.0, 1.0, 2.0], None, Some(&[2, 0]), 2, 1.0, true);
        assert_eq!(r.experts, vec![2, 0]);
    }
}
