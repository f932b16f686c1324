//! The MTP speculative run of one frontier (`--mtp FILE` / `--synthetic-mtp`): from the
//! frontier's snapshot, `Speculator::advance` cycles that emit the same greedy tokens
//! as the plain decode, timed, with `--accept-rate` making the acceptance a parameter.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use ds4_engine::{Sampler, SamplerConfig, Session, Speculator};
use ds4_synth::Rng;

use crate::cycles::{pick, Timed};

/// The plain greedy tokens from the frontier on (index k: position frontier + k), which
/// the accept hook proposes and the run compares with; a Fast run that parts from them
/// rewrites their tail from its own state ([`run`]).
pub type Truth = Arc<Mutex<Vec<u32>>>;

/// Untimed cycles before the timed ones: the first after a snapshot restore has no
/// main-model HC state to draft from (a plain decode), the second drafts and so carries
/// the verify step's one-off costs (on CUDA: capturing the graph of its row count).
const WARMUP_CYCLES: usize = 2;

/// `--accept-rate P1[,P2,...]`: every draft passes through a hook that proposes, for the
/// draft at index i of its cycle, the main model's own greedy token at that position
/// (from the plain run) with probability P_i (the last value repeats), and otherwise a
/// token that is not it. A proposal equal to the greedy token is accepted by the greedy
/// verify and any other is rejected, so P_i is the conditional acceptance of draft i
/// given drafts 0..i were accepted. The MTP block still runs, so its cost is real.
pub fn install_accept_hook(
    spec: &mut Speculator,
    truth: Truth,
    frontier: usize,
    base: Arc<AtomicUsize>,
    rates: &[f64],
    vocab: u32,
    seed: u64,
) {
    let rates = rates.to_vec();
    spec.set_draft_hook(Box::new(move |pos| {
        // `pos` is where the drafted token would sit; the cycle's token sits at `base`.
        let i = pos.saturating_sub(base.load(Ordering::Relaxed) + 1);
        let truth = truth.lock().expect("truth lock");
        // Past the plain run's tokens (nothing to compare with): the MTP's own draft.
        let &want = pos.checked_sub(frontier).and_then(|k| truth.get(k))?;
        Some(proposal(
            seed,
            pos,
            rates[i.min(rates.len() - 1)],
            want,
            vocab,
        ))
    }));
}

/// The accept hook's proposal for the draft at position `pos`: `want` with probability
/// `p`, else another token. The draw is keyed by (seed, position), not taken from one
/// running stream, so a run's accept/reject pattern depends on the positions its cycles
/// draft, not on how many draws came before: two binaries (or numerics) whose Fast runs
/// resync at different near ties still draw the same fates and compare at the same
/// tokens per cycle. Each position is decided at most once (a position drafted again
/// after an earlier rejection in its cycle was never verified), so the draws stay
/// independent with the asked rates.
fn proposal(seed: u64, pos: usize, p: f64, want: u32, vocab: u32) -> u32 {
    let mut rng = Rng::stream(seed, 13, pos as u64);
    if (rng.uniform() as f64) < p {
        want
    } else {
        // Any other token: the greedy verify rejects it.
        (want + 1 + rng.below(vocab as u64 - 1) as u32) % vocab
    }
}

/// Tokens a cycle emits on average at per-draft acceptances `rates` (the last repeats)
/// with `draft` drafts: 1 + p0 + p0·p1 + … (the verify's own token, then each accepted
/// draft), what the measured tokens per cycle estimate.
pub fn expected_tokens_per_cycle(rates: &[f64], draft: usize) -> f64 {
    let (mut sum, mut run) = (1.0, 1.0);
    for i in 0..draft {
        run *= rates[i.min(rates.len().saturating_sub(1))];
        sum += run;
    }
    sum
}

/// What the speculative run emitted beside its timing.
pub struct SpecRun {
    pub timed: Timed,
    /// The first position (index into the plain run's tokens) where the speculative
    /// tokens differ from the plain greedy ones, with the two tokens.
    pub mismatch: Option<(usize, u32, u32)>,
    /// How often a `resync` run rebuilt the plain tokens after parting from them.
    pub resyncs: usize,
}

/// From the frontier state in `session`, feeds `truth[0]` (the plain run's first,
/// untimed token) to `spec` and runs cycles until `truth.len() − 1` tokens follow it,
/// comparing them with `truth[1..]`; cycles after [`WARMUP_CYCLES`] are timed. Ends
/// early at EOS (the plain run skips EOS; a greedy cycle may return it). At a mismatch
/// the run ends, unless `resync`: then (untimed) the plain greedy continuation of the
/// speculative session's own state replaces the rest of `truth` and the run goes on,
/// so a Fast run at depth — where a multi-row step rounds a near tie differently from
/// the one-token decode now and then — still measures every cycle at the asked
/// acceptance instead of stopping at its first near tie.
pub fn run(
    session: &mut Session,
    spec: &mut Speculator,
    truth: &Truth,
    base: &AtomicUsize,
    eos: u32,
    resync: bool,
) -> Result<SpecRun> {
    let (want, first) = {
        let t = truth.lock().expect("truth lock");
        (t.len().saturating_sub(1), t.first().copied())
    };
    let Some(mut token) = first.filter(|_| want >= 1) else {
        bail!("the speculative run needs at least one token after the first (-n ≥ 1)");
    };
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    let mut done = 0usize;
    let mut cycles = 0u64;
    let mut timed_tokens = 0u64;
    let (mut mismatch, mut resyncs) = (None, 0usize);
    let mut t0 = Instant::now();
    let mut paused = Duration::ZERO;
    while done < want {
        if cycles == WARMUP_CYCLES as u64 {
            spec.reset_stats();
            t0 = Instant::now();
            paused = Duration::ZERO;
        }
        base.store(session.n_tokens(), Ordering::Relaxed);
        let out = spec.advance(session, &mut sampler, token, want - done, &[eos])?;
        cycles += 1;
        let parted = {
            let t = truth.lock().expect("truth lock");
            // EOS is the plain run's argmax there too (it took the runner-up): no mismatch.
            out.iter()
                .enumerate()
                .map(|(k, &tok)| (done + 1 + k, tok))
                .find(|&(at, tok)| tok != t[at] && tok != eos)
                .map(|(at, tok)| (at, t[at], tok))
        };
        if cycles > WARMUP_CYCLES as u64 {
            timed_tokens += out.len() as u64;
        }
        done += out.len();
        let last = match out.last() {
            Some(&t) if t != eos => t,
            _ => break,
        };
        token = last;
        if let Some(m) = parted {
            mismatch = mismatch.or(Some(m));
            if !resync {
                break;
            }
            let t = Instant::now();
            replan(session, truth, done, last, want, eos)?;
            paused += t.elapsed();
            resyncs += 1;
        }
    }
    let secs = (t0.elapsed() - paused).as_secs_f64();
    let timed_cycles = cycles.saturating_sub(WARMUP_CYCLES as u64);
    if timed_cycles == 0 {
        bail!(
            "the speculative run ended after {cycles} untimed cycles ({done} tokens): raise --gen-tokens"
        );
    }
    Ok(SpecRun {
        timed: Timed {
            cycles: timed_cycles,
            tokens: timed_tokens,
            secs,
        },
        mismatch,
        resyncs,
    })
}

/// `truth[at] = last` (the speculative run's newest token, not yet in `session`) and
/// after it the plain greedy tokens a copy of `session` decodes from there, up to
/// index `want`.
fn replan(
    session: &Session,
    truth: &Truth,
    at: usize,
    last: u32,
    want: usize,
    eos: u32,
) -> Result<()> {
    let mut copy = session.try_clone()?;
    let mut next = Vec::with_capacity(want + 1 - at);
    let mut t = last;
    next.push(t);
    while at + next.len() <= want {
        t = pick(copy.decode(t)?, eos);
        next.push(t);
    }
    let mut truth = truth.lock().expect("truth lock");
    truth.truncate(at);
    truth.extend(next);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposals_are_keyed_by_position_and_keep_their_rates() {
        let (vocab, seed) = (1000u32, 7u64);
        for (p, want) in [(0.8, 5u32), (0.3, 999), (0.0, 0), (1.0, 17)] {
            let mut hits = 0usize;
            let n = 20_000usize;
            for pos in 0..n {
                let got = proposal(seed, pos, p, want, vocab);
                assert!(got < vocab);
                // The same position draws the same fate, whatever came before.
                assert_eq!(got, proposal(seed, pos, p, want, vocab));
                hits += (got == want) as usize;
            }
            let rate = hits as f64 / n as f64;
            // Binomial: σ ≤ 0.0036 at n = 20,000; 5σ.
            assert!((rate - p).abs() < 0.018, "p = {p}: drew {rate}");
        }
        // Another seed draws other fates.
        let differ = (0..1000)
            .filter(|&pos| proposal(1, pos, 0.5, 3, vocab) != proposal(2, pos, 0.5, 3, vocab))
            .count();
        assert!(differ > 300, "{differ}");
    }

    #[test]
    fn expected_tokens_per_cycle_multiplies_the_conditional_rates() {
        assert!((expected_tokens_per_cycle(&[0.8], 1) - 1.8).abs() < 1e-12);
        assert!((expected_tokens_per_cycle(&[0.8, 0.6], 2) - 2.28).abs() < 1e-12);
        // The last rate repeats.
        assert!((expected_tokens_per_cycle(&[0.5], 3) - 1.875).abs() < 1e-12);
        assert_eq!(expected_tokens_per_cycle(&[0.9], 0), 1.0);
    }
}
