use anyhow::{bail, Result};
use ds4_cli::gpu_selftest::{bench_kernels, check_kernels};
use ds4_cuda::Gpu;

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
}

pub fn run(a: Args) -> Result<()> {
    let gpu = match Gpu::open(a.device) {
        Ok(g) => g,
        Err(e) => bail!("no usable GPU: {e}"),
    };
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
    let checks = check_kernels(&gpu, seed)?;
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
    if a.bench {
        println!(
            "\n{:<40} {:>12} {:>10} {:>10}",
            "decode kernel", "bytes", "us", "GB/s"
        );
        for t in bench_kernels(&gpu, seed)? {
            println!(
                "{:<40} {:>12.0} {:>10.1} {:>10.0}",
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
