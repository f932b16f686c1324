//! `ds4-server`: the OpenAI/Anthropic-compatible HTTP server (see docs/server.md).

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use ds4_engine::{BackendChoice, Engine, EngineOptions, Numerics, SpecOptions, Speculator};
use ds4_server::engine::{default_script, FakeEngine, RealEngine};
use ds4_server::worker::spawn_worker;
use ds4_server::{lock, log, Args, EngineBackend, Shared, Startup};
use ds4_tokenizer::Tokenizer;

/// Loads the model (or the fake engine), reporting the phase to `startup` for /health.
fn load_engine(
    args: &Args,
    startup: &Arc<Startup>,
) -> Result<(Arc<Tokenizer>, Box<dyn EngineBackend>)> {
    startup.set_phase("loading", 0.0);
    if args.fake_load_ms > 0 {
        // Testing only: a slow load, so tests can watch /health say "loading".
        let steps = 20;
        for i in 0..steps {
            startup.set_phase("loading", i as f64 / steps as f64);
            std::thread::sleep(std::time::Duration::from_millis(args.fake_load_ms) / steps);
        }
    }
    if let Some(tj) = &args.fake_engine {
        let bytes = std::fs::read(tj).with_context(|| format!("reading {}", tj.display()))?;
        let tok = Arc::new(Tokenizer::from_tokenizer_json(&bytes)?);
        let fake = FakeEngine::new(tok.clone(), args.ctx, default_script())
            .with_delay(std::time::Duration::from_millis(args.fake_delay_ms));
        log!("fake engine (testing) over {}", tj.display());
        return Ok((tok, Box::new(fake)));
    }
    if !args.model.exists() {
        bail!(
            "model file {} not found.\nDownload the published weights with `ds4-tool download q2-imatrix` or point -m at a GGUF file.",
            args.model.display()
        );
    }
    let numerics = if args.quality {
        Numerics::Exact
    } else {
        Numerics::Fast
    };
    let want = if args.cpu {
        Some("cpu")
    } else if args.cuda {
        Some("cuda")
    } else {
        args.backend.as_deref()
    };
    let backend = match want {
        None => BackendChoice::Auto,
        // `-t` already sized rayon's global pool, which the CPU backend uses.
        Some("cpu") => BackendChoice::Cpu { threads: None },
        Some("cuda") => BackendChoice::Cuda { device: 0 },
        Some(b) => bail!("unknown backend {b} (use cpu or cuda)"),
    };
    let st = startup.clone();
    let progress: ds4_engine::UploadProgress = Box::new(move |done, total| {
        st.set_phase("uploading", done as f64 / total.max(1) as f64);
    });
    let mut engine = Engine::open(
        &args.model,
        EngineOptions {
            backend,
            numerics,
            progress: Some(progress),
            memory: ds4_engine::MemoryOptions {
                offload: args.offload_experts,
                ctx: args.ctx,
                gpus: args.gpus.clone().map(|g| g.0).unwrap_or_default(),
                device_map: args.device_map.clone(),
            },
        },
    )
    .with_context(|| format!("cannot load {}", args.model.display()))?;
    let file = args.dir_steering_file.as_deref();
    let steer = (args.dir_steering_ffn, args.dir_steering_attn);
    if let Some(s) = engine
        .steer_from_flags(file, steer.0, steer.1)
        .context("--dir-steering-file")?
    {
        let f = file.map(|f| f.display().to_string()).unwrap_or_default();
        log!("directional steering: {f} ffn={} attn={}", s.ffn, s.attn);
    }
    let tok = engine
        .tokenizer()
        .with_context(|| format!("tokenizer of {}", args.model.display()))?;
    tok.special_ids()
        .map_err(|e| anyhow::anyhow!("the model's vocabulary lacks the chat markers: {e}"))?;
    log!("backend {} ({})", engine.backend(), engine.backend_reason());
    let session = engine.new_session(args.ctx)?;
    let info = engine.info();
    log!(
        "model {}: {} layers, vocab {}, ctx {}",
        args.model.display(),
        info.hparams.n_layer,
        info.hparams.vocab,
        args.ctx
    );
    let real = RealEngine::new(&engine, session);
    let real = match load_speculator(args, &engine)? {
        Some(spec) => real.with_speculator(spec),
        None => real,
    };
    Ok((tok, Box::new(real)))
}

/// `--mtp FILE`: the draft block, checked against the loaded model (a file for another
/// model or other dimensions is refused here, before the server listens).
fn load_speculator(args: &Args, engine: &Engine) -> Result<Option<Speculator>> {
    let Some(path) = &args.mtp else {
        return Ok(None);
    };
    let mtp = engine.load_mtp(path).with_context(|| {
        format!(
            "--mtp {}: cannot use this MTP file with {}",
            path.display(),
            args.model.display()
        )
    })?;
    let defaults = SpecOptions::default();
    let opts = SpecOptions {
        draft: args.mtp_draft.unwrap_or(defaults.draft),
        margin: args.mtp_margin.unwrap_or(defaults.margin),
    };
    log!(
        "mtp {}: speculative decoding, {} draft{} per cycle, margin {}",
        path.display(),
        opts.draft,
        if opts.draft == 1 { "" } else { "s" },
        opts.margin
    );
    Ok(Some(Speculator::new(mtp, opts)?))
}

/// File descriptors kept out of the connection cap: the model, cache files, logs.
const FD_RESERVE: u64 = 64;
/// How often a long load logs its progress.
const PROGRESS_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

fn main() {
    let args = Args::parse();
    ds4_server::metrics::init_logging(args.verbose);
    if let Err(e) = run(args) {
        eprintln!("ds4-server: {e:#}");
        std::process::exit(1);
    }
}

fn run(mut args: Args) -> Result<()> {
    args.check_chdir().unwrap_or_else(|e| e.exit());
    if let Some(dir) = &args.chdir {
        std::env::set_current_dir(dir).with_context(|| format!("--chdir {}", dir.display()))?;
    }
    args.check_paths().unwrap_or_else(|e| e.exit());
    if args.metal {
        eprintln!(
            "ds4-server: --metal: the Metal backend is not available in this build (use --cpu or --cuda)"
        );
        std::process::exit(2);
    }
    if let Err(e) = args.resolve_api_key() {
        eprintln!("ds4-server: {e}");
        std::process::exit(2);
    }
    let scaled = [args.dir_steering_ffn, args.dir_steering_attn]
        .iter()
        .any(|s| s.is_some_and(|v| v != 0.0));
    if args.dir_steering_file.is_none() && scaled {
        // The reference refuses a steering scale without directions.
        eprintln!("ds4-server: --dir-steering-ffn/--dir-steering-attn need --dir-steering-file");
        std::process::exit(2);
    }
    for w in compat_warnings(&args) {
        log!("warning: {w}");
    }
    let cfg = match args.to_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ds4-server: {e}");
            std::process::exit(2);
        }
    };
    // One ds4 process per lock file (reference §3) and one server per KV directory;
    // both are held until exit.
    let _locks = match take_locks(&cfg) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ds4-server: {e}");
            std::process::exit(2);
        }
    };
    if let Some(n) = args.threads {
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }
    let mut limits = cfg.conn.clone();
    // Idle sockets must run into the connection cap, never into the fd limit (#18 item 1).
    if let Some(fds) = ds4_server::server::raise_fd_limit() {
        let room = usize::try_from(fds.saturating_sub(FD_RESERVE)).unwrap_or(usize::MAX);
        if room < limits.max_connections {
            log!(
                "warning: --max-connections {} lowered to {} (open-file limit {fds})",
                limits.max_connections,
                room.max(1)
            );
            limits.max_connections = room.max(1);
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let addr = format!(
        "{}:{}",
        if args.host == "localhost" {
            "127.0.0.1"
        } else {
            &args.host
        },
        args.port
    );
    // Bind before loading (#19 item 3): a busy port fails at once, and /health answers
    // "loading" meanwhile.
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(&addr))
        .with_context(|| format!("cannot listen on {addr}"))?;
    let url = format!("http://{}", listener.local_addr()?);
    log!("listening on {url} (loading the model)");
    let startup = Startup::new();
    let st = startup.clone();
    let shutdown = async move {
        shutdown_signal().await;
        if st.shared().is_none() {
            // Nothing to save yet: stop the load instead of waiting for it.
            log!("interrupted while loading");
            std::process::exit(130);
        }
    };
    let server = rt.spawn(ds4_server::serve(
        listener,
        startup.clone(),
        limits,
        shutdown,
    ));
    rt.spawn(startup.clone().log_progress(PROGRESS_LOG_EVERY));
    let (tok, engine) = load_engine(&args, &startup)?;
    if args.warm_weights {
        warm_weights(&args, &startup);
    }
    if let Some(d) = &cfg.kv_disk {
        log!(
            "kv disk cache: {} budget={} MiB min={} cold_max={} continued={} trim={} align={}",
            d.dir.display(),
            args.kv_disk_space_mb,
            d.min_tokens,
            d.cold_max_tokens,
            d.continued_step(),
            d.trim,
            d.align
        );
    }
    let shared = Shared::new(cfg, tok);
    let worker = spawn_worker(shared.clone(), engine);
    startup.ready(shared.clone());
    log!("ready on {url}");
    rt.block_on(server).context("server task")??;
    shared.begin_shutdown();
    let _ = worker.join();
    log!("bye");
    Ok(())
}

/// Startup warnings for reference flags that have no effect here (docs/server.md).
fn compat_warnings(args: &Args) -> Vec<String> {
    let mut w = Vec::new();
    if args.mtp.is_none() && (args.mtp_draft.is_some() || args.mtp_margin.is_some()) {
        w.push("--mtp-draft/--mtp-margin have no effect without --mtp".into());
    }
    if let (Some(f), Some(_)) = (&args.mtp, &args.fake_engine) {
        w.push(format!(
            "--mtp {}: the fake engine has no MTP block; decoding without drafts",
            f.display()
        ));
    }
    if let (Some(f), Some(_)) = (&args.dir_steering_file, &args.fake_engine) {
        w.push(format!(
            "--dir-steering-file {}: the fake engine cannot be steered",
            f.display()
        ));
    }
    if args.warm_weights && args.fake_engine.is_some() {
        w.push("--warm-weights: nothing to warm with the fake engine".into());
    }
    if let (Some(n), Some(_), None) = (args.max_sessions, &args.mtp, &args.fake_engine) {
        if n > 1 {
            w.push(format!(
                "--max-sessions {n}: speculative decoding (--mtp) runs one request at a time; the session pool is 1"
            ));
        }
    }
    w
}

fn take_locks(cfg: &ds4_server::ServerConfig) -> Result<Vec<lock::ProcessLock>> {
    let mut locks = vec![lock::acquire(&lock::lock_file_path())
        .map_err(|e| anyhow::anyhow!("{e}; set DS4_LOCK_FILE to another file to run several"))?];
    if let Some(d) = &cfg.kv_disk {
        // The cache itself prepares the directory too (the same one: a new directory is
        // 0700, a world-writable one gets a private subdirectory); doing it here lets the
        // lock live inside it. A failure disables the cache later, with its own log line.
        if let Ok(dir) = ds4_server::kvcache::disk::prepare_dir(&d.dir) {
            let path = dir.join(lock::KV_DIR_LOCK);
            locks.push(lock::acquire(&path).map_err(|e| {
                anyhow::anyhow!("the KV cache directory {} is in use: {e}", d.dir.display())
            })?);
        }
    }
    Ok(locks)
}

/// `--warm-weights`: reads the model file once so the page cache holds the mmap'd
/// weights before the first request (the CPU backend faults them in lazily otherwise).
fn warm_weights(args: &Args, startup: &Startup) {
    use std::io::Read;
    if args.fake_engine.is_some() {
        return;
    }
    let t0 = std::time::Instant::now();
    let mut buf = vec![0u8; 16 << 20];
    let mut total = 0u64;
    let res = std::fs::File::open(&args.model).and_then(|mut f| {
        let len = f.metadata()?.len().max(1);
        loop {
            startup.set_phase("warming", total as f64 / len as f64);
            let n = f.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            total += n as u64;
        }
    });
    match res {
        Ok(()) => log!(
            "warm weights: read {:.1} GiB in {:.1} s",
            total as f64 / (1u64 << 30) as f64,
            t0.elapsed().as_secs_f64()
        ),
        Err(e) => log!("warning: --warm-weights: {e}"),
    }
}

/// The first SIGINT/SIGTERM starts a clean shutdown; a second one exits at once.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    log!("shutting down (signal again to exit now)");
    tokio::spawn(async {
        let _ = tokio::signal::ctrl_c().await;
        std::process::exit(130);
    });
}
