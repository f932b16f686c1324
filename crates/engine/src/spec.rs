//! Speculative decoding with the MTP draft block (docs/architecture.md §3.1).
//!
//! One cycle, with the session holding `n` tokens and the caller's token `y` (already
//! emitted, position `n`): the MTP block drafts `d1` from `y` and the main model's final
//! HC state at `n − 1` ([`HcSource::Last`]), then `d2..dk` each from the previous draft
//! and the block's own output state ([`HcSource::Chain`]); one multi-row step verifies
//! `[y, d1..dk]`; the session keeps the accepted prefix ([`Session::commit_rows`]) and
//! the backend's MTP ring keeps the rows of the positions the session now holds
//! ([`Backend::mtp_keep`](crate::dev::Backend::mtp_keep)).
//!
//! Greedy sampling accepts `d_i` iff it is the target's argmax after `y, d1..d_{i−1}`,
//! so the emitted tokens are exactly the plain loop's (Exact numerics: the multi-row
//! step is bit-identical to decoding one token at a time). With temperature, the
//! standard speculative sampling rule (Leviathan et al. 2023, Chen et al. 2023) keeps
//! the sampler's filtered distribution `p` exactly: accept `d ~ q` with probability
//! `min(1, p(d)/q(d))`, else draw from `norm(max(0, p − q))`.

use std::collections::HashMap;

use crate::backend::{GreedyCycle, HcSource, MAX_ROWS};
use crate::error::{EngineError, Result};
use crate::mtp::Mtp;
use crate::sampling::{argmax, max_ignoring_nan, Sampler};
use crate::session::Session;

/// Most MTP-drafted tokens per cycle [`SpecOptions::draft`] accepts.
pub const MAX_DRAFT: usize = 16;

/// How a [`Speculator`] drafts.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecOptions {
    /// MTP-drafted tokens verified per cycle, 1..=[`MAX_DRAFT`] (the target's own next
    /// token comes on top; a cycle verifies at most [`Session::MAX_STEP_ROWS`] rows,
    /// so at most 15 drafts run). The reference's `--mtp-draft` counts that token too:
    /// its 2 is our 1.
    pub draft: usize,
    /// The confidence gate: drafting stops at a draft whose raw MTP logits have a
    /// top-1 − top-2 margin below this (that draft is not verified); 0 disables it.
    pub margin: f32,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions {
            draft: 1,
            margin: 3.0,
        }
    }
}

/// Counters of a [`Speculator`] since it was made or [`Speculator::reset_stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Calls of [`Speculator::advance`] (each runs the target once).
    pub cycles: u64,
    /// Drafted tokens verified.
    pub drafted: u64,
    /// Drafted tokens accepted (and returned).
    pub accepted: u64,
    /// Tokens returned.
    pub emitted: u64,
}

impl SpecStats {
    /// Tokens returned per target step (1 without speculation).
    pub fn tokens_per_cycle(&self) -> f64 {
        if self.cycles == 0 {
            return 0.0;
        }
        self.emitted as f64 / self.cycles as f64
    }

    /// The share of verified drafts that were accepted (0 when none were verified).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            return 0.0;
        }
        self.accepted as f64 / self.drafted as f64
    }
}

type DraftHook = Box<dyn FnMut(usize) -> Option<u32> + Send>;

// The server moves a session's speculator between threads.
const _: () = {
    const fn send<T: Send>() {}
    send::<Speculator>();
};

/// The speculative decoding loop: an MTP block, its options and counters.
pub struct Speculator {
    mtp: Mtp,
    opts: SpecOptions,
    stats: SpecStats,
    hook: Option<DraftHook>,
}

impl std::fmt::Debug for Speculator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Speculator")
            .field("opts", &self.opts)
            .field("stats", &self.stats)
            .field("hook", &self.hook.is_some())
            .finish()
    }
}

/// One cycle's drafts.
#[derive(Default)]
struct Drafts {
    tokens: Vec<u32>,
    /// Per draft, the distribution it was drawn from (`None`: a point mass — greedy,
    /// or a hooked proposal).
    q: Vec<Option<Vec<(u32, f64)>>>,
    /// MTP block runs (one more than `tokens` when the gate stopped a draft).
    runs: usize,
}

impl Speculator {
    pub fn new(mtp: Mtp, opts: SpecOptions) -> Result<Speculator> {
        if !(1..=MAX_DRAFT).contains(&opts.draft) {
            return Err(EngineError::Invalid(format!(
                "MTP drafts per cycle must be 1 to {MAX_DRAFT}, not {}",
                opts.draft
            )));
        }
        if !(opts.margin.is_finite() && opts.margin >= 0.0) {
            return Err(EngineError::Invalid(format!(
                "the MTP margin must be a finite number ≥ 0, not {}",
                opts.margin
            )));
        }
        Ok(Speculator {
            mtp,
            opts,
            stats: SpecStats::default(),
            hook: None,
        })
    }

    pub fn options(&self) -> &SpecOptions {
        &self.opts
    }

    pub fn mtp(&self) -> &Mtp {
        &self.mtp
    }

    pub fn stats(&self) -> SpecStats {
        self.stats
    }

    pub fn reset_stats(&mut self) {
        self.stats = SpecStats::default();
    }

    /// Benchmarks (`ds4-bench --accept-rate`): before every draft, `hook(position)` —
    /// where the drafted token would sit — may return a token to propose instead of the
    /// draft's own (the MTP block still runs, so costs are real; the hook never sees the
    /// draft, so a device can pick and verify without a round trip). With temperature,
    /// a hooked proposal is verified as a point mass, which keeps the target
    /// distribution exact whatever the hook does.
    pub fn set_draft_hook(&mut self, hook: Box<dyn FnMut(usize) -> Option<u32> + Send>) {
        self.hook = Some(hook);
    }

    /// Decodes `token` (already emitted by the caller) and up to `draft` drafted tokens
    /// verified in one multi-row step; returns the tokens that FOLLOW `token`: the
    /// accepted drafts, then one token sampled from the target's logits after them.
    /// The session then holds `token` and the accepted drafts but not the last
    /// returned token — the plain loop's invariant (emit t, then decode t). Never
    /// returns more than `max` (≥ 1) tokens; stops after the first returned token that
    /// is in `stop` (that token not decoded). Emitted tokens are exactly the
    /// non-speculative ones for greedy sampling (Exact numerics) and follow the same
    /// distribution with temperature.
    ///
    /// Drafting needs the main model's HC state of the last token, which a reset,
    /// import or payload load drops: the first cycle after one decodes `token`
    /// alone, as it does when the context has no room for drafts or `max` is 1.
    pub fn advance(
        &mut self,
        session: &mut Session,
        sampler: &mut Sampler,
        token: u32,
        max: usize,
        stop: &[u32],
    ) -> Result<Vec<u32>> {
        if max == 0 {
            return Err(EngineError::Invalid(
                "a speculative cycle returns at least one token: max must be ≥ 1".into(),
            ));
        }
        let n = session.n_tokens();
        let budget = self
            .opts
            .draft
            .min(MAX_ROWS - 1)
            .min(max - 1)
            .min(session.ctx().saturating_sub(n + 1));
        if budget > 0 && session.mtp_ready() && sampler.is_greedy() {
            return self.greedy(session, token, budget, max, stop);
        }
        let drafts = if budget > 0 && session.mtp_ready() {
            self.draft(session, sampler, token, budget, stop)?
        } else {
            Drafts::default()
        };
        let (out, accepted) = if drafts.tokens.is_empty() {
            session.decode(token)?;
            (vec![sampler.sample(session.logits())], 0)
        } else {
            let mut rows_in = Vec::with_capacity(1 + drafts.tokens.len());
            rows_in.push(token);
            rows_in.extend_from_slice(&drafts.tokens);
            let vocab = session.vocab();
            let rows = match session.step_rows(&rows_in) {
                Ok(rows) => rows,
                Err(e) => {
                    let _ = session.mtp_keep(0);
                    return Err(e);
                }
            };
            let chosen = choose(sampler, rows, vocab, &drafts, max, stop);
            session.commit_rows(chosen.0.len())?;
            chosen
        };
        self.end_cycle(session, out, accepted, drafts.tokens.len(), drafts.runs)
    }

    /// A cycle's end: the MTP ring keeps the rows of the positions the session now
    /// holds (n.., one per committed row) as far as drafts ran; the counters.
    fn end_cycle(
        &mut self,
        session: &mut Session,
        out: Vec<u32>,
        accepted: u64,
        drafted: usize,
        runs: usize,
    ) -> Result<Vec<u32>> {
        if runs > 0 {
            session.mtp_keep(out.len().min(runs))?;
        }
        let s = &mut self.stats;
        s.cycles += 1;
        s.drafted += drafted as u64;
        s.accepted += accepted;
        s.emitted += out.len() as u64;
        Ok(out)
    }

    /// [`Speculator::advance`] at temperature 0: the backend drafts, verifies and picks
    /// in one call ([`Session::greedy_cycle`]; on CUDA the logits stay on the device).
    /// Row `i`'s pick is the target's argmax after `token, d1..di`, so the accepted
    /// prefix and the token after it are the plain loop's.
    fn greedy(
        &mut self,
        session: &mut Session,
        token: u32,
        budget: usize,
        max: usize,
        stop: &[u32],
    ) -> Result<Vec<u32>> {
        session.mtp_mark();
        let hook = &mut self.hook;
        let mut propose = |pos: usize| hook.as_mut().and_then(|h| h(pos));
        let cycle = session.greedy_cycle(GreedyCycle {
            mtp: &self.mtp,
            token,
            drafts: budget,
            margin: self.opts.margin,
            propose: &mut propose,
            stop,
        });
        let cycle = match cycle {
            Ok(c) => c,
            Err(e) => {
                let _ = session.mtp_keep(0);
                return Err(e);
            }
        };
        let (out, accepted) = if cycle.drafts.is_empty() {
            // The gate stopped the first draft: the token alone.
            session.decode(token)?;
            (vec![argmax(session.logits())], 0)
        } else {
            let chosen = choose_picks(&cycle.drafts, &cycle.picks, max, stop);
            session.commit_rows(chosen.0.len())?;
            chosen
        };
        self.end_cycle(session, out, accepted, cycle.drafts.len(), cycle.runs)
    }

    /// Runs the MTP block up to `budget` times from `token` at position `n`, sampling
    /// each draft (greedy cycles go through [`Speculator::greedy`]).
    fn draft(
        &mut self,
        session: &mut Session,
        sampler: &mut Sampler,
        token: u32,
        budget: usize,
        stop: &[u32],
    ) -> Result<Drafts> {
        let n = session.n_tokens();
        session.mtp_mark();
        let mut d = Drafts::default();
        let mut prev = token;
        for i in 0..budget {
            let src = if i == 0 {
                HcSource::Last
            } else {
                HcSource::Chain
            };
            let logits = match session.mtp_draft(&self.mtp, prev, src, n + i) {
                Ok(l) => l,
                Err(e) => {
                    let _ = session.mtp_keep(0);
                    return Err(e);
                }
            };
            d.runs += 1;
            if self.opts.margin > 0.0 && top2_margin(&logits) < self.opts.margin {
                break;
            }
            let q = sampler.candidates(&logits);
            let Some(drawn) = sampler.pick(&q) else {
                break; // NaN draft logits: nothing to propose.
            };
            let q = Some(q);
            let (proposed, q) = match self.hook.as_mut().and_then(|h| h(n + i + 1)) {
                Some(t) => (t, None),
                None => (drawn, q),
            };
            d.tokens.push(proposed);
            d.q.push(q);
            if stop.contains(&proposed) {
                break;
            }
            prev = proposed;
        }
        Ok(d)
    }
}

/// The walk over a cycle's verified rows that both samplings share: drafts stand
/// until row `i` rejects one (`row(i, Some(d))` gives the token that replaces it),
/// a stop token or `max`; after every draft the last row gives one more token
/// (`row(k, None)`). Returns the tokens and the accepted drafts among them.
fn walk(
    drafts: &[u32],
    max: usize,
    stop: &[u32],
    mut row: impl FnMut(usize, Option<u32>) -> Option<u32>,
) -> (Vec<u32>, u64) {
    let mut out = Vec::with_capacity(drafts.len() + 1);
    for (i, &d) in drafts.iter().enumerate() {
        if let Some(t) = row(i, Some(d)) {
            out.push(t);
            return (out, i as u64);
        }
        out.push(d);
        if stop.contains(&d) || out.len() == max {
            let a = out.len() as u64;
            return (out, a);
        }
    }
    out.extend(row(drafts.len(), None));
    (out, drafts.len() as u64)
}

/// [`walk`] with temperature over the verify step's `rows` (`[1 + k][vocab]`): each
/// draft is verified against its row's filtered distribution (the rejection rule),
/// the last row is sampled.
fn choose(
    sampler: &mut Sampler,
    rows: &[f32],
    vocab: usize,
    d: &Drafts,
    max: usize,
    stop: &[u32],
) -> (Vec<u32>, u64) {
    walk(&d.tokens, max, stop, |i, draft| {
        let r = &rows[i * vocab..(i + 1) * vocab];
        match draft {
            Some(di) => {
                let p = sampler.candidates(r);
                verify_draft(sampler, &p, d.q[i].as_deref(), di)
            }
            None => Some(sampler.sample(r)),
        }
    })
}

/// [`walk`] at temperature 0 from the rows' argmaxes: a draft stands when it is its
/// row's pick.
fn choose_picks(drafts: &[u32], picks: &[u32], max: usize, stop: &[u32]) -> (Vec<u32>, u64) {
    walk(drafts, max, stop, |i, draft| match draft {
        Some(d) => Some(picks[i]).filter(|&p| p != d),
        None => Some(picks[i]),
    })
}

/// The top-1 − top-2 gap of raw logits (NaN ignored; infinite with fewer than two).
pub(crate) fn top2_margin(logits: &[f32]) -> f32 {
    // Vectorisable passes (a draft's whole vocabulary each cycle): the maximum, its
    // first index, then the maximum of everything else (a tie gives 0).
    let a = max_ignoring_nan(logits);
    let Some(at) = logits.iter().position(|&v| v == a) else {
        return f32::INFINITY; // every value NaN
    };
    let b = max_ignoring_nan(&logits[..at]).max(max_ignoring_nan(&logits[at + 1..]));
    if b == f32::NEG_INFINITY {
        return f32::INFINITY;
    }
    a - b
}

/// The probability of `id` in a candidate list.
fn prob(dist: &[(u32, f64)], id: u32) -> f64 {
    dist.iter().find(|c| c.0 == id).map_or(0.0, |c| c.1)
}

/// The probability of accepting draft `d` drawn from `q` (`None`: a point mass at
/// `d`) against the target `p`: `min(1, p(d)/q(d))`.
pub(crate) fn accept_prob(p: &[(u32, f64)], q: Option<&[(u32, f64)]>, d: u32) -> f64 {
    let qd = q.map_or(1.0, |q| prob(q, d));
    if qd <= 0.0 {
        return 0.0;
    }
    (prob(p, d) / qd).min(1.0)
}

/// The distribution of the token after a rejected draft: `norm(max(0, p − q))`, with
/// `q` a point mass at `d` when `None`; `p` itself if that is empty (only through
/// rounding, when rejection had probability ~0). Sorted by descending probability.
pub(crate) fn residual(p: &[(u32, f64)], q: Option<&[(u32, f64)]>, d: u32) -> Vec<(u32, f64)> {
    let q: HashMap<u32, f64> = match q {
        Some(q) => q.iter().copied().collect(),
        None => HashMap::from([(d, 1.0)]),
    };
    let mut r: Vec<(u32, f64)> = p
        .iter()
        .map(|&(id, pv)| (id, (pv - q.get(&id).copied().unwrap_or(0.0)).max(0.0)))
        .filter(|c| c.1 > 0.0)
        .collect();
    let z: f64 = r.iter().map(|c| c.1).sum();
    if z <= 0.0 {
        return p.to_vec();
    }
    for c in r.iter_mut() {
        c.1 /= z;
    }
    r.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    r
}

/// One speculative-sampling verification: `None` when `d` is accepted, else the
/// token drawn from the residual distribution.
fn verify_draft(
    sampler: &mut Sampler,
    p: &[(u32, f64)],
    q: Option<&[(u32, f64)]>,
    d: u32,
) -> Option<u32> {
    let a = accept_prob(p, q, d);
    if a >= 1.0 || sampler.uniform() < a {
        return None;
    }
    let r = residual(p, q, d);
    Some(sampler.pick(&r).unwrap_or(d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplerConfig;

    /// The output distribution of one verification of a draft drawn from `q`
    /// (`None`: every draft in `drafts` as a point mass, weighted by `w`), exactly.
    fn output(p: &[(u32, f64)], q: Option<&[(u32, f64)]>, drafts: &[(u32, f64)]) -> Vec<f64> {
        let mut out = vec![0.0; 8];
        for &(d, w) in drafts {
            let a = accept_prob(p, q, d);
            out[d as usize] += w * a;
            for (x, r) in residual(p, q, d) {
                out[x as usize] += w * (1.0 - a) * r;
            }
        }
        out
    }

    fn dist(v: &[f64]) -> Vec<(u32, f64)> {
        let z: f64 = v.iter().sum();
        v.iter()
            .enumerate()
            .filter(|c| *c.1 > 0.0)
            .map(|(i, &x)| (i as u32, x / z))
            .collect()
    }

    fn assert_is(got: &[f64], p: &[(u32, f64)]) {
        for (x, &g) in got.iter().enumerate() {
            let want = prob(p, x as u32);
            assert!((g - want).abs() < 1e-12, "token {x}: {g} vs {want}");
        }
    }

    #[test]
    fn rejection_sampling_gives_exactly_the_target_distribution() {
        let p = dist(&[0.4, 0.3, 0.2, 0.1, 0.0, 0.0]);
        // q: overlapping, disjoint support (token 4 not in p), equal to p, a point mass.
        for qv in [
            vec![0.1, 0.1, 0.5, 0.2, 0.1],
            vec![0.0, 0.0, 0.0, 0.0, 0.5, 0.5],
            vec![0.4, 0.3, 0.2, 0.1],
            vec![0.0, 1.0],
        ] {
            let q = dist(&qv);
            assert_is(&output(&p, Some(&q), &q), &p);
            // The same draws verified as point masses (hooked proposals).
            assert_is(&output(&p, None, &q), &p);
        }
    }

    #[test]
    fn verify_draft_samples_the_target_distribution() {
        let p = dist(&[0.5, 0.3, 0.15, 0.05]);
        let q = dist(&[0.1, 0.2, 0.3, 0.4]);
        let mut s = Sampler::new(SamplerConfig {
            seed: 99,
            ..Default::default()
        });
        let n = 100_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            let d = s.pick(&q).unwrap();
            let t = verify_draft(&mut s, &p, Some(&q), d).unwrap_or(d);
            counts[t as usize] += 1;
        }
        let tv: f64 = counts
            .iter()
            .enumerate()
            .map(|(x, &c)| (c as f64 / n as f64 - prob(&p, x as u32)).abs())
            .sum::<f64>()
            / 2.0;
        // The standard error of each share is ≤ 0.0016: a biased rule (q itself has
        // TV 0.4 from p) could not get this close.
        assert!(tv < 0.006, "TV {tv}, counts {counts:?}");
    }

    /// The greedy walk over a cycle's picks: accepted drafts, then the first pick that
    /// differs or the last row's; cut at a stop token or `max`.
    #[test]
    fn choose_picks_walks_the_drafts_like_the_plain_loop() {
        // Every draft accepted: the drafts and the last row's pick.
        assert_eq!(
            choose_picks(&[5, 6], &[5, 6, 7], 9, &[]),
            (vec![5, 6, 7], 2)
        );
        // Rejected at the second draft: its row's pick replaces it.
        assert_eq!(choose_picks(&[5, 6], &[5, 8, 7], 9, &[]), (vec![5, 8], 1));
        // Rejected at once.
        assert_eq!(choose_picks(&[5], &[4, 7], 9, &[]), (vec![4], 0));
        // An accepted stop token ends the cycle without the next pick.
        assert_eq!(choose_picks(&[5, 6], &[5, 6, 7], 9, &[5]), (vec![5], 1));
        // A stop token after a rejection is never reached.
        assert_eq!(choose_picks(&[5, 6], &[4, 6, 7], 9, &[6]), (vec![4], 0));
        // `max` cuts after the accepted drafts.
        assert_eq!(choose_picks(&[5, 6], &[5, 6, 7], 2, &[]), (vec![5, 6], 2));
    }

    #[test]
    fn margin_is_top1_minus_top2() {
        assert_eq!(top2_margin(&[1.0, 4.0, 2.5, f32::NAN]), 1.5);
        assert_eq!(top2_margin(&[3.0, 3.0]), 0.0);
        assert_eq!(top2_margin(&[3.0]), f32::INFINITY);
        assert_eq!(top2_margin(&[f32::NAN, f32::NAN]), f32::INFINITY);
        // Past the vector lanes: the runner-up before and after the maximum.
        let mut v: Vec<f32> = (0..40).map(|i| i as f32 / 100.0).collect();
        v[37] = 9.0;
        v[3] = 7.5;
        assert_eq!(top2_margin(&v), 1.5);
        v[39] = 8.0;
        assert_eq!(top2_margin(&v), 1.0);
    }

    #[test]
    fn stats_ratios() {
        let s = SpecStats {
            cycles: 4,
            drafted: 8,
            accepted: 6,
            emitted: 10,
        };
        assert_eq!(s.tokens_per_cycle(), 2.5);
        assert_eq!(s.acceptance(), 0.75);
        assert_eq!(SpecStats::default().tokens_per_cycle(), 0.0);
        assert_eq!(SpecStats::default().acceptance(), 0.0);
    }
}
