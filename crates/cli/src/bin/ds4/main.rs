//! `ds4`: chat with DeepSeek V4 Flash from the terminal, flag-compatible with the
//! reference CLI (server.md §5): one-shot prompts, an interactive session that keeps
//! its KV state between turns, and the scoring/diagnostic modes.

mod args;
mod dump;
mod engine;
mod generate;
mod imatrix;
mod oneshot;
mod render;
mod repl;
mod trace;

use anyhow::Result;
use ds4_engine::Numerics;

use args::{Args, Think};
use engine::Engine;

fn main() {
    let args = Args::parse_env();
    ds4_cli::logging::init(args.verbose);
    if let Err(e) = run(&args) {
        // A closed stdout (`ds4 … | head`) ends the run quietly, like SIGPIPE would.
        let broken_pipe = e.chain().any(|c| {
            c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
        });
        if broken_pipe {
            std::process::exit(141);
        }
        eprintln!("ds4: {e:#}");
        // #19 item 4: an explicit `--backend cuda` that cannot be had is a usage error
        // (status 2, like a bad flag); `auto` falls back to the CPU instead.
        let unavailable = e.chain().any(|c| {
            c.downcast_ref::<ds4_engine::EngineError>()
                .is_some_and(|x| x.kind() == ds4_engine::ErrorKind::BackendUnavailable)
        });
        std::process::exit(if unavailable { 2 } else { 1 });
    }
}

fn run(args: &Args) -> Result<()> {
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()?;
    }
    let prompt = args.prompt_text()?;
    if args.dump_tokens {
        let text = prompt.as_deref().unwrap_or_default();
        return dump::dump_tokens(&args.model, text);
    }
    // Checked before the model loads: a bad dataset is a usage error (status 2).
    let dataset = args.imatrix_dataset.as_ref().map(|p| {
        imatrix::load_dataset(p)
            .unwrap_or_else(|e| args::fail(clap::error::ErrorKind::InvalidValue, &e))
    });
    let numerics = if args.quality {
        Numerics::Exact
    } else {
        Numerics::Fast
    };
    let mut engine = Engine::load(
        &args.model,
        numerics,
        args.backend_choice(),
        ds4_engine::MemoryOptions {
            offload: args.offload_experts,
            ctx: args.ctx,
            gpus: args.gpus.clone().map(|g| g.0).unwrap_or_default(),
            device_map: args.device_map.clone(),
        },
    )?;
    if args.inspect {
        return dump::inspect(&engine, args);
    }
    engine.configure(args)?;
    eprintln!("{}", engine.describe());
    if let Some(text) = &dataset {
        return imatrix::run(&engine, args, text);
    }
    if let Some(path) = &args.perplexity_file {
        return dump::perplexity(&engine, args, path);
    }
    match prompt {
        Some(text) => {
            if args.think_mode() == Think::Max
                && args.think_mode().effective(args.ctx) != Think::Max
            {
                eprintln!(
                    "ds4: warning: --think-max needs --ctx >= {}; ctx={} uses normal thinking instead",
                    ds4_tokenizer::chat::THINK_MAX_MIN_CONTEXT,
                    args.ctx
                );
            }
            match &args.dump_logprobs {
                Some(path) => dump::dump_logprobs(&engine, args, &text, path),
                None => oneshot::run(&engine, args, &text),
            }
        }
        None => repl::run(&engine, args),
    }
}
