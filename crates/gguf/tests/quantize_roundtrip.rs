//! Weight quantisers: Gaussian data → quantize → dequantize stays within per-type
//! relative RMS error bounds, and edge cases (zeros, constants, huge values) stay
//! finite and exact where they should be.

use ds4_gguf::{quant, GgmlType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Standard normal values (Box–Muller), so the test needs no extra crate.
fn gaussian(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random_range(f64::EPSILON..1.0);
            let u2: f64 = rng.random();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

fn rel_rmse(x: &[f32], y: &[f32]) -> f64 {
    let err: f64 = x
        .iter()
        .zip(y)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let sig: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (err / sig).sqrt()
}

fn roundtrip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    let q = quant::quantize_weights(ty, x).unwrap();
    assert_eq!(q.len(), x.len() / ty.block_elems() * ty.block_bytes());
    quant::dequantize_to_vec(ty, &q, x.len()).unwrap()
}

/// Measured on Gaussian data (seed 42; 64 Ki values, IQ2_XXS 16 Ki): Q8_0 0.0054,
/// Q4_K 0.0715, Q2_K 0.297, IQ2_XXS 0.329, F16 0.00019. Bounds leave ~10% headroom.
const BOUNDS: [(GgmlType, f64); 5] = [
    (GgmlType::Q8_0, 0.006),
    (GgmlType::Q4_K, 0.08),
    (GgmlType::Q2_K, 0.33),
    (GgmlType::IQ2_XXS, 0.36),
    (GgmlType::F16, 0.0003),
];

#[test]
fn gaussian_roundtrip_error_bounds() {
    let mut rng = StdRng::seed_from_u64(42);
    let x = gaussian(&mut rng, 1 << 16);
    for (ty, bound) in BOUNDS {
        let n = if ty == GgmlType::IQ2_XXS {
            1 << 14
        } else {
            x.len()
        };
        let y = roundtrip(ty, &x[..n]);
        let e = rel_rmse(&x[..n], &y);
        eprintln!("{ty}: relative RMSE {e:.4} (bound {bound})");
        if std::env::var("DS4_MEASURE").is_err() {
            assert!(e < bound, "{ty}: relative RMSE {e} ≥ {bound}");
        }
    }
}

#[test]
fn scaled_rows_keep_relative_error() {
    // Per-block scales make the error scale-invariant across magnitudes.
    let mut rng = StdRng::seed_from_u64(7);
    let base = gaussian(&mut rng, 4096);
    for scale in [1e-3f32, 1.0, 300.0] {
        let x: Vec<f32> = base.iter().map(|v| v * scale).collect();
        for (ty, bound) in BOUNDS {
            if ty == GgmlType::IQ2_XXS || ty == GgmlType::F16 {
                continue;
            }
            let e = rel_rmse(&x, &roundtrip(ty, &x));
            assert!(e < bound, "{ty} at scale {scale}: {e}");
        }
    }
}

#[test]
fn zeros_and_constants() {
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q4_K,
        GgmlType::IQ2_XXS,
    ] {
        let z = vec![0.0f32; 512];
        assert!(roundtrip(ty, &z).iter().all(|&v| v == 0.0), "{ty}: zeros");
        let c = vec![0.75f32; 512];
        let y = roundtrip(ty, &c);
        assert!(y.iter().all(|v| v.is_finite()), "{ty}: constant");
        assert!(
            rel_rmse(&c, &y) < 0.3,
            "{ty}: constant error {}",
            rel_rmse(&c, &y)
        );
    }
    // Q8_0 represents ±amax and small integers times d exactly.
    let x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) / 16.0 * 127.0).collect();
    let y = roundtrip(GgmlType::Q8_0, &x);
    assert_eq!(y[0], x[0]);
}

#[test]
fn q8_0_matches_reference_formula() {
    let mut rng = StdRng::seed_from_u64(3);
    let x = gaussian(&mut rng, 32 * 64);
    let mut q = vec![0u8; 64 * 34];
    quant::quantize_q8_0_weights(&x, &mut q);
    for (xb, qb) in x.chunks_exact(32).zip(q.chunks_exact(34)) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        assert_eq!(u16::from_le_bytes([qb[0], qb[1]]), quant::f32_to_f16(d));
        for (v, &b) in xb.iter().zip(&qb[2..]) {
            assert_eq!(b as i8, (v / d).round() as i8);
        }
    }
}

#[test]
fn quantised_rows_dot_like_floats() {
    // End to end: quantised weights · quantised activations ≈ float dot product.
    let mut rng = StdRng::seed_from_u64(11);
    let w = gaussian(&mut rng, 4096);
    let a = gaussian(&mut rng, 4096);
    let exact: f64 = w.iter().zip(&a).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = (w.iter().map(|v| (*v as f64).powi(2)).sum::<f64>()
        * a.iter().map(|v| (*v as f64).powi(2)).sum::<f64>())
    .sqrt();
    let xk = quant::quantize_q8_k_vec(&a);
    let x8 = quant::quantize_q8_0_vec(&a);
    let q = quant::quantize_weights(GgmlType::Q4_K, &w).unwrap();
    let got = quant::dot_q4_k_q8_k(&q, &xk) as f64;
    assert!((got - exact).abs() < 0.1 * norm, "q4_k: {got} vs {exact}");
    let q = quant::quantize_weights(GgmlType::Q8_0, &w).unwrap();
    let got = quant::dot_q8_0_q8_0(&q, &x8) as f64;
    assert!((got - exact).abs() < 0.01 * norm, "q8_0: {got} vs {exact}");
}

#[test]
fn partial_blocks_are_errors() {
    assert!(quant::quantize_weights(GgmlType::Q2_K, &[0.0; 100]).is_err());
    assert!(quant::quantize_weights(GgmlType::Q4_0, &[0.0; 32]).is_err());
}
