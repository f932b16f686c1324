//! Every SIMD dot kernel this CPU supports equals the scalar reference bit for bit on
//! random blocks and lengths, the `_multi` forms equal the single-row dots, and the
//! dots agree with dequantize-then-f64-dot within a small relative tolerance.

mod common;

use common::random_blocks;
use ds4_gguf::quant::{self, BlockQ8K, BlockQ8_0, DotKernels, SimdLevel};
use ds4_gguf::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Finite f16 bits with a bias towards the awkward ones (zero, subnormal, tiny).
fn f16_bits(rng: &mut StdRng) -> u16 {
    let sign = (rng.random::<u16>() & 1) << 15;
    match rng.random_range(0..8) {
        0 => sign,                                    // ±0
        1 => sign | rng.random_range(1..0x400),       // subnormal
        2 => sign | rng.random_range(0x400..0x7c00),  // any finite normal
        _ => sign | rng.random_range(0x1000..0x3000), // typical weight scales
    }
}

fn weight_row(rng: &mut StdRng, ty: GgmlType, nb: usize) -> Vec<u8> {
    random_blocks(rng, ty, nb, f16_bits)
}

/// One weight row of each quantised type: Q8_0 of `nb_0` blocks, then Q2_K, Q4_K and
/// IQ2_XXS of `nb_k`.
fn weight_rows(rng: &mut StdRng, nb_0: usize, nb_k: usize) -> (Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>) {
    (
        weight_row(rng, GgmlType::Q8_0, nb_0),
        weight_row(rng, GgmlType::Q2_K, nb_k),
        weight_row(rng, GgmlType::Q4_K, nb_k),
        weight_row(rng, GgmlType::IQ2_XXS, nb_k),
    )
}

/// A block scale in ±`max`, over eight decades.
fn scale(rng: &mut StdRng, max: f32) -> f32 {
    rng.random_range(-max..max) * 10f32.powi(rng.random_range(-6..2))
}

fn q8k_row(rng: &mut StdRng, nb: usize, consistent: bool) -> Vec<BlockQ8K> {
    let block = |rng: &mut StdRng| {
        let mut b = BlockQ8K {
            d: scale(rng, 2.0),
            ..Default::default()
        };
        rng.fill(&mut b.qs[..]);
        for (j, s) in b.bsums.iter_mut().enumerate() {
            let sum = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
            *s = if consistent { sum } else { rng.random::<i16>() };
        }
        b
    };
    (0..nb).map(|_| block(rng)).collect()
}

fn q8_0_row(rng: &mut StdRng, nb: usize) -> Vec<BlockQ8_0> {
    let block = |rng: &mut StdRng| {
        let mut b = BlockQ8_0 {
            d: scale(rng, 1.0),
            ..Default::default()
        };
        rng.fill(&mut b.qs[..]);
        b
    };
    (0..nb).map(|_| block(rng)).collect()
}

fn levels() -> Vec<&'static DotKernels> {
    let all = DotKernels::available();
    assert_eq!(all[0].level, SimdLevel::Scalar);
    eprintln!(
        "levels: {:?}",
        all.iter().map(|k| k.level).collect::<Vec<_>>()
    );
    all
}

fn same(level: SimdLevel, what: &str, n: usize, got: f32, want: f32) {
    assert_eq!(
        got.to_bits(),
        want.to_bits(),
        "{level:?} {what} n={n}: {got} vs scalar {want}"
    );
}

#[test]
fn quantised_dots_equal_scalar() {
    let mut rng = StdRng::seed_from_u64(0x05ee_dd07);
    let levels = levels();
    for iter in 0..400 {
        // Lengths cross the 8- and 16-block group boundaries of the kernels.
        let (nb_k, nb_0) = (rng.random_range(0..12), rng.random_range(0..70));
        let consistent = iter % 2 == 0;
        let x8 = q8_0_row(&mut rng, nb_0);
        let xk = q8k_row(&mut rng, nb_k, consistent);
        let (w8, w2, w4, wi) = weight_rows(&mut rng, nb_0, nb_k);
        let r8 = quant::dot_q8_0_q8_0_scalar(&w8, &x8);
        let r2 = quant::dot_q2_k_q8_k_scalar(&w2, &xk);
        let r4 = quant::dot_q4_k_q8_k_scalar(&w4, &xk);
        let ri = quant::dot_iq2_xxs_q8_k_scalar(&wi, &xk);
        for k in &levels {
            same(k.level, "q8_0", nb_0, (k.q8_0)(&w8, &x8), r8);
            same(k.level, "q2_k", nb_k, (k.q2_k)(&w2, &xk), r2);
            same(k.level, "q4_k", nb_k, (k.q4_k)(&w4, &xk), r4);
            same(k.level, "iq2_xxs", nb_k, (k.iq2_xxs)(&wi, &xk), ri);
        }
        assert_eq!(quant::dot_q8_0_q8_0(&w8, &x8).to_bits(), r8.to_bits());
        assert_eq!(quant::dot_iq2_xxs_q8_k(&wi, &xk).to_bits(), ri.to_bits());
    }
}

#[test]
fn multi_row_dots_equal_single_row() {
    let mut rng = StdRng::seed_from_u64(77);
    let levels = levels();
    for _ in 0..60 {
        let rows = rng.random_range(0..7);
        let (nb_k, nb_0) = (rng.random_range(0..6), rng.random_range(0..40));
        let x8: Vec<_> = (0..rows).map(|_| q8_0_row(&mut rng, nb_0)).collect();
        let xk: Vec<_> = (0..rows).map(|_| q8k_row(&mut rng, nb_k, true)).collect();
        let x8r: Vec<&[BlockQ8_0]> = x8.iter().map(|v| v.as_slice()).collect();
        let xkr: Vec<&[BlockQ8K]> = xk.iter().map(|v| v.as_slice()).collect();
        let (w8, w2, w4, wi) = weight_rows(&mut rng, nb_0, nb_k);
        for k in &levels {
            let mut out = vec![f32::NAN; rows];
            (k.q8_0_multi)(&w8, &x8r, &mut out);
            for (r, o) in out.iter().enumerate() {
                same(
                    k.level,
                    "q8_0 multi",
                    nb_0,
                    *o,
                    quant::dot_q8_0_q8_0_scalar(&w8, &x8[r]),
                );
            }
            type KMulti = fn(&[u8], &[&[BlockQ8K]], &mut [f32]);
            type KDot = fn(&[u8], &[BlockQ8K]) -> f32;
            let k_quants: [(&str, KMulti, &[u8], KDot); 3] = [
                ("q2_k multi", k.q2_k_multi, &w2, quant::dot_q2_k_q8_k_scalar),
                ("q4_k multi", k.q4_k_multi, &w4, quant::dot_q4_k_q8_k_scalar),
                (
                    "iq2_xxs multi",
                    k.iq2_xxs_multi,
                    &wi,
                    quant::dot_iq2_xxs_q8_k_scalar,
                ),
            ];
            for (what, multi, w, scalar) in k_quants {
                multi(w, &xkr, &mut out);
                for (r, o) in out.iter().enumerate() {
                    same(k.level, what, nb_k, *o, scalar(w, &xk[r]));
                }
            }
        }
        let mut out = vec![0.0; rows];
        quant::dot_q8_0_q8_0_multi(&w8, &x8r, &mut out);
        quant::dot_iq2_xxs_q8_k_multi(&wi, &xkr, &mut out);
    }
}

#[test]
fn dense_dots_equal_scalar() {
    let mut rng = StdRng::seed_from_u64(1234);
    let levels = levels();
    for _ in 0..500 {
        let n = match rng.random_range(0..4) {
            0 => rng.random_range(0..40),
            1 => 16 * rng.random_range(0..64),
            _ => rng.random_range(0..1200),
        };
        let x: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let a: Vec<f32> = (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let w16: Vec<u8> = (0..n)
            .flat_map(|_| f16_bits(&mut rng).to_le_bytes())
            .collect();
        let w32: Vec<u8> = a.iter().flat_map(|v| v.to_le_bytes()).collect();
        let r16 = quant::dot_f16_f32_scalar(&w16, &x);
        let r32 = quant::dot_f32_f32_scalar(&w32, &x);
        let rf = quant::dot_f32_scalar(&a, &x);
        assert_eq!(r32.to_bits(), rf.to_bits());
        for k in &levels {
            same(k.level, "f16", n, (k.f16_f32)(&w16, &x), r16);
            same(k.level, "f32w", n, (k.f32_f32)(&w32, &x), r32);
            same(k.level, "f32", n, (k.f32)(&a, &x), rf);
        }
    }
}

/// Σ w·x in f64 from dequantised weights and activations, and Σ |w·x|.
fn f64_dot(w: &[f32], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| {
        let p = w as f64 * x as f64;
        (s + p, a + p.abs())
    })
}

#[test]
fn dots_agree_with_dequantized_f64() {
    let mut rng = StdRng::seed_from_u64(99);
    for _ in 0..100 {
        let nb = rng.random_range(1..9);
        let n = nb * 256;
        let xk = q8k_row(&mut rng, nb, true);
        let xkf: Vec<f32> = xk
            .iter()
            .flat_map(|b| b.qs.map(|q| b.d * q as f32))
            .collect();
        let x8 = q8_0_row(&mut rng, n / 32);
        let x8f: Vec<f32> = x8
            .iter()
            .flat_map(|b| b.qs.map(|q| b.d * q as f32))
            .collect();
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q2_K,
            GgmlType::Q4_K,
            GgmlType::IQ2_XXS,
        ] {
            let w = weight_row(&mut rng, ty, n / ty.block_elems());
            let wf = quant::dequantize_to_vec(ty, &w, n).unwrap();
            let (got, xf) = match ty {
                GgmlType::Q8_0 => (quant::dot_q8_0_q8_0(&w, &x8), &x8f),
                GgmlType::Q2_K => (quant::dot_q2_k_q8_k(&w, &xk), &xkf),
                GgmlType::Q4_K => (quant::dot_q4_k_q8_k(&w, &xk), &xkf),
                _ => (quant::dot_iq2_xxs_q8_k(&w, &xk), &xkf),
            };
            let (want, mag) = f64_dot(&wf, xf);
            let err = (got as f64 - want).abs();
            assert!(
                err <= 1e-5 * mag + 1e-30,
                "{ty}: dot {got} vs f64 {want} (Σ|wx| {mag})"
            );
        }
        let xf: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let w16: Vec<u8> = (0..n)
            .flat_map(|_| f16_bits(&mut rng).to_le_bytes())
            .collect();
        let wf = quant::dequantize_to_vec(GgmlType::F16, &w16, n).unwrap();
        let (want, mag) = f64_dot(&wf, &xf);
        let got = quant::dot_f16_f32(&w16, &xf);
        assert!(
            (got as f64 - want).abs() <= 1e-5 * mag + 1e-30,
            "f16: {got} vs {want}"
        );
    }
}
