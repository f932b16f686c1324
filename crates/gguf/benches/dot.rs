//! Dot-product throughput in weight bytes per second, one core, 4096-wide rows.
//!
//! Row sets: `l2` (1 MiB of weights, stays in L2), `2048rows` (2048 rows: 2–32 MiB,
//! larger than L2) and `dram` (512 MiB, larger than the 480 MiB L3 of the reference
//! machine: the decode case, where every weight byte comes from DRAM). Each kernel level
//! this CPU supports is measured on the first two; the dispatched (best) level on
//! `dram`. `multi4` is one weight row against 4 activation rows (prefill / batched
//! decode); its bytes count the weights once.
//!
//! `cargo bench -p ds4-gguf --bench dot` (add `-- l2` etc. to filter).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ds4_gguf::quant::{self, BlockQ8K, BlockQ8_0, DotKernels};
use ds4_gguf::GgmlType;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

const N: usize = 4096;
const TYPES: [GgmlType; 6] = [
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q4_K,
    GgmlType::IQ2_XXS,
    GgmlType::F16,
    GgmlType::F32,
];

/// Random weights with sane f16 scales (a NaN scale would make timing meaningless).
fn weights(ty: GgmlType, rows: usize, rng: &mut StdRng) -> Vec<u8> {
    let rb = ty.row_bytes(N).unwrap();
    let mut w = vec![0u8; rows * rb];
    rng.fill_bytes(&mut w);
    match ty {
        GgmlType::F16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&quant::f32_to_f16(rng.random_range(-1.0..1.0)).to_le_bytes());
            }
        }
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.random_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        _ => {
            let at: &[usize] = match ty {
                GgmlType::Q2_K => &[80, 82],
                GgmlType::Q4_K => &[0, 2],
                _ => &[0],
            };
            for b in w.chunks_exact_mut(ty.block_bytes()) {
                for &a in at {
                    b[a..a + 2].copy_from_slice(&quant::f32_to_f16(0.01).to_le_bytes());
                }
            }
        }
    }
    w
}

struct Acts {
    f: Vec<f32>,
    q8_0: Vec<BlockQ8_0>,
    q8_k: Vec<BlockQ8K>,
}

fn acts(rng: &mut StdRng) -> Acts {
    let f: Vec<f32> = (0..N).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Acts {
        q8_0: quant::quantize_q8_0_vec(&f),
        q8_k: quant::quantize_q8_k_vec(&f),
        f,
    }
}

/// Σ over all rows of the row dot, with kernels `k`.
fn run_rows(k: &DotKernels, ty: GgmlType, w: &[u8], a: &Acts) -> f32 {
    let rb = ty.row_bytes(N).unwrap();
    let mut s = 0.0;
    for row in w.chunks_exact(rb) {
        s += match ty {
            GgmlType::Q8_0 => (k.q8_0)(row, &a.q8_0),
            GgmlType::Q2_K => (k.q2_k)(row, &a.q8_k),
            GgmlType::Q4_K => (k.q4_k)(row, &a.q8_k),
            GgmlType::IQ2_XXS => (k.iq2_xxs)(row, &a.q8_k),
            GgmlType::F16 => (k.f16_f32)(row, &a.f),
            _ => (k.f32_f32)(row, &a.f),
        };
    }
    s
}

fn run_multi4(k: &DotKernels, ty: GgmlType, w: &[u8], a: &[Acts]) -> f32 {
    let rb = ty.row_bytes(N).unwrap();
    let x8: Vec<&[BlockQ8_0]> = a.iter().map(|a| a.q8_0.as_slice()).collect();
    let xk: Vec<&[BlockQ8K]> = a.iter().map(|a| a.q8_k.as_slice()).collect();
    let mut out = [0.0f32; 4];
    let mut s = 0.0;
    for row in w.chunks_exact(rb) {
        match ty {
            GgmlType::Q8_0 => (k.q8_0_multi)(row, &x8, &mut out),
            GgmlType::Q2_K => (k.q2_k_multi)(row, &xk, &mut out),
            GgmlType::Q4_K => (k.q4_k_multi)(row, &xk, &mut out),
            _ => (k.iq2_xxs_multi)(row, &xk, &mut out),
        }
        s += out[3];
    }
    s
}

fn bench(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    let a = acts(&mut rng);
    let a4: Vec<Acts> = (0..4).map(|_| acts(&mut rng)).collect();
    let best = DotKernels::best();
    for ty in TYPES {
        let rb = ty.row_bytes(N).unwrap();
        let sets = [
            ("l2", (1 << 20) / rb),
            ("2048rows", 2048),
            ("dram", (512 << 20) / rb),
        ];
        let mut g = c.benchmark_group(format!("dot/{ty}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1500));
        for (set, rows) in sets {
            let w = weights(ty, rows, &mut rng);
            g.throughput(Throughput::Bytes(w.len() as u64));
            let levels: Vec<&DotKernels> = if set == "dram" {
                vec![best]
            } else {
                DotKernels::available()
            };
            for k in levels {
                let id = BenchmarkId::new(format!("{:?}", k.level), set);
                g.bench_function(id, |b| b.iter(|| run_rows(k, ty, black_box(&w), &a)));
            }
            let quantised = !matches!(ty, GgmlType::F16 | GgmlType::F32);
            if quantised && set != "l2" {
                let id = BenchmarkId::new(format!("{:?}-multi4", best.level), set);
                g.bench_function(id, |b| b.iter(|| run_multi4(best, ty, black_box(&w), &a4)));
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
