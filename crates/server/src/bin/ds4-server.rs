//! `ds4-server`: the OpenAI/Anthropic-compatible HTTP server (see docs/server.md).

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Parser;
use ds4_engine::cuda::{driver_present, CudaBackend};
use ds4_engine::{LoadOptions, Model, Numerics, Session, SessionOptions};
use ds4_server::engine::{default_script, FakeEngine, RealEngine};
use ds4_server::worker::spawn_worker;
use ds4_server::{log, Args, EngineBackend, Shared};
use ds4_tokenizer::Tokenizer;

fn load_engine(args: &Args) -> Result<(Arc<Tokenizer>, Box<dyn EngineBackend>)> {
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
    let model = Model::load(&args.model, LoadOptions { numerics })
        .with_context(|| format!("cannot load {}", args.model.display()))?;
    let tok = ds4_server::engine::tokenizer_from_gguf(model.gguf())
        .map_err(|e| anyhow::anyhow!("tokenizer of {}: {e}", args.model.display()))?;
    tok.special_ids()
        .map_err(|e| anyhow::anyhow!("the model's vocabulary lacks the chat markers: {e}"))?;
    let want = if args.cpu {
        Some("cpu")
    } else if args.cuda {
        Some("cuda")
    } else {
        args.backend.as_deref()
    };
    let opts = SessionOptions {
        numerics: Some(numerics),
        ..SessionOptions::new(args.ctx)
    };
    let session = match want {
        Some("cpu") => Session::with_options(&model, opts)?,
        Some(b) if b != "cuda" => bail!("unknown backend {b} (use cpu or cuda)"),
        _ if !driver_present() => {
            if want == Some("cuda") {
                log!("no CUDA driver on this machine; using the CPU backend");
            }
            Session::with_options(&model, opts)?
        }
        _ => match CudaBackend::load(&model, 0, &|_| {})
            .and_then(|w| CudaBackend::new(&w, args.ctx, numerics))
        {
            Ok(b) => Session::with_backend(&model, Box::new(b), numerics, opts.prefill_chunk),
            Err(e) => {
                log!("CUDA backend unavailable ({e}); using the CPU backend");
                Session::with_options(&model, opts)?
            }
        },
    };
    let c = model.config();
    log!(
        "model {}: {} layers, vocab {}, ctx {}",
        args.model.display(),
        c.n_layer,
        c.vocab,
        args.ctx
    );
    Ok((Arc::new(tok), Box::new(RealEngine::new(session))))
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("ds4-server: {e:#}");
        std::process::exit(1);
    }
}

fn run(mut args: Args) -> Result<()> {
    if let Some(dir) = &args.chdir {
        std::env::set_current_dir(dir).with_context(|| format!("--chdir {}", dir.display()))?;
    }
    if args.metal {
        eprintln!("ds4-server: --metal is not supported by this engine (use --cpu or --cuda)");
        std::process::exit(2);
    }
    if args.api_key.is_none() {
        args.api_key = std::env::var("DS4_API_KEY").ok();
    }
    if args.mtp.is_some() || args.dir_steering_file.is_some() {
        log!("--mtp and --dir-steering-* are accepted for compatibility but not implemented; ignoring");
    }
    let cfg = match args.to_config() {
        Ok(c) => c,
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
    let (tok, engine) = load_engine(&args)?;
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
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        log!("listening on http://{}", listener.local_addr()?);
        ds4_server::serve(listener, shared.clone(), shutdown_signal()).await?;
        anyhow::Ok(())
    })?;
    shared.begin_shutdown();
    let _ = worker.join();
    log!("bye");
    Ok(())
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
