//! The timed decode variants of one frontier beside the plain greedy decode: `--rows R`
//! (multi-row steps) and, in `spec.rs`, the MTP speculative loop. Each starts from the
//! frontier's snapshot and yields one CSV row.

use std::time::Instant;

use anyhow::Result;
use ds4_engine::{argmax, argmax_skip, Sampler, SamplerConfig, Session};
use ds4_synth::Rng;

use crate::plot::BenchRow;

/// The greedy pick of the benchmark: the argmax over every token but EOS (random weights
/// would otherwise end some runs early). The device's pick in [`decode_greedy`] leaves
/// EOS out the same way.
pub fn pick(logits: &[f32], eos: u32) -> u32 {
    argmax_skip(logits, Some(eos))
}

/// What one timed run measured: `cycles` steps that emitted `tokens` in `secs`.
pub struct Timed {
    pub cycles: u64,
    pub tokens: u64,
    pub secs: f64,
}

impl Timed {
    /// The CSV row of this run at a frontier whose prefill columns are `base`'s.
    pub fn row(&self, base: &BenchRow, rows: u64) -> BenchRow {
        let tps = self.tokens as f64 / self.secs.max(1e-9);
        BenchRow {
            gen_tokens: self.tokens,
            gen_tps: tps,
            rows,
            ms_per_cycle: 1e3 * self.secs / self.cycles.max(1) as f64,
            tokens_per_cycle: self.tokens as f64 / self.cycles.max(1) as f64,
            effective_tps: tps,
            ..base.clone()
        }
    }
}

/// Decodes one untimed greedy non-EOS token, then `n` more; returns the timing and the
/// `n + 1` tokens decoded (the greedy continuation of the frontier). The untimed one
/// carries the session's one-off decode costs (on CUDA: capturing the decode graph and
/// the first loads of its kernels, ~10–30 ms on an H200), which would otherwise be
/// charged to the first frontier's rate. The tokens go through
/// [`Session::greedy_run`], as `ds4 --temp 0` does: on CUDA the picks are made on the
/// device and each token's graph is launched before the host has seen the previous
/// token, so the timing holds no host round trips between tokens.
pub fn decode_greedy(session: &mut Session, n: usize, eos: u32) -> Result<(Timed, Vec<u32>)> {
    let first = pick(session.logits(), eos);
    timed_run(first, n, &mut |t, max, on_pick| {
        Ok(session.greedy_run(t, max, Some(eos), on_pick)?)
    })
}

/// [`decode_greedy`] with sampled tokens (`--temp`): ds4's default sampler at
/// temperature `temp`, through [`Session::sample_run`] as `ds4` generates at its
/// defaults (on CUDA the device samples, one token ahead of the host). A sampled EOS
/// is decoded as any other token (a benchmark's run does not stop).
pub fn decode_sampled(
    session: &mut Session,
    n: usize,
    temp: f32,
    seed: u64,
) -> Result<(Timed, Vec<u32>)> {
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: temp,
        seed,
        ..SamplerConfig::default()
    });
    let first = sampler.sample(session.logits());
    timed_run(first, n, &mut |t, max, on_pick| {
        Ok(session.sample_run(t, max, &mut sampler, on_pick)?)
    })
}

/// A session's pick run from a token: `greedy_run` or `sample_run` as
/// `run(first, max, on_pick)`.
type PickRun<'a> = dyn FnMut(u32, usize, &mut dyn FnMut(u32) -> bool) -> Result<()> + 'a;

/// A pick run from `first`: one untimed pick, then `n` timed ones; the timing and the
/// `n + 1` tokens decoded.
fn timed_run(first: u32, n: usize, run: &mut PickRun<'_>) -> Result<(Timed, Vec<u32>)> {
    let mut next = first;
    run(first, 1, &mut |p| {
        next = p;
        true
    })?;
    let mut picks = Vec::with_capacity(n);
    let t = Instant::now();
    run(next, n, &mut |p| {
        picks.push(p);
        true
    })?;
    let secs = t.elapsed().as_secs_f64();
    // Decoded: `first`, `next` and every pick but the last (the run's budget).
    let mut tokens = vec![first];
    if n > 0 {
        tokens.push(next);
        tokens.extend_from_slice(&picks[..n - 1]);
    }
    let timed = Timed {
        cycles: n as u64,
        tokens: n as u64,
        secs,
    };
    Ok((timed, tokens))
}

/// `--rows R`: cycles of `step_rows` over R tokens and `commit_rows(R)`, as many as emit
/// at least `n` tokens, after one untimed cycle (on CUDA it captures the R-row graph).
/// A step cannot feed a row's argmax to the next row (all rows run at once), so each
/// cycle's rows are the previous step's greedy non-EOS pick followed by R − 1 tokens
/// drawn from a generator seeded with `seed` and R: the same work as a verify step whose
/// drafts are all accepted.
pub fn time_rows(session: &mut Session, r: usize, n: usize, eos: u32, seed: u64) -> Result<Timed> {
    let vocab = session.vocab() as u64;
    let mut rng = Rng::stream(seed, 11, r as u64);
    let mut cycle = |session: &mut Session| -> Result<()> {
        let mut rows = Vec::with_capacity(r);
        rows.push(pick(session.logits(), eos));
        rows.extend((1..r).map(|_| rng.below(vocab) as u32));
        session.step_rows(&rows)?;
        session.commit_rows(r)?;
        Ok(())
    };
    cycle(session)?;
    let cycles = n.div_ceil(r);
    let t = Instant::now();
    for _ in 0..cycles {
        cycle(session)?;
    }
    Ok(Timed {
        cycles: cycles as u64,
        tokens: (cycles * r) as u64,
        secs: t.elapsed().as_secs_f64(),
    })
}

/// `--sessions N`: N copies of the frontier's session decode together, one token each
/// per batched step (`Session::decode_batch`: on CUDA one pass over the weights for all
/// rows), `n` steps after one untimed step (it captures the N-row graph). Each row's
/// token is drawn from a generator seeded with `seed` and N, so the rows route to
/// different experts as distinct conversations would. Before timing, the first rows'
/// logits of one step are compared with the same sessions decoding alone; the line
/// returned says how far apart they are.
pub fn time_sessions(
    snapshot: &Session,
    sessions: usize,
    n: usize,
    seed: u64,
) -> Result<(Timed, String)> {
    let vocab = snapshot.vocab() as u64;
    let mut rng = Rng::stream(seed, 13, sessions as u64);
    let mut all = (0..sessions)
        .map(|_| snapshot.try_clone())
        .collect::<Result<Vec<Session>, _>>()?;
    let step = |all: &mut [Session], toks: &[u32]| -> Result<()> {
        let mut rows: Vec<(&mut Session, u32)> = all.iter_mut().zip(toks.iter().copied()).collect();
        for r in Session::decode_batch(&mut rows) {
            r?;
        }
        Ok(())
    };
    // The check: the first rows against copies decoding alone.
    let toks: Vec<u32> = (0..sessions).map(|_| rng.below(vocab) as u32).collect();
    let checked = sessions.min(4);
    let mut alone = all[..checked]
        .iter()
        .map(Session::try_clone)
        .collect::<Result<Vec<Session>, _>>()?;
    step(&mut all, &toks)?;
    let (mut max, mut flips) = (0.0f32, 0);
    for (i, a) in alone.iter_mut().enumerate() {
        a.decode(toks[i])?;
        let (x, y) = (all[i].logits(), a.logits());
        max = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(max, f32::max);
        flips += usize::from(argmax(x) != argmax(y));
    }
    drop(alone);
    let check = format!(
        "batched rows against decoding alone ({checked} rows): max |Δlogit| {max:.3e}, {flips} greedy tokens differ"
    );
    let mut next = || -> Vec<u32> { (0..sessions).map(|_| rng.below(vocab) as u32).collect() };
    let t = Instant::now();
    for _ in 0..n {
        let toks = next();
        step(&mut all, &toks)?;
    }
    let secs = t.elapsed().as_secs_f64();
    Ok((
        Timed {
            cycles: n as u64,
            tokens: (n * sessions) as u64,
            secs,
        },
        check,
    ))
}
