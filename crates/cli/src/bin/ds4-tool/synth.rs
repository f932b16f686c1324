use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::ValueEnum;
use ds4_cli::paths::{PathFlag, Want};
use ds4_engine::dev::config::Config;
use ds4_engine::dev::layout::ExpertQuant;
use ds4_synth::{flash_config, Plan, Vocab};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Clone, Copy, ValueEnum)]
enum Dims {
    /// The tiny test width (n_embd 256, 4 heads × 160, 8 experts, vocab 512).
    Tiny,
    /// The real DeepSeek V4 Flash shapes.
    Full,
}

#[derive(Clone, Copy, ValueEnum)]
enum Experts {
    /// gate/up IQ2_XXS, down Q2_K (the published q2 file).
    Q2,
    /// gate/up/down Q4_K (the published q4 file).
    Q4,
    /// Plain F32 experts (tests).
    F32,
}

#[derive(clap::Args)]
pub struct Args {
    /// Output GGUF path (required unless --dry-run or --mtp-out: a default once wrote
    /// 86.7 GB unasked).
    #[arg(short, long, required_unless_present_any = ["dry_run", "mtp_out"])]
    out: Option<PathBuf>,
    /// Also write the matching MTP GGUF (the `mtp.0.*` draft block, as the shipped
    /// `…MTP-Q4K-Q8_0-F32.gguf`) here; with --dry-run, print its plan instead.
    #[arg(long)]
    mtp_out: Option<PathBuf>,
    /// Quantisation of the MTP block's routed experts (the shipped file uses q4).
    #[arg(long, value_enum, default_value = "q4")]
    mtp_experts: Experts,
    /// Number of layers (the real model has 43).
    #[arg(long, default_value_t = 43)]
    layers: usize,
    /// Tensor sizes: the published model or the tiny test width.
    #[arg(long, value_enum, default_value = "full")]
    dims: Dims,
    /// Quantisation of the routed experts.
    #[arg(long, value_enum, default_value = "q2")]
    experts: Experts,
    /// Embed this tokenizer (HF tokenizer.json) as tokenizer.ggml.*, as the published
    /// files do; default: a built-in byte-level vocabulary of the model's size.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Seed of the random weights (the same seed writes the same file).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the tensor table and totals without writing anything.
    #[arg(long)]
    dry_run: bool,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
}

impl Args {
    /// The path flags checked before anything is generated (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        let mut v = Vec::new();
        if let Some(t) = &self.tokenizer {
            v.push(PathFlag::new("tokenizer", t, Want::File));
        }
        if let Some(o) = self.out.as_ref().filter(|_| !self.dry_run) {
            v.push(PathFlag::new("out", o, Want::OutFile));
        }
        if let Some(o) = self.mtp_out.as_ref().filter(|_| !self.dry_run) {
            v.push(PathFlag::new("mtp-out", o, Want::OutFile));
        }
        v
    }
}

pub fn run(a: Args) -> Result<()> {
    anyhow::ensure!(a.layers >= 1, "--layers must be at least 1");
    let config = match a.dims {
        Dims::Tiny => Config::tiny(a.layers),
        Dims::Full => flash_config(a.layers),
    };
    let quant = |e: Experts| match e {
        Experts::Q2 => ExpertQuant::Q2,
        Experts::Q4 => ExpertQuant::Q4,
        Experts::F32 => ExpertQuant::F32,
    };
    let experts = quant(a.experts);
    let vocab = match &a.tokenizer {
        Some(p) => Vocab::from_tokenizer_json(
            &std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?,
        )?,
        None => Vocab::builtin(config.vocab)?,
    };
    let desc = format!(
        "Synthetic random weights in the DS4 GGUF layout (seed {}); not a trained model",
        a.seed
    );
    let mtp = match &a.mtp_out {
        Some(_) => Some(Plan::mtp(config.clone(), quant(a.mtp_experts), &desc)?),
        None => None,
    };
    let plan = Plan::new(config, experts, &vocab, &desc)?;
    if let Some(t) = a.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .ok();
    }
    // The main file is printed (and written) only when asked for, or with nothing else.
    let mut writes: Vec<(&Plan, &std::path::Path)> = Vec::new();
    if a.out.is_some() || mtp.is_none() {
        print_plan(&plan, a.dry_run);
        writes.extend(a.out.as_deref().map(|o| (&plan, o)));
    }
    if let (Some(mtp), Some(out)) = (&mtp, &a.mtp_out) {
        println!("MTP file:");
        print_plan(mtp, a.dry_run);
        writes.push((mtp, out));
    }
    if a.dry_run || writes.is_empty() {
        return Ok(());
    }
    // Ctrl+C: the half-written temporary files are removed (nothing resumes from them).
    let temps: Vec<_> = writes.iter().map(|(_, o)| Plan::temp_path(o)).collect();
    ctrlc::set_handler(move || {
        for t in &temps {
            if std::fs::remove_file(t).is_ok() {
                eprintln!("\nds4-tool synth: interrupted; removed {}", t.display());
            }
        }
        std::process::exit(130);
    })?;
    for (plan, out) in writes {
        write_plan(plan, out, a.seed)?;
    }
    Ok(())
}

/// The totals line; with `table`, the tensor table and per-type totals before it.
fn print_plan(plan: &Plan, table: bool) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if table {
        println!(
            "{:<44} {:<8} {:>22} {:>14}",
            "name", "type", "dims", "bytes"
        );
        for (s, b) in plan.specs.iter().zip(&plan.layout.tensor_sizes) {
            println!(
                "{:<44} {:<8} {:>22} {:>14}",
                s.name,
                s.published.name(),
                format!("{:?}", s.dims),
                b
            );
        }
        println!();
        for (ty, n, b) in plan.bytes_per_type() {
            println!("{:<8} {n:>6} tensors {b:>16} bytes", ty.name());
        }
    }
    println!(
        "{} tensors, {} bytes of tensor data ({:.2} GiB), file size {} bytes",
        plan.specs.len(),
        plan.tensor_bytes(),
        gib(plan.tensor_bytes()),
        plan.layout.file_size
    );
}

fn write_plan(plan: &Plan, out: &std::path::Path, seed: u64) -> Result<()> {
    // #19 item 4: refuse before writing rather than filling the disk halfway.
    ds4_cli::disk::ensure_free_space(out, plan.layout.file_size)?;
    let bar = ProgressBar::new(plan.layout.file_size);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("writing {}", out.display()));
    let done = AtomicU64::new(0);
    let start = Instant::now();
    plan.write(out, seed, &|n| {
        let d = done.fetch_add(n, Ordering::Relaxed) + n;
        bar.set_position(d);
    })?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "wrote {} in {secs:.1} s ({:.0} MB/s)",
        out.display(),
        plan.layout.file_size as f64 / secs / 1e6
    );
    Ok(())
}
