//! One-shot mode: render the prompt, prefill, stream the answer, print the speeds.

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::{bail, Result};
use ds4_engine::{Sampler, SamplerConfig};

use crate::args::{Args, Think};
use crate::engine::Engine;
use crate::generate::{budget, generate, mtp_summary, prefill, seed_or_clock, timing_line};
use crate::render::{prompt_tokens, TokenPrinter};

pub fn sampler_config(args: &Args) -> SamplerConfig {
    SamplerConfig {
        temperature: args.temp,
        top_k: 0,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: seed_or_clock(args.seed),
    }
}

/// The effective thinking mode and the rendered prompt's tokens; an error when the
/// prompt leaves no room in `--ctx` (shared by one-shot runs and `--dump-logprobs`).
pub fn fitting_prompt(engine: &Engine, args: &Args, prompt: &str) -> Result<(Think, Vec<u32>)> {
    let think = args.think_mode().effective(args.ctx);
    let tokens = prompt_tokens(&engine.tok, engine.specials(), &args.system, prompt, think);
    if tokens.len() >= args.ctx {
        bail!(
            "the prompt has {} tokens, which does not fit --ctx {}",
            tokens.len(),
            args.ctx
        );
    }
    Ok((think, tokens))
}

pub fn run(engine: &Engine, args: &Args, prompt: &str) -> Result<()> {
    let (think, tokens) = fitting_prompt(engine, args, prompt)?;
    let mut spec = engine.speculator(args)?;
    let sp = engine.specials();
    let mut session = engine.session(args.ctx)?;
    let t0 = Instant::now();
    prefill(&mut session, &tokens, None)?;
    let prefill_time = t0.elapsed();

    let mut sampler = Sampler::new(sampler_config(args));
    let stdout = std::io::stdout();
    let color = stdout.is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let mut printer = TokenPrinter::new(stdout.lock(), think.enabled(), color);
    let max = budget(args.tokens, args.ctx, session.n_tokens());
    let g = generate(
        &mut session,
        &mut sampler,
        &engine.tok,
        sp.eos,
        max,
        &mut printer,
        None,
        spec.as_mut(),
    )?;
    eprintln!(
        "{}{}",
        timing_line(tokens.len(), prefill_time, g.tokens.len(), g.elapsed),
        mtp_summary(g.mtp.as_ref())
    );
    engine.trace(
        args,
        crate::trace::Run {
            mode: "oneshot",
            think,
            prompt: &tokens,
            cached: 0,
            prefill: prefill_time,
            generated: &g,
            max,
            backend: engine.backend_name(),
            steering: engine.steering(),
        },
    )
}
