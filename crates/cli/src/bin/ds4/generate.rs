//! Prefill with a progress bar and the streaming sampling loop, shared by the
//! one-shot and interactive modes.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use ds4_engine::{Sampler, Session, SpecStats, Speculator};
use ds4_tokenizer::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};

use crate::render::TokenPrinter;

/// Tokens per forward call while prefilling: large enough to amortise the weight
/// reads, small enough for a live progress bar (results do not depend on it).
const PROGRESS_STEP: usize = 512;

/// Appends `tokens` to the session, showing `processing N input tokens` on stderr
/// (a bar on a terminal, one line otherwise). Returns false when `stop` was raised
/// between chunks.
pub fn prefill(session: &mut Session, tokens: &[u32], stop: Option<&AtomicBool>) -> Result<bool> {
    let n = tokens.len();
    if n == 0 {
        return Ok(true);
    }
    let tty = std::io::stderr().is_terminal();
    let bar = if tty {
        ProgressBar::new(n as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "processing {len} input tokens: {pos}/{len} ({percent}%) {bar:30} {per_sec} eta {eta}",
        )
        .expect("valid template"),
    );
    // Progress steps no shorter than the backend's efficient batch (the CUDA prefill
    // chunk streams every routed expert once).
    let step = PROGRESS_STEP
        .max(session.preferred_batch())
        .min(session.prefill_chunk())
        .max(1);
    for chunk in tokens.chunks(step) {
        if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
            bar.abandon();
            return Ok(false);
        }
        if let Err(e) = session.prefill(chunk) {
            bar.abandon();
            return Err(e.into());
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    if !tty {
        eprintln!("processing {n} input tokens: {n}/{n} (100.0%)");
    }
    Ok(true)
}

/// What a generation produced.
pub struct Generated {
    /// Sampled tokens, without the EOS that ended them.
    pub tokens: Vec<u32>,
    /// Stopped by `stop` (Ctrl+C).
    pub interrupted: bool,
    pub elapsed: Duration,
    /// The speculative loop's counters of this generation (with `--mtp`).
    pub mtp: Option<SpecStats>,
}

/// Samples up to `max` tokens from the session's logits, printing each, feeding each
/// back (all but the last); stops before EOS, at the limit or when `stop` is raised.
/// With `spec` (`--mtp`) the tokens come from speculative cycles
/// ([`Speculator::advance`]): the same tokens at `--temp 0`, the same distribution
/// otherwise; `stop` is checked between cycles (a cycle's tokens are all printed).
#[allow(clippy::too_many_arguments)]
pub fn generate<W: Write>(
    session: &mut Session,
    sampler: &mut Sampler,
    tok: &Tokenizer,
    eos: u32,
    max: usize,
    printer: &mut TokenPrinter<W>,
    stop: Option<&AtomicBool>,
    mut spec: Option<&mut Speculator>,
) -> Result<Generated> {
    let t0 = Instant::now();
    if let Some(sp) = spec.as_deref_mut() {
        sp.reset_stats();
    }
    let mut out = Vec::new();
    let stopped = || stop.is_some_and(|s| s.load(Ordering::SeqCst));
    if spec.is_none() {
        let interrupted = picked(session, sampler, tok, eos, max, printer, &stopped, &mut out)?;
        let elapsed = t0.elapsed();
        printer.finish()?;
        return Ok(Generated {
            tokens: out,
            interrupted,
            elapsed,
            mtp: None,
        });
    }
    let mut interrupted = false;
    // Tokens chosen but not printed yet: one from the logits, or a cycle's worth.
    let mut next = Vec::new();
    'gen: while out.len() < max {
        if stopped() {
            interrupted = true;
            break;
        }
        if let (Some(sp), Some(&last)) = (spec.as_deref_mut(), out.last()) {
            next = sp.advance(session, sampler, last, max - out.len(), &[eos])?;
        } else if next.is_empty() {
            next.push(sampler.sample(session.logits()));
        }
        for t in next.drain(..) {
            if t == eos {
                break 'gen;
            }
            printer.write(tok.token_bytes(t))?;
            out.push(t);
        }
        if out.len() >= max {
            break;
        }
        if stopped() {
            interrupted = true;
            break;
        }
        if spec.is_none() {
            session.decode(*out.last().expect("a token was just pushed"))?;
        }
    }
    let elapsed = t0.elapsed();
    printer.finish()?;
    Ok(Generated {
        tokens: out,
        interrupted,
        elapsed,
        mtp: spec.map(|sp| sp.stats()),
    })
}

/// Generation without MTP through [`Session::sample_run`] (greedy at `--temp 0`): on
/// CUDA the picks, sampled or greedy, are made on the device and each token's pass is
/// launched before the host prints the previous token. The tokens are the plain
/// loop's (`t = sampler.sample(logits)`); a run that EOS or Ctrl-C ends has that last
/// pick decoded too (see `greedy_run`). Returns whether Ctrl-C ended it.
#[allow(clippy::too_many_arguments)]
fn picked<W: Write>(
    session: &mut Session,
    sampler: &mut Sampler,
    tok: &Tokenizer,
    eos: u32,
    max: usize,
    printer: &mut TokenPrinter<W>,
    stopped: &dyn Fn() -> bool,
    out: &mut Vec<u32>,
) -> Result<bool> {
    if max == 0 || stopped() {
        return Ok(max > 0);
    }
    let first = sampler.sample(session.logits());
    if first == eos {
        return Ok(false);
    }
    printer.write(tok.token_bytes(first))?;
    out.push(first);
    if max == 1 || stopped() {
        return Ok(max > 1);
    }
    let (mut failed, mut interrupted) = (None, false);
    session.sample_run(first, max - 1, sampler, &mut |t| {
        if t == eos {
            return false;
        }
        if let Err(e) = printer.write(tok.token_bytes(t)) {
            failed = Some(e);
            return false;
        }
        out.push(t);
        interrupted = stopped();
        !interrupted
    })?;
    match failed {
        Some(e) => Err(e.into()),
        None => Ok(interrupted),
    }
}

/// The final line's MTP part: `, mtp: X.XX tokens/cycle (acceptance Y%)`.
pub fn mtp_summary(stats: Option<&SpecStats>) -> String {
    match stats {
        Some(s) => format!(
            ", mtp: {:.2} tokens/cycle (acceptance {:.1}%)",
            s.tokens_per_cycle(),
            100.0 * s.acceptance()
        ),
        None => String::new(),
    }
}

/// Generation budget: `-n`, clamped to the room left (one position stays free).
pub fn budget(n: usize, ctx: usize, pos: usize) -> usize {
    n.min(ctx.saturating_sub(pos).saturating_sub(1))
}

/// `ds4: prefill: X t/s, generation: Y t/s`.
pub fn timing_line(
    prefill_tokens: usize,
    prefill: Duration,
    gen_tokens: usize,
    gen: Duration,
) -> String {
    let rate = |n: usize, d: Duration| {
        let s = d.as_secs_f64();
        if s > 0.0 {
            n as f64 / s
        } else {
            0.0
        }
    };
    format!(
        "ds4: prefill: {:.2} t/s, generation: {:.2} t/s",
        rate(prefill_tokens, prefill),
        rate(gen_tokens, gen)
    )
}

/// The sampling seed: the flag, or one from the clock and the process id.
pub fn seed_or_clock(seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        (t ^ (u64::from(std::process::id()) << 32)).max(1)
    })
}
