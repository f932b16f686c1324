//! The importance-weighted routed-expert quantisers (#24 part 2): with all weights 1
//! they equal the unweighted ones byte for byte; with an importance that favours some
//! columns, the importance-weighted squared error is lower than the unweighted
//! quantiser's (the point of an imatrix), for Q2_K, Q4_K and IQ2_XXS.

use ds4_gguf::{quant, GgmlType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn data(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u: f32 = rng.random_range(-1.0..1.0);
            u * u * u + 0.05 * rng.random_range(-1.0f32..1.0)
        })
        .collect()
}

fn weighted_err(ty: GgmlType, x: &[f32], q: &[u8], w: &[f32]) -> f64 {
    let y = quant::dequantize_to_vec(ty, q, x.len()).unwrap();
    x.iter()
        .zip(&y)
        .enumerate()
        .map(|(i, (a, b))| w[i % w.len()] as f64 * (*a as f64 - *b as f64).powi(2))
        .sum()
}

#[test]
fn unit_importance_is_the_unweighted_quantiser() {
    let mut rng = StdRng::seed_from_u64(5);
    let x = data(&mut rng, 512 * 4);
    let ones = vec![1.0f32; 512];
    for ty in [GgmlType::Q2_K, GgmlType::Q4_K, GgmlType::IQ2_XXS] {
        assert_eq!(
            quant::quantize_weights_imatrix(ty, &x, &ones).unwrap(),
            quant::quantize_weights(ty, &x).unwrap(),
            "{ty}"
        );
    }
}

#[test]
fn importance_lowers_the_weighted_error() {
    let mut rng = StdRng::seed_from_u64(9);
    let cols = 512;
    let x = data(&mut rng, cols * 16);
    // A few columns matter 100× more, as with outlier activation channels.
    let w: Vec<f32> = (0..cols)
        .map(|c| {
            if c % 7 == 0 || c % 11 == 3 {
                100.0
            } else {
                1.0
            }
        })
        .collect();
    for ty in [GgmlType::Q2_K, GgmlType::Q4_K, GgmlType::IQ2_XXS] {
        let plain = quant::quantize_weights(ty, &x).unwrap();
        let weighted = quant::quantize_weights_imatrix(ty, &x, &w).unwrap();
        let (ep, ew) = (
            weighted_err(ty, &x, &plain, &w),
            weighted_err(ty, &x, &weighted, &w),
        );
        println!("{ty}: weighted error {ep:.4} unweighted quantiser, {ew:.4} with importance");
        assert!(ew < 0.9 * ep, "{ty}: {ew} vs {ep}");
    }
}

#[test]
#[should_panic(expected = "importance")]
fn an_importance_of_the_wrong_width_is_refused() {
    let x = vec![0.5f32; 512];
    let _ = quant::quantize_weights_imatrix(GgmlType::Q4_K, &x, &[1.0; 384]);
}
