//! `steer build`: a directional-steering file (docs/architecture.md §8 item 17) from
//! paired prompt files, as the reference's `dir-steering/tools/build_direction.py`
//! builds one: each prompt (one per non-empty line, `#` lines skipped; the first
//! min(good, bad) of each file) is rendered as a minimal chat — BOS, system, user
//! prompt, assistant, `</think>` (`<think>` with --think) — and run once on the CPU
//! backend; the last token's `ffn_out` (or `attn_out`) row of every layer is kept. Per
//! layer the direction is mean(good) − mean(bad), normalized, then made orthogonal to
//! the normalized bad mean (unless --no-orthogonalize) and normalized again. Writes the
//! flat f32 file `ds4 --dir-steering-file` reads and a JSON sidecar (`OUT.json`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ds4_cli::paths::{PathFlag, Want};
use ds4_engine::dev::steer::{write_dirs, DirectionBuilder, LayerStat};
use ds4_engine::dev::{CpuBackend, LoadOptions, Model};
use ds4_engine::{Component, Numerics};
use ds4_tokenizer::markers::{ASSISTANT, BOS, THINK_END, THINK_START, USER};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand)]
enum Cmd {
    /// Build a direction file from good (target) and bad (control) prompt files.
    Build(BuildArgs),
}

#[derive(clap::Args)]
pub struct BuildArgs {
    /// Target prompts, one per line (the behaviour the direction represents).
    #[arg(long, value_name = "FILE")]
    good: PathBuf,
    /// Control prompts, one per line.
    #[arg(long, value_name = "FILE")]
    bad: PathBuf,
    /// The activation to record: the FFN output or the attention output.
    #[arg(long, default_value = "ffn_out", value_parser = ["ffn_out", "attn_out"])]
    component: String,
    /// Output direction file (flat f32, n_layer × n_embd); the sidecar is OUT.json.
    #[arg(short = 'o', long, value_name = "OUT.f32")]
    out: PathBuf,
    /// The GGUF model.
    #[arg(short = 'm', long, default_value = "ds4flash.gguf")]
    model: PathBuf,
    /// Context size of each capture run (a prompt must be shorter).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// System prompt of the rendered chat ("" sends none).
    #[arg(long, default_value = "You are a helpful assistant.")]
    system: String,
    /// Capture after `<think>` (default: `</think>`, direct answers).
    #[arg(long)]
    think: bool,
    /// Keep the component parallel to the control mean.
    #[arg(long)]
    no_orthogonalize: bool,
    /// Exact f32 numerics instead of ds4's quantised activations.
    #[arg(long)]
    quality: bool,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
}

impl Args {
    /// The path flags checked before the model loads (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        let Cmd::Build(b) = &self.cmd;
        vec![
            PathFlag::new("good", &b.good, Want::File),
            PathFlag::new("bad", &b.bad, Want::File),
            PathFlag::new("out", &b.out, Want::OutFile),
            PathFlag::new("model", &b.model, Want::Model),
        ]
    }
}

/// One prompt per non-empty line, `#` comment lines skipped (the reference's reader).
pub fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let prompts: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    if prompts.is_empty() {
        bail!("{}: no prompts found", path.display());
    }
    Ok(prompts)
}

/// The reference's minimal chat prefix for activation capture.
pub fn render(system: &str, user: &str, think: bool) -> String {
    let tag = if think { THINK_START } else { THINK_END };
    format!("{BOS}{system}{USER}{user}{ASSISTANT}{tag}")
}

pub fn run(a: Args) -> Result<()> {
    let Cmd::Build(b) = a.cmd;
    build(b)
}

fn build(a: BuildArgs) -> Result<()> {
    let component: Component = a.component.parse().map_err(anyhow::Error::msg)?;
    let good = read_prompts(&a.good)?;
    let bad = read_prompts(&a.bad)?;
    let pairs = good.len().min(bad.len());
    if let Some(n) = a.threads {
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }
    let numerics = if a.quality {
        Numerics::Exact
    } else {
        Numerics::Fast
    };
    let model = Model::load(&a.model, LoadOptions { numerics })
        .with_context(|| format!("cannot load {}", a.model.display()))?;
    let tok = model.tokenizer()?;
    let c = model.config().clone();
    let mut builder = DirectionBuilder::new(c.n_layer, c.n_embd);
    let t0 = std::time::Instant::now();
    for i in 0..pairs {
        for (is_good, prompt) in [(true, &good[i]), (false, &bad[i])] {
            let ids = tok.encode(&render(&a.system, prompt, a.think));
            if ids.len() >= a.ctx {
                bail!(
                    "prompt {} of {} is {} tokens, --ctx {} needs fewer",
                    i + 1,
                    if is_good { "--good" } else { "--bad" },
                    ids.len(),
                    a.ctx
                );
            }
            let (_, act) = CpuBackend::new(&model, a.ctx, numerics).forward_tap(&ids, component)?;
            let (n, e) = (ids.len(), c.n_embd);
            let rows: Vec<f32> = (0..c.n_layer)
                .flat_map(|il| act[(il * n + n - 1) * e..(il * n + n) * e].to_vec())
                .collect();
            builder.add(is_good, &rows);
        }
        eprintln!(
            "pair {}/{pairs} ({:.1} s)",
            i + 1,
            t0.elapsed().as_secs_f64()
        );
    }
    let (dirs, stats) = builder.finish(!a.no_orthogonalize)?;
    write_dirs(&a.out, &dirs).with_context(|| format!("cannot write {}", a.out.display()))?;
    let side = sidecar_path(&a.out);
    let meta = sidecar(&a, component, (good.len(), bad.len(), pairs), &c, &stats);
    std::fs::write(&side, serde_json::to_string_pretty(&meta)? + "\n")
        .with_context(|| format!("cannot write {}", side.display()))?;
    eprintln!(
        "wrote {} ({} × {} f32)",
        a.out.display(),
        c.n_layer,
        c.n_embd
    );
    eprintln!("wrote {}", side.display());
    Ok(())
}

/// `OUT.f32` → `OUT.f32.json`.
pub fn sidecar_path(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// The reference's `ds4-directional-steering-v1` metadata, plus what was counted and
/// the per-layer norms.
fn sidecar(
    a: &BuildArgs,
    component: Component,
    (good, bad, pairs): (usize, usize, usize),
    c: &ds4_engine::Config,
    stats: &[LayerStat],
) -> serde_json::Value {
    let layers: Vec<serde_json::Value> = stats
        .iter()
        .enumerate()
        .map(|(il, s)| {
            serde_json::json!({
                "layer": il,
                "diff_norm": s.diff_norm,
                "good_mean_norm": s.good_norm,
                "bad_mean_norm": s.bad_norm,
                "cos_diff_bad_mean": s.cos_bad,
            })
        })
        .collect();
    serde_json::json!({
        "format": "ds4-directional-steering-v1",
        "shape": [c.n_layer, c.n_embd],
        "component": component.name(),
        "thinking": a.think,
        "pair_normalize": false,
        "orthogonalize_control_mean": !a.no_orthogonalize,
        "good_file": a.good.display().to_string(),
        "bad_file": a.bad.display().to_string(),
        "model": a.model.display().to_string(),
        "system": a.system,
        "numerics": if a.quality { "exact" } else { "fast" },
        "counts": { "good_prompts": good, "bad_prompts": bad, "pairs_used": pairs },
        "position": "last prompt token",
        "layers": layers,
        "date": ds4_cli::clock::utc_now(),
        "note": "runtime positive scale suppresses this direction; negative scale amplifies it",
    })
}
