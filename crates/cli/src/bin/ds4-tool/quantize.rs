//! `ds4-tool quantize`: a DS4 GGUF from the official Hugging Face checkpoint (#24
//! part 2). The work is in the `ds4-convert` crate; this is flags, checks and progress.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use ds4_cli::paths::{PathFlag, Want};
use ds4_convert::hf::Checkpoint;
use ds4_convert::imatrix::Imatrix;
use ds4_convert::{Mix, Options, Plan};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Clone, Copy, ValueEnum)]
enum MixArg {
    /// The published 81 GB recipe: routed gate/up IQ2_XXS, down Q2_K.
    Q2,
    /// The published 153 GB recipe: routed experts Q4_K.
    Q4,
    /// Every float tensor F32 (the unquantised model, for checks).
    Plain,
}

#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory (model.safetensors.index.json + shards, config.json or
    /// inference/config.json, tokenizer.json).
    #[arg(long)]
    hf: PathBuf,
    /// Output GGUF (written as OUT.partial, renamed at the end; required unless
    /// --dry-run or --compare-tensor).
    #[arg(short, long, required_unless_present_any = ["dry_run", "compare_tensor"])]
    out: Option<PathBuf>,
    /// The tensor-type recipe.
    #[arg(long, value_enum, default_value = "q2")]
    mix: MixArg,
    /// Importance matrix for the routed experts (legacy llama.cpp .dat, as written by
    /// `ds4 --imatrix-out`).
    #[arg(long)]
    imatrix: Option<PathBuf>,
    /// Copy the metadata and tokenizer keys from this GGUF (e.g. a published file)
    /// instead of building them from config.json and tokenizer.json.
    #[arg(long)]
    template: Option<PathBuf>,
    /// Print every tensor's name, type, dims and bytes and the file size; read no data.
    #[arg(long)]
    dry_run: bool,
    /// Print the error of this tensor of --gguf (default: --out) against the checkpoint.
    #[arg(long, value_name = "NAME")]
    compare_tensor: Option<String>,
    /// The GGUF that --compare-tensor reads (default: --out).
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
}

impl Args {
    /// The path flags checked before any work (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        let mut v = vec![PathFlag::new("hf", &self.hf, Want::Dir)];
        if let Some(p) = &self.imatrix {
            v.push(PathFlag::new("imatrix", p, Want::File));
        }
        if let Some(p) = &self.template {
            v.push(PathFlag::new("template", p, Want::Model));
        }
        if let Some(p) = &self.gguf {
            v.push(PathFlag::new("gguf", p, Want::Model));
        }
        if let Some(o) = self.out.as_ref() {
            let reading = self.compare_tensor.is_some() && self.gguf.is_none();
            if reading {
                v.push(PathFlag::new("out", o, Want::Model));
            } else if !self.dry_run {
                v.push(PathFlag::new("out", o, Want::OutFile));
            }
        }
        v
    }
}

pub fn run(a: Args) -> Result<()> {
    if let Some(t) = a.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .ok();
    }
    let opts = Options {
        hf: a.hf.clone(),
        mix: match a.mix {
            MixArg::Q2 => Mix::Q2,
            MixArg::Q4 => Mix::Q4,
            MixArg::Plain => Mix::Plain,
        },
        imatrix: a.imatrix.clone(),
        template: a.template.clone(),
    };
    if let Some(name) = &a.compare_tensor {
        let path = a
            .gguf
            .as_ref()
            .or(a.out.as_ref())
            .context("--compare-tensor needs --gguf or --out")?;
        let ck = Checkpoint::open(&a.hf)?;
        let g = ds4_gguf::GgufFile::open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        let st = ds4_convert::compare::compare(&ck, &g, name)?;
        let ty = g.tensor_info(name).map(|t| t.ty.name()).unwrap_or("?");
        println!("{name} ({ty}): {st}");
        return Ok(());
    }
    if a.dry_run {
        let plan = Plan::new(&opts, None)?;
        print!("{}", plan.report());
        return Ok(());
    }
    let Some(out) = &a.out else {
        bail!("--out is required");
    };
    let ck = Checkpoint::open(&a.hf)?;
    let plan = Plan::new(&opts, Some(&ck))?;
    let importance = match &a.imatrix {
        Some(p) => {
            let im = Imatrix::read(p)?;
            eprintln!("imatrix {}: {} entries", p.display(), im.entries.len());
            Some(im.index())
        }
        None => None,
    };
    eprintln!(
        "{} tensors, mix {}, {} bytes → {} (via {})",
        plan.specs.len(),
        opts.mix.name(),
        plan.layout.file_size,
        out.display(),
        ds4_convert::write::partial_paths(out).0.display()
    );
    let bar = ProgressBar::new(plan.layout.file_size);
    bar.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let done = AtomicU64::new(0);
    ds4_convert::write::write(&ck, &plan, importance.as_ref(), out, &|n| {
        bar.set_position(done.fetch_add(n, Ordering::Relaxed) + n);
    })?;
    bar.finish();
    eprintln!("wrote {}", out.display());
    Ok(())
}
