//! `ds4-bench`: prefill and decode throughput at growing context frontiers.
//!
//! Loads the model once, walks a prompt to each frontier (timing only the newly
//! prefilled tokens), then from a snapshot decodes one untimed and `--gen-tokens` timed
//! greedy non-EOS tokens, restores the snapshot and moves on. Writes the reference's CSV
//! (`ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes`) plus
//! `rows,ms_per_cycle,tokens_per_cycle,effective_tps`: the plain decode is a row of
//! `rows` 1; `--rows R` and an MTP run (`--mtp`, `--synthetic-mtp`) add a row each per
//! frontier, timed from the same snapshot.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use ds4_engine::dev::layout::ExpertQuant;
use ds4_engine::dev::{EngineExt, LoadOptions, Model};
use ds4_engine::{
    BackendChoice, BackendKind, Engine, EngineOptions, Mtp, Numerics, SpecOptions, Speculator,
};
use ds4_gguf::GgufFile;
use ds4_synth::{flash_config, Plan, Vocab};
use indicatif::{ProgressBar, ProgressStyle};

mod cycles;
#[cfg(feature = "cuda")]
mod fuse_ab;
mod plot;
mod spec_run;

use cycles::{decode_greedy, decode_sampled, time_rows, time_sessions};
use plot::{BenchRow, CSV_HEADER, CSV_HEADER_V1};

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum BackendArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
enum Synthetic {
    Q2,
    Q4,
}

#[derive(Parser)]
#[command(
    name = "ds4-bench",
    version,
    about = "Prefill and decode tokens/s of ds4 at context frontiers (CSV)"
)]
struct Args {
    /// Model file.
    #[arg(short, long, default_value = "ds4flash.gguf")]
    model: PathBuf,
    /// Instead of a file: random weights in the exact full-size layout, built in memory
    /// (no disk needed; the q2 layout needs ≈ 81 GiB of host RAM and GPU memory).
    #[arg(long, value_enum)]
    synthetic_weights: Option<Synthetic>,
    /// Layers of the synthetic model (the real one has 43).
    #[arg(long, default_value_t = 43)]
    layers: usize,
    /// Raw text to tokenize as the prompt (no chat template).
    #[arg(long, conflicts_with = "chat_prompt_file")]
    prompt_file: Option<PathBuf>,
    /// Text sent as one no-think chat turn.
    #[arg(long)]
    chat_prompt_file: Option<PathBuf>,
    /// System prompt of --chat-prompt-file.
    #[arg(
        long = "system",
        short = 's',
        default_value = "You are a helpful assistant."
    )]
    system: String,
    /// Backend (default: cuda when a GPU is usable, else cpu).
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,
    /// CPU threads.
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Keep the routed experts of some layers in pinned host memory, read over the bus:
    /// `auto` (default) offloads as few layers as the GPU needs for the model and one
    /// session of the benchmark's capacity (none when it fits), N the last N layers', 0
    /// never.
    #[arg(
        long,
        value_name = "auto|N",
        default_value = "auto",
        allow_negative_numbers = true
    )]
    offload_experts: ds4_engine::Offload,
    /// Split the layers over these GPUs (e.g. `0,1`), in order; default: one GPU, or
    /// every visible GPU when the model does not fit one (no expert offload then).
    #[arg(long, value_name = "LIST")]
    gpus: Option<ds4_engine::GpuList>,
    /// Put the layers on GPUs by hand: `GPU:LAYERS` per stage, in the order they run,
    /// e.g. `0:0-20,1:21-42` (inclusive ranges, together every layer from 0 to the
    /// model's last once; a GPU at most once). Each stage keeps its last layers' experts
    /// in host memory when its card needs it (--offload-experts). Not with --gpus.
    #[arg(long, value_name = "GPU:LAYERS,...", conflicts_with = "gpus")]
    device_map: Option<ds4_engine::DeviceMap>,

    /// Exact numerics (f32 activations, f32 KV).
    #[arg(long)]
    quality: bool,
    /// The first context frontier measured (tokens).
    #[arg(long, default_value_t = 2048)]
    ctx_start: usize,
    /// The last context frontier measured (tokens).
    #[arg(long, default_value_t = 32768)]
    ctx_max: usize,
    /// Session capacity (default ctx-max + gen-tokens + 1).
    #[arg(long)]
    ctx_alloc: Option<usize>,
    /// Multiply the frontier by this (≥ 1); 1 = add --step-incr.
    #[arg(long, default_value_t = 1.0)]
    step_mul: f64,
    /// Tokens added to the frontier per step when --step-mul is 1.
    #[arg(long, default_value_t = 2048)]
    step_incr: usize,
    /// Greedy tokens timed at each frontier (after one untimed token that carries the
    /// session's one-off decode costs).
    #[arg(
        long = "gen-tokens",
        short = 'n',
        visible_alias = "tokens",
        default_value_t = 128
    )]
    gen_tokens: usize,
    /// Sample the timed decode at this temperature with ds4's default filters (min-p
    /// 0.05, top-p 1), as `ds4` does at its defaults (temperature 1; on CUDA the device
    /// samples), instead of greedy picks (0, the default). A sampled EOS is decoded as
    /// any other token. Not with --mtp or --fuse-ab, which compare against the greedy
    /// tokens.
    #[arg(long, default_value_t = 0.0, conflicts_with_all = ["mtp", "synthetic_mtp", "fuse_ab"])]
    temp: f32,
    /// Also time multi-row steps of this many token rows (2..=16) at each frontier: cycles
    /// of `step_rows` + `commit_rows(R)` emitting at least --gen-tokens tokens, after one
    /// untimed cycle. Row 0 of a cycle is the previous step's greedy pick, the other R − 1
    /// tokens come from a generator seeded with --seed (a verify step whose drafts are all
    /// accepted). One more CSV row per frontier (`rows` = R); 1 = only the plain decode.
    #[arg(long, default_value_t = 1)]
    rows: usize,
    /// Also time batched decoding of this many sessions (2..=16) at each frontier: copies
    /// of the frontier's session each decode one token per step, all rows in one step
    /// (on CUDA one pass over the weights), --gen-tokens steps after one untimed step.
    /// Rows take random tokens (distinct conversations route to distinct experts). One
    /// more CSV row per frontier (`rows` = N, `effective_tps` the aggregate); stderr
    /// also says how far the batched rows' logits are from decoding alone.
    #[arg(long, default_value_t = 1)]
    sessions: usize,
    /// An MTP draft file (`ds4-tool download mtp`): also time speculative decoding at each
    /// frontier. The plain greedy decode runs first and records its tokens; then from the
    /// same snapshot `Speculator::advance` cycles must emit exactly those tokens (checked:
    /// an error under --quality, a warning in Fast numerics, where a multi-row step may
    /// round a near tie differently). One more CSV row per frontier (`rows` = drafts + 1).
    #[arg(long, conflicts_with = "synthetic_mtp")]
    mtp: Option<PathBuf>,
    /// Instead of --mtp: random MTP weights matching the main model (the layout of
    /// `ds4-tool synth --mtp-out`, Q4 experts), built in memory from --seed.
    #[arg(long)]
    synthetic_mtp: bool,
    /// MTP-drafted tokens verified per cycle (1..=15). The target's own next token comes on
    /// top: the reference's `--mtp-draft 2` is our 1.
    #[arg(long, default_value_t = 1)]
    mtp_draft: usize,
    /// The MTP confidence gate (top-1 − top-2 of the raw draft logits below it ends a
    /// cycle's drafting). 0 here (ds4 and ds4-server default to 3), so that every cycle
    /// verifies --mtp-draft drafts and random weights still draft.
    #[arg(long, default_value_t = 0.0)]
    mtp_margin: f32,
    /// Acceptance as a parameter (random weights accept almost nothing): P1[,P2,...],
    /// the probability that draft i of a cycle is replaced by the main model's own next
    /// greedy token (recorded by the plain run), the last value repeating; otherwise it is
    /// replaced by another token, which the verify rejects. Each position's draw is keyed
    /// by --seed and the position, so two binaries draw the same fates. Without it the
    /// MTP's own drafts are verified.
    #[arg(long, value_delimiter = ',')]
    accept_rate: Vec<f64>,
    /// CSV output (default stdout).
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Also draw the CSV as an SVG chart.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Draw --plot from this earlier ds4-bench CSV instead of running a benchmark.
    #[arg(long, requires = "plot")]
    plot_from: Option<PathBuf>,
    /// A/B of decode-graph restructurings in one process (CUDA, weights loaded once):
    /// LABEL=SETTING with SETTING a `DS4_CUDA_FUSE` value (`all`: the defaults, `0`:
    /// none); repeat the option. Each setting gets a fresh session that prefills
    /// --ctx-start tokens and decodes --gen-tokens. CSV columns:
    /// `label,round,ctx_tokens,prefill_tps,gen_tps`. Keep --ctx-max as in the runs
    /// compared (it sizes buffers).
    #[arg(long = "fuse-ab", value_name = "LABEL=SETTING")]
    fuse_ab: Vec<String>,
    /// Rounds of --fuse-ab, the settings interleaved in each.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// CUDA device.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Directional steering file (n_layer × n_embd f32, `ds4-tool steer build`): the
    /// timed runs include its edits.
    #[arg(long)]
    dir_steering_file: Option<PathBuf>,
    /// Steering scale after each FFN output (default 1 with a file).
    #[arg(long, allow_negative_numbers = true)]
    dir_steering_ffn: Option<f32>,
    /// Steering scale after each attention output (default 0).
    #[arg(long, allow_negative_numbers = true)]
    dir_steering_attn: Option<f32>,
    /// The reference's Apple Metal backend: not available in this build (exit 2).
    #[arg(long)]
    metal: bool,
    /// Seed of --synthetic-weights and of the random prompt tokens.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// More log output on stderr: -v info, -vv debug (RUST_LOG, when set, decides).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count)]
    verbose: u8,
}

fn bar(len: u64, msg: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    b.set_message(msg.to_string());
    b
}

fn load_model(a: &Args) -> Result<Model> {
    let gguf = match a.synthetic_weights {
        Some(kind) => {
            let cfg = flash_config(a.layers);
            let experts = if kind == Synthetic::Q2 { ExpertQuant::Q2 } else { ExpertQuant::Q4 };
            let plan = Plan::new(cfg, experts, &Vocab::builtin(129_280)?, "ds4-bench synthetic weights")?;
            let b = bar(plan.layout.file_size, "generating synthetic weights");
            let done = AtomicU64::new(0);
            let t = Instant::now();
            let image = plan.build(a.seed, &|n| b.set_position(done.fetch_add(n, Ordering::Relaxed) + n));
            b.finish_and_clear();
            eprintln!("ds4-bench: {:?} synthetic weights, {} layers, {:.1} GiB in {:.1} s", kind, a.layers, image.len() as f64 / (1u64 << 30) as f64, t.elapsed().as_secs_f64());
            GgufFile::from_bytes(image)?
        }
        None => GgufFile::open(&a.model).with_context(|| {
            format!("cannot open {} (download one with `ds4-tool download q2-imatrix`, or use --synthetic-weights q2)", a.model.display())
        })?,
    };
    let numerics = if a.quality {
        Numerics::Exact
    } else {
        Numerics::Fast
    };
    Ok(Model::from_gguf(Arc::new(gguf), LoadOptions { numerics })?)
}

fn prompt_tokens(a: &Args, model: &Model, need: usize) -> Result<Vec<u32>> {
    let text = match (&a.prompt_file, &a.chat_prompt_file) {
        (Some(p), _) | (None, Some(p)) => Some(
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?,
        ),
        (None, None) => None,
    };
    let mut tokens = match text {
        Some(t) => {
            let tok = model.tokenizer()?;
            if a.chat_prompt_file.is_some() {
                let bos = tok.token_to_id("<｜begin▁of▁sentence｜>").unwrap_or(0);
                let mut ids = vec![bos];
                ids.extend(tok.encode(&a.system));
                ids.extend(tok.encode(&format!("<｜User｜>{t}<｜Assistant｜></think>")));
                ids
            } else {
                tok.encode(&t)
            }
        }
        None => {
            if a.synthetic_weights.is_none() {
                bail!("give --prompt-file or --chat-prompt-file (or use --synthetic-weights, which bench on random tokens)");
            }
            // Random weights: the tokens' meaning is irrelevant; ids of the byte range.
            let mut rng = ds4_synth::Rng::stream(a.seed, 7, 7);
            (0..need).map(|_| 3 + rng.below(256) as u32).collect()
        }
    };
    if tokens.len() < need {
        bail!(
            "the prompt has {} tokens; --ctx-max {} needs at least that many",
            tokens.len(),
            need
        );
    }
    tokens.truncate(need);
    Ok(tokens)
}

/// `--plot-from`: the SVG chart of an existing CSV.
fn plot_csv(csv: &std::path::Path, out: &std::path::Path) -> Result<()> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("cannot read {}", csv.display()))?;
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    if !matches!(
        lines.next().map(str::trim),
        Some(CSV_HEADER | CSV_HEADER_V1)
    ) {
        bail!(
            "{} is not a ds4-bench CSV (header {CSV_HEADER})",
            csv.display()
        );
    }
    let rows = lines
        .enumerate()
        .map(|(i, l)| {
            BenchRow::parse(l)
                .with_context(|| format!("{} line {}: not a ds4-bench row", csv.display(), i + 2))
        })
        .collect::<Result<Vec<_>>>()?;
    if rows.is_empty() {
        bail!("{} has no rows", csv.display());
    }
    let title = format!("ds4-bench ({})", csv.display());
    std::fs::write(out, plot::svg(&rows, &title))
        .with_context(|| format!("cannot write {}", out.display()))
}

/// #19 item 4: flag values and paths are checked before the model loads (or synthetic
/// weights are generated: minutes for the full size); clap-style errors, status 2.
fn check_args(a: &Args) -> Result<(), clap::Error> {
    use clap::error::ErrorKind::ValueValidation;
    use clap::CommandFactory;
    use ds4_cli::paths::{validate, validate_model, PathFlag, Want};
    let mut cmd = Args::command();
    let mut flags = PathFlag::given(&[
        ("plot_from", a.plot_from.as_deref(), Want::File),
        ("plot", a.plot.as_deref(), Want::OutFile),
        (
            "dir_steering_file",
            a.dir_steering_file.as_deref(),
            Want::File,
        ),
    ]);
    if a.plot_from.is_some() {
        // Only the chart is drawn: no model, no run.
        return validate(&mut cmd, &flags);
    }
    if a.metal {
        return Err(cmd.error(
            ValueValidation,
            "--metal: the Metal backend is not available in this build (use --backend cpu or cuda)",
        ));
    }
    let scales = [a.dir_steering_ffn, a.dir_steering_attn];
    if scales.iter().flatten().any(|s| !s.is_finite()) {
        return Err(cmd.error(ValueValidation, "steering scales must be finite"));
    }
    if a.dir_steering_file.is_some() && !a.fuse_ab.is_empty() {
        // --fuse-ab builds its sessions on raw device weights, outside the engine.
        return Err(cmd.error(
            clap::error::ErrorKind::ArgumentConflict,
            "--dir-steering-file does not apply to --fuse-ab",
        ));
    }
    if a.dir_steering_file.is_none() && scales.iter().flatten().any(|&s| s != 0.0) {
        return Err(cmd.error(
            clap::error::ErrorKind::MissingRequiredArgument,
            "--dir-steering-ffn/--dir-steering-attn need --dir-steering-file",
        ));
    }
    if a.step_mul < 1.0 {
        return Err(cmd.error(ValueValidation, "--step-mul must be at least 1"));
    }
    if a.ctx_start == 0 || a.ctx_start > a.ctx_max {
        return Err(cmd.error(ValueValidation, "need 0 < --ctx-start <= --ctx-max"));
    }
    if !(1..=16).contains(&a.rows) {
        return Err(cmd.error(ValueValidation, "--rows must be 1..=16"));
    }
    if !(a.temp.is_finite() && (0.0..=100.0).contains(&a.temp)) {
        return Err(cmd.error(ValueValidation, "--temp must be in 0..=100"));
    }
    if !(1..=16).contains(&a.sessions) {
        return Err(cmd.error(ValueValidation, "--sessions must be 1..=16"));
    }
    let mtp = a.mtp.is_some() || a.synthetic_mtp;
    if !(1..=15).contains(&a.mtp_draft) {
        return Err(cmd.error(ValueValidation, "--mtp-draft must be 1..=15"));
    }
    if !(a.mtp_margin.is_finite() && a.mtp_margin >= 0.0) {
        return Err(cmd.error(ValueValidation, "--mtp-margin must be a finite number >= 0"));
    }
    if a.accept_rate.iter().any(|p| !(0.0..=1.0).contains(p)) {
        return Err(cmd.error(ValueValidation, "--accept-rate values must be in 0..=1"));
    }
    if !a.accept_rate.is_empty() && !mtp {
        return Err(cmd.error(
            ValueValidation,
            "--accept-rate needs --mtp FILE or --synthetic-mtp",
        ));
    }
    let slack = step_slack(a);
    if alloc(a) <= a.ctx_max + a.gen_tokens + slack {
        return Err(cmd.error(
            ValueValidation,
            format!("--ctx-alloc must be greater than ctx-max + gen-tokens + {slack} (the multi-row steps' room)"),
        ));
    }
    flags.extend(PathFlag::given(&[
        ("prompt_file", a.prompt_file.as_deref(), Want::File),
        (
            "chat_prompt_file",
            a.chat_prompt_file.as_deref(),
            Want::File,
        ),
        ("csv", a.csv.as_deref(), Want::OutFile),
        ("mtp", a.mtp.as_deref(), Want::File),
    ]));
    validate(&mut cmd, &flags)?;
    if a.synthetic_weights.is_none() {
        validate_model(&mut cmd, "model", &a.model)?;
    }
    Ok(())
}

/// Tokens past `--gen-tokens` that the multi-row runs may decode: a timed run rounds up
/// to whole cycles, and its untimed warm-up cycle adds one more.
fn step_slack(a: &Args) -> usize {
    let mut widest = if a.rows > 1 { a.rows } else { 0 };
    if a.mtp.is_some() || a.synthetic_mtp {
        widest = widest.max(a.mtp_draft + 1);
    }
    2 * widest
}

/// The session capacity: --ctx-alloc or the frontier, the tokens and the slack.
fn alloc(a: &Args) -> usize {
    a.ctx_alloc
        .unwrap_or(a.ctx_max + a.gen_tokens + 1 + step_slack(a))
}

/// The memory planner's request: --offload-experts for one session of [`alloc`] tokens.
fn memory(a: &Args) -> ds4_engine::MemoryOptions {
    ds4_engine::MemoryOptions {
        offload: a.offload_experts,
        ctx: alloc(a),
        gpus: a.gpus.clone().map(|g| g.0).unwrap_or_default(),
        device_map: a.device_map.clone(),
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    ds4_cli::logging::init(a.verbose);
    check_args(&a).unwrap_or_else(|e| e.exit());
    if let (Some(csv), Some(out)) = (&a.plot_from, &a.plot) {
        return plot_csv(csv, out);
    }
    let alloc = alloc(&a);
    if let Some(t) = a.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .ok();
    }
    // The --fuse-ab settings are checked before the (long) model load.
    let fuse = fuse_ab_specs(&a)?;
    let model = load_model(&a)?;
    if let Some(specs) = fuse {
        return run_fuse_ab(&a, &model, specs, alloc);
    }
    let backend = match a.backend {
        None => BackendChoice::Auto,
        // `-t` already sized rayon's global pool, which the CPU backend uses.
        Some(BackendArg::Cpu) => BackendChoice::Cpu { threads: None },
        Some(BackendArg::Cuda) => BackendChoice::Cuda { device: a.device },
    };
    let b = bar(model.gguf().tensor_bytes(), "uploading weights to the GPU");
    let progress = {
        let b = b.clone();
        Box::new(move |done: u64, _total: u64| b.set_position(done))
    };
    let mut engine = Engine::from_model(
        model.clone(),
        EngineOptions {
            backend,
            numerics: model.numerics(),
            progress: Some(progress),
            memory: memory(&a),
        },
    )
    .context("cannot start the backend (use --backend cpu)")?;
    b.finish_and_clear();
    let file = a.dir_steering_file.as_deref();
    if let Some(s) = engine
        .steer_from_flags(file, a.dir_steering_ffn, a.dir_steering_attn)
        .context("--dir-steering-file")?
    {
        let f = file.map(|f| f.display().to_string()).unwrap_or_default();
        eprintln!(
            "ds4-bench: directional steering: {f} ffn={} attn={}",
            s.ffn, s.attn
        );
    }
    eprintln!(
        "ds4-bench: backend {} ({})",
        engine.backend(),
        engine.backend_reason()
    );
    let mut spec = load_speculator(&a, &engine, &model)?;
    let cycle_base = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut mismatches: Vec<String> = Vec::new();
    let hooks = GpuHooks::of(&engine);
    let mut session = engine.new_session(alloc)?;
    let prompt = prompt_tokens(&a, &model, a.ctx_max)?;
    let eos = eos_token(&model);

    let mut out: Box<dyn Write> = match &a.csv {
        Some(p) => Box::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        ),
        None => Box::new(std::io::stdout()),
    };
    writeln!(out, "{CSV_HEADER}")?;
    let mut rows = Vec::new();
    let (mut profile_prefill, mut profile_decode, mut profile_sessions) = (
        KernelTimes::default(),
        KernelTimes::default(),
        KernelTimes::default(),
    );
    let mut frontier = a.ctx_start;
    loop {
        let have = session.n_tokens();
        let t = Instant::now();
        session.prefill(&prompt[have..frontier])?;
        let prefill_s = t.elapsed().as_secs_f64();
        let mut payload = Vec::new();
        session.save_payload(&mut payload)?;
        // A device copy only where a second run starts from this point; otherwise the
        // state waits in host memory. With the weights placed to leave room for one
        // session (expert offload) a device copy does not fit.
        let (snapshot, host_snapshot) = if a.rows > 1 || a.sessions > 1 || spec.is_some() {
            (Some(session.try_clone()?), None)
        } else {
            (None, Some(session.export_state()?))
        };
        profile_prefill.add(hooks.profile_take()?);
        let (plain, greedy) = if a.temp > 0.0 {
            decode_sampled(&mut session, a.gen_tokens, a.temp, a.seed)?
        } else {
            decode_greedy(&mut session, a.gen_tokens, eos)?
        };
        let base = BenchRow {
            ctx_tokens: frontier as u64,
            prefill_tokens: (frontier - have) as u64,
            prefill_tps: (frontier - have) as f64 / prefill_s,
            gen_tokens: 0,
            gen_tps: 0.0,
            kvcache_bytes: payload.len() as u64,
            rows: 1,
            ms_per_cycle: 0.0,
            tokens_per_cycle: 0.0,
            effective_tps: 0.0,
        };
        let mut runs = vec![plain.row(&base, 1)];
        if a.rows > 1 {
            session = snapshot
                .as_ref()
                .expect("a snapshot for this run")
                .try_clone()?;
            runs.push(
                time_rows(&mut session, a.rows, a.gen_tokens, eos, a.seed)?
                    .row(&base, a.rows as u64),
            );
        }
        if a.sessions > 1 {
            let snap = snapshot.as_ref().expect("a snapshot for this run");
            profile_decode.add(hooks.profile_take()?);
            let (timed, check) = time_sessions(snap, a.sessions, a.gen_tokens, a.seed)?;
            profile_sessions.add(hooks.profile_take()?);
            eprintln!(
                "ds4-bench: ctx {frontier}: {} sessions: {check}",
                a.sessions
            );
            runs.push(timed.row(&base, a.sessions as u64));
        }
        if let Some(spec) = spec.as_mut() {
            session = snapshot
                .as_ref()
                .expect("a snapshot for this run")
                .try_clone()?;
            let truth: spec_run::Truth = Arc::new(std::sync::Mutex::new(greedy.clone()));
            if !a.accept_rate.is_empty() {
                let vocab = session.vocab() as u32;
                spec_run::install_accept_hook(
                    spec,
                    truth.clone(),
                    frontier,
                    cycle_base.clone(),
                    &a.accept_rate,
                    vocab,
                    a.seed,
                );
            }
            // Exact numerics must match the plain tokens: the first mismatch ends the run
            // (and fails the bench below); Fast rebuilds them and goes on.
            let resync = model.numerics() != Numerics::Exact;
            let r = spec_run::run(&mut session, spec, &truth, &cycle_base, eos, resync)?;
            let st = spec.stats();
            let ms = 1e3 * r.timed.secs / r.timed.cycles as f64;
            // The drawn tokens per cycle scatter around the rates' expectation (a
            // `-n 256` run has ~110 cycles): say what the cycle time gives at it.
            let expected = if a.accept_rate.is_empty() {
                String::new()
            } else {
                let e = spec_run::expected_tokens_per_cycle(&a.accept_rate, a.mtp_draft);
                format!(
                    "; at the rates' expected {e:.2} tokens/cycle: {:.1} tok/s",
                    1e3 * e / ms
                )
            };
            eprintln!(
                "ds4-bench: ctx {frontier}: mtp: {:.2} tokens/cycle (acceptance {:.0}%), {ms:.2} ms/cycle{expected}",
                st.tokens_per_cycle(),
                100.0 * st.acceptance(),
            );
            if let Some((at, want, got)) = r.mismatch {
                let resynced = if r.resyncs > 0 {
                    format!(
                        " (the plain tokens were rebuilt {} times, untimed, and the run went on)",
                        r.resyncs
                    )
                } else {
                    String::new()
                };
                mismatches.push(format!(
                    "ctx {frontier}: token {at} after the frontier is {got} with MTP, {want} without{resynced}"
                ));
            }
            runs.push(r.timed.row(&base, (a.mtp_draft + 1) as u64));
        }
        profile_decode.add(hooks.profile_take()?);
        match (snapshot, host_snapshot) {
            (Some(s), _) => session = s,
            (None, Some(h)) => session.import_state(h)?,
            (None, None) => unreachable!("one of the snapshots is taken above"),
        }
        for row in runs {
            writeln!(out, "{}", row.to_csv())?;
            out.flush()?;
            rows.push(row);
        }
        if frontier >= a.ctx_max {
            break;
        }
        frontier = if a.step_mul > 1.0 {
            ((frontier as f64 * a.step_mul).ceil() as usize).min(a.ctx_max)
        } else {
            (frontier + a.step_incr).min(a.ctx_max)
        };
    }
    hooks.finish()?;
    if !mismatches.is_empty() {
        let what = format!(
            "the speculative tokens differ from the plain greedy ones (greedy identity):\n  {}",
            mismatches.join("\n  ")
        );
        if model.numerics() == Numerics::Exact {
            bail!("{what}");
        }
        eprintln!("ds4-bench: warning: {what}\n(Fast numerics: a multi-row step may round a near tie differently; --quality must match exactly)");
    }
    if hooks.profiling() {
        profile_prefill.print("prefill (and the snapshots)");
        profile_decode.print(&format!("decode ({} tokens per frontier)", a.gen_tokens));
        if a.sessions > 1 {
            let what = format!(
                "{} batched steps of {} sessions",
                a.gen_tokens + 1,
                a.sessions
            );
            profile_sessions.print(&what);
        }
    }
    if let Some(p) = &a.plot {
        let title = format!(
            "ds4-bench {} ({})",
            if engine.backend() == BackendKind::Cuda {
                "CUDA"
            } else {
                "CPU"
            },
            a.synthetic_weights.map_or_else(
                || a.model.display().to_string(),
                |k| format!("synthetic {k:?}")
            )
        );
        std::fs::write(p, plot::svg(&rows, &title))
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}

/// `--mtp FILE` or `--synthetic-mtp`: the speculative loop (`None` without either).
fn load_speculator(a: &Args, engine: &Engine, model: &Model) -> Result<Option<Speculator>> {
    let mtp = if let Some(p) = &a.mtp {
        engine
            .load_mtp(p)
            .with_context(|| format!("cannot load the MTP file {}", p.display()))?
    } else if a.synthetic_mtp {
        let plan = Plan::mtp(
            model.config().clone(),
            ExpertQuant::Q4,
            "ds4-bench synthetic MTP",
        )?;
        let b = bar(plan.layout.file_size, "generating synthetic MTP weights");
        let done = AtomicU64::new(0);
        // Another stream than the main weights' (same seed).
        let image = plan.build(a.seed ^ 0x4d54_5000, &|n| {
            b.set_position(done.fetch_add(n, Ordering::Relaxed) + n)
        });
        b.finish_and_clear();
        let g = GgufFile::from_bytes(image)?;
        Mtp::from_gguf(model, Arc::new(g))?.with_numerics(model.numerics())
    } else {
        return Ok(None);
    };
    let opts = SpecOptions {
        draft: a.mtp_draft,
        margin: a.mtp_margin,
    };
    Ok(Some(Speculator::new(mtp, opts)?))
}

/// The model's end-of-sequence token (never picked by the greedy probe).
fn eos_token(model: &Model) -> u32 {
    model
        .gguf()
        .get("tokenizer.ggml.eos_token_id")
        .and_then(|v| v.as_i64())
        .unwrap_or(1) as u32
}

/// `DS4_CUDA_PROFILE` totals per kernel: (launches, ms).
#[derive(Default)]
struct KernelTimes(std::collections::HashMap<&'static str, (u64, f64)>);

impl KernelTimes {
    fn add(&mut self, rows: Vec<(&'static str, u64, f64)>) {
        for (name, n, ms) in rows {
            let e = self.0.entry(name).or_default();
            e.0 += n;
            e.1 += ms;
        }
    }

    fn print(&self, what: &str) {
        let mut rows: Vec<_> = self.0.iter().map(|(k, v)| (*k, v.0, v.1)).collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2));
        let total: f64 = rows.iter().map(|r| r.2).sum();
        eprintln!("\nDS4_CUDA_PROFILE: device time per kernel, {what}: {total:.2} ms");
        eprintln!(
            "{:<24} {:>10} {:>12} {:>10} {:>7}",
            "kernel", "launches", "total ms", "us/launch", "share"
        );
        for (name, n, ms) in rows {
            eprintln!(
                "{name:<24} {n:>10} {ms:>12.2} {:>10.2} {:>6.1}%",
                1e3 * ms / n as f64,
                100.0 * ms / total
            );
        }
    }
}

/// The `--fuse-ab` settings (`None`: a plain benchmark).
#[cfg(feature = "cuda")]
fn fuse_ab_specs(a: &Args) -> Result<Option<Vec<fuse_ab::Spec>>> {
    let specs = fuse_ab::parse_specs(&a.fuse_ab)?;
    if specs.is_empty() {
        return Ok(None);
    }
    if a.backend == Some(BackendArg::Cpu) {
        bail!("--fuse-ab times CUDA decode graphs: leave out --backend cpu");
    }
    Ok(Some(specs))
}

#[cfg(feature = "cuda")]
fn run_fuse_ab(a: &Args, model: &Model, specs: Vec<fuse_ab::Spec>, alloc: usize) -> Result<()> {
    fuse_ab::run(a, model, &specs, alloc)
}

/// Without CUDA there are no settings to compare: `--fuse-ab` is refused.
#[cfg(not(feature = "cuda"))]
fn fuse_ab_specs(a: &Args) -> Result<Option<std::convert::Infallible>> {
    if !a.fuse_ab.is_empty() {
        bail!("--fuse-ab times CUDA decode graphs: this build has no CUDA support");
    }
    Ok(None)
}

#[cfg(not(feature = "cuda"))]
fn run_fuse_ab(_: &Args, _: &Model, specs: std::convert::Infallible, _: usize) -> Result<()> {
    match specs {}
}

/// The GPU's kernel profile (`DS4_CUDA_PROFILE`) and trace (`DS4_CUDA_TRACE`) when the
/// engine runs on CUDA.
#[cfg(feature = "cuda")]
struct GpuHooks(Option<Arc<ds4_engine::dev::Gpu>>);

#[cfg(feature = "cuda")]
impl GpuHooks {
    fn of(engine: &Engine) -> GpuHooks {
        let gpu = engine.cuda_weights().map(|w| w.gpu.clone());
        if let Some(g) = gpu.as_ref().filter(|g| !g.skipped().is_empty()) {
            eprintln!(
                "ds4-bench: DS4_CUDA_SKIP: {} not launched — timing diagnosis only, the outputs are wrong",
                g.skipped().join(", ")
            );
        }
        GpuHooks(gpu)
    }

    /// The kernel times since the last call: (kernel, launches, ms).
    fn profile_take(&self) -> Result<Vec<(&'static str, u64, f64)>> {
        match &self.0 {
            Some(g) => Ok(g.profile_take()?),
            None => Ok(Vec::new()),
        }
    }

    fn profiling(&self) -> bool {
        self.0.as_ref().is_some_and(|g| g.profiling())
    }

    fn finish(&self) -> Result<()> {
        if let Some(g) = &self.0 {
            if let Some((path, n)) = g.trace_finish()? {
                eprintln!(
                    "ds4-bench: kernel trace of {n} launches in {}",
                    path.display()
                );
            }
        }
        Ok(())
    }
}

/// Without CUDA there is nothing to profile.
#[cfg(not(feature = "cuda"))]
struct GpuHooks;

#[cfg(not(feature = "cuda"))]
impl GpuHooks {
    fn of(_: &Engine) -> GpuHooks {
        GpuHooks
    }

    fn profile_take(&self) -> Result<Vec<(&'static str, u64, f64)>> {
        Ok(Vec::new())
    }

    fn profiling(&self) -> bool {
        false
    }

    fn finish(&self) -> Result<()> {
        Ok(())
    }
}

// #19 item 4: every flag has `--help` text.
ds4_cli::every_argument_has_help_text!(Args);
