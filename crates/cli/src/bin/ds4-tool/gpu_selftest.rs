use anyhow::{bail, Result};
use ds4_cli::gpu_selftest::{bench_kernels, check_kernels};
use std::sync::Arc;

use ds4_cli::fixture_check::{check_sequence, pooled_agreement, Manifest, VARIANTS};
use ds4_cuda::{DecodePlan, Gpu, Launcher};
use ds4_engine::cuda::{CudaBackend, CudaWeights};
use ds4_engine::{Backend, LoadOptions, LogitRows, Model, Numerics};

#[derive(clap::Args)]
pub struct Args {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Also time the decode kernels at the real model's shapes (GB/s).
    #[arg(long)]
    bench: bool,
    /// Seed of the random inputs (fresh inputs every run by default).
    #[arg(long)]
    seed: Option<u64>,
    /// Tiny fixture folder: run every model variant, sequence and numeric mode on the
    /// GPU against the official logits (empty string: skip).
    #[arg(long, default_value = "fixtures/tiny")]
    fixtures: String,
    /// Only the batched (prefill) GEMM checks and, with --bench, their timings.
    #[arg(long)]
    only_matmul: bool,
    /// Only the read-bandwidth probe, the Q8_0 decode matvec at every split, the
    /// expert matvecs and the prefill attention kernels.
    #[arg(long)]
    probe_q8: bool,
}

pub fn run(a: Args) -> Result<()> {
    let gpu = match Gpu::open(a.device) {
        Ok(g) => Arc::new(g),
        Err(e) => bail!("no usable GPU: {e}"),
    };
    // The kernel checks launch under DS4_CUDA_FUSE's plan (the defaults when unset);
    // each variant check turns its variant off and on itself.
    let l = &gpu.launcher(DecodePlan::from_env()?);
    let i = gpu.info();
    println!(
        "device {}: {} (sm_{}{}, {} SMs, {:.1} GiB, L2 {} MiB), kernels: {:?}",
        a.device,
        i.name,
        i.compute_capability.0,
        i.compute_capability.1,
        i.multiprocessors,
        i.total_mem as f64 / (1u64 << 30) as f64,
        i.l2_bytes >> 20,
        i.kernels
    );
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    println!("seed {seed}");
    if a.probe_q8 {
        println!(
            "\n{:<56} {:>12} {:>10} {:>10}",
            "kernel", "bytes", "us", "GB/s"
        );
        for t in ds4_cli::gpu_selftest::probe_q8_splits(l, seed)? {
            println!(
                "{:<56} {:>12.0} {:>10.1} {:>10.0}",
                t.name,
                t.bytes,
                t.ms * 1e3,
                t.gbps()
            );
        }
        for (name, ms) in ds4_cli::gpu_attention_check::bench_attention(l, seed)? {
            println!("{name:<56} {:>12} {:>10.1}", "", ms * 1e3);
        }
        return Ok(());
    }
    if a.only_matmul {
        return run_matmul(l, seed, a.bench);
    }
    let mut checks = check_kernels(l, seed)?;
    checks.extend(ds4_cli::gpu_attention_check::check_attention_mma(l, seed)?);
    let mut failed = 0;
    for c in &checks {
        let ok = c.passed();
        failed += usize::from(!ok);
        println!(
            "{} {:<44} rel err {:.2e} (bound {:.0e})",
            if ok { "PASS" } else { "FAIL" },
            c.name,
            c.rel_err,
            c.bound
        );
    }
    if !a.fixtures.is_empty() {
        failed += run_fixtures(&gpu, std::path::Path::new(&a.fixtures))?;
    }
    if a.bench {
        println!(
            "\n{:<40} {:>12} {:>10} {:>10}",
            "decode kernel", "bytes", "us", "GB/s"
        );
        for t in bench_kernels(l, seed)? {
            println!(
                "{:<40} {:>12.0} {:>10.1} {:>10.0}",
                t.name,
                t.bytes,
                t.ms * 1e3,
                t.gbps()
            );
        }
    }
    let total = checks.len()
        + if a.fixtures.is_empty() {
            0
        } else {
            24 + 18 + 18
        };
    println!("\n{} passed, {} failed", total - failed, failed);
    if failed > 0 {
        bail!("{failed} GPU checks failed");
    }
    Ok(())
}

fn print_checks(checks: &[ds4_cli::gpu_selftest::Check]) -> usize {
    let mut failed = 0;
    for c in checks {
        let ok = c.passed();
        failed += usize::from(!ok);
        println!(
            "{} {:<60} rel err {:.2e} (bound {:.0e})",
            if ok { "PASS" } else { "FAIL" },
            c.name,
            c.rel_err,
            c.bound
        );
    }
    failed
}

/// `--only-matmul`: the prefill GEMM checks and bench alone.
fn run_matmul(gpu: &Launcher, seed: u64, bench: bool) -> Result<()> {
    let checks = ds4_cli::gpu_matmul_check::check_matmul(gpu, seed)?;
    let failed = print_checks(&checks);
    if bench {
        println!(
            "\n{:<64} {:>12} {:>10} {:>10}",
            "prefill kernel (rate per op count)", "bytes", "us", "GB/s"
        );
        for t in ds4_cli::gpu_matmul_check::bench_matmul(gpu, seed)? {
            println!(
                "{:<64} {:>12.0} {:>10.1} {:>10.0}",
                t.name,
                t.bytes,
                t.ms * 1e3,
                t.gbps()
            );
        }
    }
    println!("\n{} passed, {} failed", checks.len() - failed, failed);
    if failed > 0 {
        bail!("{failed} GPU checks failed");
    }
    Ok(())
}

/// `n` token ids spread over the vocabulary: (i·mul + add) mod vocab.
fn spread_tokens(n: usize, vocab: usize, mul: u64, add: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((i * mul + add) % vocab as u64) as u32)
        .collect()
}

/// Batched prefill against token-by-token decode on one long sequence (every chunk
/// boundary, the raw ring wrapping, compressor windows split across chunks, indexer
/// selections past top-k): per-position max |Δlogit| judged against the noise floor
/// of the CPU backend on the same tokens. Returns the failures.
fn batch_consistency(
    model: &Model,
    weights: &Arc<CudaWeights>,
    variant: &str,
    numerics: Numerics,
) -> Result<usize> {
    let vocab = weights.config.vocab;
    let n = 300;
    let tokens = spread_tokens(n, vocab, 2654435761, 12345);
    let run = |batched: bool, chunk: usize| -> Result<Vec<f32>> {
        let mut b = CudaBackend::new(weights, 4096, numerics)?;
        b.set_batched(batched);
        b.set_prefill_chunk(chunk);
        // Two calls, so a chunk also starts mid-window.
        let mut out = b.forward(&tokens[..101], LogitRows::All)?;
        out.extend(b.forward(&tokens[101..], LogitRows::All)?);
        Ok(out)
    };
    let want = run(false, 1)?;
    // The noise floor of this sequence: the CPU backend (another summation order, same
    // numerics) against the same token-by-token GPU logits.
    let cpu =
        ds4_engine::CpuBackend::new(model, 4096, numerics).forward(&tokens, LogitRows::All)?;
    let floor = DeltaStats::new(&cpu, &want, vocab, f32::INFINITY);
    println!(
        "INFO {variant:<6} cpu   {:<6}          : |Δ| vs token-by-token median {:.1e} p95 {:.1e} max {:.1e}; argmax {}/{n}",
        format!("{numerics:?}"),
        floor.median,
        floor.p95,
        floor.max,
        floor.agree
    );
    let bound = delta_bound(numerics);
    let mut failed = 0;
    for chunk in [7, 64, 512] {
        let got = run(true, chunk)?;
        let d = DeltaStats::new(&got, &want, vocab, bound);
        // The batched path sums in other orders (GEMMs), so a position whose routing or
        // indexer top-k sits on a near-tie may flip its selection and move further, as
        // the CPU backend's positions do; a bug moves every position.
        let ok = got.len() == want.len() && d.within_floor(&floor, numerics, n);
        failed += usize::from(!ok);
        println!(
            "{} {variant:<6} batch {:<6} chunk {chunk:>3}: |Δ| vs token-by-token median {:.1e} p95 {:.1e} max {:.1e}; {}/{n} positions over {bound:.0e} (first {}); argmax {}/{n}",
            if ok { "PASS" } else { "FAIL" },
            format!("{numerics:?}"),
            d.median,
            d.p95,
            d.max,
            d.over,
            d.first_over.map_or("-".to_string(), |p| p.to_string()),
            d.agree,
        );
    }
    Ok(failed)
}

/// The per-position |Δlogit| a position may show between two runs of one numeric mode.
fn delta_bound(numerics: Numerics) -> f32 {
    if numerics == Numerics::Exact {
        1e-4
    } else {
        0.05
    }
}

/// Session snapshots: a CUDA clone continues bit-identically to its source, and a
/// state exported by one backend continues on the other like that backend's own run,
/// within the CPU/GPU noise floor. Returns the failures.
fn snapshot_interchange(
    model: &Model,
    weights: &Arc<CudaWeights>,
    variant: &str,
    numerics: Numerics,
) -> Result<usize> {
    let vocab = weights.config.vocab;
    let (n, split) = (160usize, 97usize);
    let tokens = spread_tokens(n, vocab, 40503, 977);
    let cuda = || CudaBackend::new(weights, 4096, numerics);
    let cpu = || ds4_engine::CpuBackend::new(model, 4096, numerics);
    let gpu_tail = cuda()?.forward(&tokens, LogitRows::All)?[split * vocab..].to_vec();
    let cpu_tail = cpu().forward(&tokens, LogitRows::All)?[split * vocab..].to_vec();
    let m = n - split;
    let floor = DeltaStats::new(&cpu_tail, &gpu_tail, vocab, f32::INFINITY);
    let mut failed = 0;
    let mut report = |what: &str, ok: bool, d: &DeltaStats| {
        failed += usize::from(!ok);
        println!(
            "{} {variant:<6} snap  {:<6} {what:<14}: |Δ| median {:.1e} p95 {:.1e} max {:.1e}; argmax {}/{m} (CPU/GPU floor: median {:.1e}, argmax {}/{m})",
            if ok { "PASS" } else { "FAIL" },
            format!("{numerics:?}"),
            d.median,
            d.p95,
            d.max,
            d.agree,
            floor.median,
            floor.agree,
        );
    };
    // A clone of a CUDA session continues exactly like the original.
    let mut a = cuda()?;
    a.forward(&tokens[..split], LogitRows::Last)?;
    let mut b = a.clone_box();
    let ya = a.forward(&tokens[split..], LogitRows::All)?;
    let yb = b.forward(&tokens[split..], LogitRows::All)?;
    let d = DeltaStats::new(&yb, &ya, vocab, 0.0);
    report("clone", ya.len() == yb.len() && d.max == 0.0, &d);
    // CPU state → CUDA, compared with the CUDA run of the whole sequence.
    let mut c = cpu();
    c.forward(&tokens[..split], LogitRows::Last)?;
    let mut g = cuda()?;
    g.import_state(c.export_state())?;
    let y = g.forward(&tokens[split..], LogitRows::All)?;
    let d = DeltaStats::new(&y, &gpu_tail, vocab, delta_bound(numerics));
    report("cpu -> cuda", d.within_floor(&floor, numerics, m), &d);
    // CUDA state → CPU, compared with the CPU run of the whole sequence.
    let mut g = cuda()?;
    g.forward(&tokens[..split], LogitRows::Last)?;
    let mut c = cpu();
    c.import_state(g.export_state())?;
    let y = c.forward(&tokens[split..], LogitRows::All)?;
    let d = DeltaStats::new(&y, &cpu_tail, vocab, delta_bound(numerics));
    report("cuda -> cpu", d.within_floor(&floor, numerics, m), &d);
    Ok(failed)
}

/// Per-position max |Δlogit| between two runs of the same sequence.
struct DeltaStats {
    median: f32,
    p95: f32,
    max: f32,
    /// Positions over the bound, and the first of them.
    over: usize,
    first_over: Option<usize>,
    /// Positions with the same argmax.
    agree: usize,
}

impl DeltaStats {
    fn new(got: &[f32], want: &[f32], vocab: usize, bound: f32) -> DeltaStats {
        let mut per_pos: Vec<f32> = got
            .chunks_exact(vocab)
            .zip(want.chunks_exact(vocab))
            .map(|(a, b)| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0f32, f32::max)
            })
            .collect();
        let over = per_pos.iter().filter(|&&d| d > bound).count();
        let first_over = per_pos.iter().position(|&d| d > bound);
        let agree = got
            .chunks_exact(vocab)
            .zip(want.chunks_exact(vocab))
            .filter(|(a, b)| ds4_engine::argmax(a) == ds4_engine::argmax(b))
            .count();
        per_pos.sort_by(f32::total_cmp);
        let q = |f: f64| {
            per_pos
                .get(((per_pos.len().max(1) - 1) as f64 * f) as usize)
                .copied()
                .unwrap_or(f32::INFINITY)
        };
        DeltaStats {
            median: q(0.5),
            p95: q(0.95),
            max: q(1.0),
            over,
            first_over,
            agree,
        }
    }

    /// Whether these `n` positions sit at the noise floor of `floor` (another summation
    /// order in the same numerics): typical positions within 4× its median or 1/4 (exact)
    /// or 1/10 (fast) of the per-position bound (a systematic
    /// error moves the median), the tail within the fixture tier (exact: 1e-3) or 4×
    /// the floor's, and argmax disagreements within three standard deviations of a
    /// binomial count at the floor's disagreement rate (at least 1% exact, 2% fast: on
    /// random-token sequences near-tied top logits flip between summation orders).
    fn within_floor(&self, floor: &DeltaStats, numerics: Numerics, n: usize) -> bool {
        let bound = delta_bound(numerics);
        // Typical positions: exact runs sum f32 in other orders (logits of O(10) move
        // by ~1e-5), fast ones also requantise activations.
        let (tail, min_rate, typical) = if numerics == Numerics::Exact {
            (1e-3, 0.01, bound / 4.0)
        } else {
            (bound, 0.02, bound / 10.0)
        };
        let nf = n.max(1) as f64;
        let p = (n.saturating_sub(floor.agree) as f64 / nf).max(min_rate);
        let allowed = (nf * p + 3.0 * (nf * p * (1.0 - p)).sqrt()).floor() as usize;
        self.median <= typical.max(4.0 * floor.median)
            && self.p95 <= tail.max(4.0 * floor.p95)
            && self.agree + allowed >= n
    }
}

/// The tiny fixtures on the CUDA backend; returns the number of failures.
fn run_fixtures(gpu: &Arc<Gpu>, dir: &std::path::Path) -> Result<usize> {
    let manifest = Manifest::load(dir)?;
    let mut failed = 0;
    println!(
        "\n{:<6} {:<4} {:<6} {:>10} {:>10} {:>10} {:>7} {:>5} {:>7}",
        "model", "seq", "mode", "max", "median", "p99", "argmax", "viol", "greedy"
    );
    for (variant, file, set) in VARIANTS {
        let model = Model::load(dir.join(file), LoadOptions::default())?;
        let weights = Arc::new(CudaWeights::upload(gpu, &model, &|_| {})?);
        for numerics in [Numerics::Exact, Numerics::Fast] {
            let mut results = Vec::new();
            for seq in ["a", "b", "c"] {
                let mut backend = CudaBackend::new(&weights, 4096, numerics)?;
                let r = check_sequence(&mut backend, &manifest, dir, variant, set, seq, numerics)?;
                failed += usize::from(!r.passed);
                println!(
                    "{} {:<6} {:<4} {:<6} {:>10.3e} {:>10.3e} {:>10.3e} {:>6.1}% {:>5} {:>7}",
                    if r.passed { "PASS" } else { "FAIL" },
                    r.variant,
                    r.seq,
                    format!("{:?}", r.numerics),
                    r.max,
                    r.median,
                    r.p99,
                    100.0 * r.argmax_agree,
                    r.argmax_violations,
                    if r.greedy_ok { "ok" } else { "DIFF" }
                );
                results.push(r);
            }
            failed += batch_consistency(&model, &weights, variant, numerics)?;
            failed += snapshot_interchange(&model, &weights, variant, numerics)?;
            let (frac, ok) = pooled_agreement(&results);
            failed += usize::from(!ok);
            let n: usize = results.iter().map(|r| r.positions).sum();
            println!(
                "{} {variant:<6} all  {:<6} argmax agreement {:.2}% over {n} positions (tier: >= 95%)",
                if ok { "PASS" } else { "FAIL" },
                format!("{numerics:?}"),
                100.0 * frac
            );
        }
    }
    Ok(failed)
}
