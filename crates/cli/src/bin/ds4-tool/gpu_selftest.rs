//! `ds4-tool gpu-selftest`: the kernel checks of `ds4_cuda::selftest`, the tiny
//! fixtures on the GPU (`ds4_engine::dev::fixture`: with the MTP draft block on a
//! synthetic MTP file), and the kernel timings.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Result};
use ds4_cli::paths::{PathFlag, Want};
use ds4_cuda::selftest::{self, summary_line, Check, Timing};
use ds4_cuda::{DecodePlan, Gpu, Launcher};
use ds4_engine::dev::fixture as dev_fixture;

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
    /// GPU against the official logits, and each decode-graph variant off and on
    /// (empty string: skip).
    #[arg(long, default_value = "fixtures/tiny")]
    fixtures: String,
    /// Only the batched (prefill) GEMM checks (int8, f32, fp16 and the fp16 expert GEMM)
    /// and, with --bench, their timings.
    #[arg(long)]
    only_matmul: bool,
    /// Only the kernel check group of this name (e.g. exp_f16, f16_gemm, matmul; an
    /// unknown name lists them), without the fixtures.
    #[arg(long, value_name = "NAME")]
    group: Option<String>,
    /// Only the read-bandwidth probe, the Q8_0 decode matvec at every split, the
    /// expert matvecs and the prefill attention kernels.
    #[arg(long)]
    probe_q8: bool,
    /// Only the timings of the Q8_0 products at 1 to 4 tokens (a decode token and the
    /// rows of a multi-row step) at the Flash shapes.
    #[arg(long)]
    bench_tokens: bool,
}

impl Args {
    /// The path flags checked before the GPU opens (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        if self.fixtures.is_empty() {
            return Vec::new();
        }
        vec![PathFlag::new(
            "fixtures",
            Path::new(&self.fixtures),
            Want::Dir,
        )]
    }
}

pub fn run(a: Args) -> Result<()> {
    let gpu = match Gpu::open(a.device) {
        Ok(g) => Arc::new(g),
        Err(e) => bail!("no usable GPU: {e}"),
    };
    // The kernel checks launch under DS4_CUDA_FUSE's plan (the defaults when unset);
    // each variant check turns its variant off and on itself.
    let l = &gpu.launcher(DecodePlan::from_env()?);
    println!("{}", selftest::device_line(&gpu, a.device));
    let seed = a.seed.unwrap_or_else(selftest::fresh_seed);
    println!("seed {seed}");
    if a.probe_q8 {
        print_timings("kernel", 56, &selftest::probe_q8_splits(l, seed)?);
        for (name, ms) in selftest::bench_attention(l, seed)? {
            println!("{name:<56} {:>12} {:>10.1}", "", ms * 1e3);
        }
        return Ok(());
    }
    if a.bench_tokens {
        print_timings("kernel", 56, &selftest::bench_tokens(l, seed)?);
        return Ok(());
    }
    if a.only_matmul {
        return run_matmul(l, seed, a.bench);
    }
    if let Some(name) = &a.group {
        let checks = selftest::run_group(l, seed, name)?;
        let failed = print_checks(&checks);
        println!("\n{}", summary_line(checks.len() - failed, failed));
        if failed > 0 {
            bail!("{failed} GPU checks failed");
        }
        return Ok(());
    }
    let checks = selftest::run_all(l, seed, &mut |l| println!("{l}"))?;
    let mut total = checks.len();
    let mut failed = checks.iter().filter(|c| !c.passed()).count();
    if !a.fixtures.is_empty() {
        let dir = std::path::Path::new(&a.fixtures);
        let mut print = |l: &str| println!("{l}");
        for t in [
            dev_fixture::run_fixtures(&gpu, dir, &mut print)?,
            dev_fixture::check_graph_variants(&gpu, dir, &mut print)?,
            dev_fixture::check_mtp(&gpu, dir, &mtp_image, &mut print)?,
            dev_fixture::check_imatrix(&gpu, dir, &mut print)?,
            dev_fixture::check_steering(&gpu, dir, &mut print)?,
            dev_fixture::check_offload(&gpu, dir, &mut print)?,
            dev_fixture::check_split(&gpu, dir, &mut print)?,
            dev_fixture::check_batch(&gpu, dir, &mut print)?,
            dev_fixture::check_sampling(&gpu, &mut print)?,
        ] {
            total += t.checks;
            failed += t.failed;
        }
    }
    if a.bench {
        print_timings("decode kernel", 40, &selftest::bench_kernels(l, seed)?);
    }
    println!("\n{}", summary_line(total - failed, failed));
    if failed > 0 {
        bail!("{failed} GPU checks failed");
    }
    Ok(())
}

/// A synthetic MTP file (Q4 experts, as the published one) for a fixture model: the
/// MTP check's block.
fn mtp_image(config: &ds4_engine::dev::Config) -> Result<Vec<u8>> {
    let plan = ds4_synth::Plan::mtp(
        config.clone(),
        ds4_engine::dev::layout::ExpertQuant::Q4,
        "gpu-selftest MTP block",
    )?;
    Ok(plan.build(20, &|_| {}))
}

/// A table of timings under a header whose first column is `title`.
fn print_timings(title: &str, width: usize, rows: &[Timing]) {
    println!(
        "\n{title:<width$} {:>12} {:>10} {:>10}",
        "bytes", "us", "GB/s"
    );
    for t in rows {
        print_timing(t, width);
    }
}

/// A timing line: name padded to `width`, bytes, µs, GB/s.
fn print_timing(t: &Timing, width: usize) {
    println!(
        "{:<width$} {:>12.0} {:>10.1} {:>10.0}",
        t.name,
        t.bytes,
        t.ms * 1e3,
        t.gbps()
    );
}

fn print_checks(checks: &[Check]) -> usize {
    for c in checks {
        println!("{}", c.line(60));
    }
    checks.iter().filter(|c| !c.passed()).count()
}

/// `--only-matmul`: the prefill GEMM checks and bench alone.
fn run_matmul(gpu: &Launcher, seed: u64, bench: bool) -> Result<()> {
    let checks = selftest::check_matmul(gpu, seed)?;
    let failed = print_checks(&checks);
    if bench {
        println!(
            "\n{:<64} {:>12} {:>10} {:>10}",
            "prefill kernel (rate per op count)", "bytes", "us", "GB/s"
        );
        for t in selftest::bench_matmul(gpu, seed)? {
            print_timing(&t, 64);
        }
    }
    println!("\n{}", summary_line(checks.len() - failed, failed));
    if failed > 0 {
        bail!("{failed} GPU checks failed");
    }
    Ok(())
}
