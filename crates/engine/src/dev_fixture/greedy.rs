//! [`Session::greedy_run`] against the plain greedy loop (`decode(t); t = argmax`) on
//! sessions of one backend: the same picks, the same tokens held, bit-identical logits
//! after a run that ended at its budget, after one that a refused pick ended (that pick
//! decoded too) and resumed, and with a token left out of every pick. The CPU runs it in
//! the engine's tests (the trait's default), the CUDA backend in `gpu-selftest` (the
//! picks made on the device, one token ahead).

use anyhow::{ensure, Result};

use crate::{argmax_skip, Sampler, SamplerConfig, Session};

/// The plain loop from `s`'s logits: decodes `n` picks (`skip` left out of each) and
/// returns the `n + 1` picks.
fn plain(s: &mut Session, n: usize, skip: Option<u32>) -> Result<Vec<u32>> {
    let mut picks = vec![argmax_skip(s.logits(), skip)];
    for _ in 0..n {
        s.decode(*picks.last().expect("one pick"))?;
        picks.push(argmax_skip(s.logits(), skip));
    }
    Ok(picks)
}

fn same_state(got: &Session, want: &Session, what: &str) -> Result<()> {
    ensure!(
        got.tokens() == want.tokens(),
        "{what}: holds {} tokens, the plain loop {} (or other ids)",
        got.tokens().len(),
        want.tokens().len()
    );
    let same = got
        .logits()
        .iter()
        .zip(want.logits())
        .all(|(a, b)| a.to_bits() == b.to_bits());
    ensure!(
        same && got.logits().len() == want.logits().len(),
        "{what}: logits differ from the plain loop's"
    );
    Ok(())
}

/// `s.greedy_run(first, max, skip, …)`; returns the picks delivered. `refuse`: the
/// pick (counted from 1) that `on_pick` refuses, else none.
fn run(
    s: &mut Session,
    (first, max, skip): (u32, usize, Option<u32>),
    refuse: Option<usize>,
) -> Result<Vec<u32>> {
    let mut got = Vec::new();
    s.greedy_run(first, max, skip, &mut |p| {
        got.push(p);
        Some(got.len()) != refuse
    })?;
    Ok(got)
}

/// A run to its budget (`n` picks delivered, the last not decoded) against the plain
/// loop, each on a session from `fresh`; returns the plain session and its picks.
fn budget_run(
    fresh: &mut dyn FnMut() -> Result<Session>,
    n: usize,
    skip: Option<u32>,
    what: &str,
) -> Result<(Session, Vec<u32>)> {
    let mut base = fresh()?;
    let want = plain(&mut base, n, skip)?;
    let mut s = fresh()?;
    let got = run(&mut s, (want[0], n, skip), None)?;
    ensure!(
        got == want[1..],
        "{what}: picks differ from the plain loop's"
    );
    same_state(&s, &base, what)?;
    Ok((base, want))
}

/// The check on sessions from `fresh` (each already holding the same prompt), over
/// `n` ≥ 12 picks. `Ok(())` or the first difference as an error.
pub fn greedy_run_identity(fresh: &mut dyn FnMut() -> Result<Session>, n: usize) -> Result<()> {
    ensure!(n >= 12, "greedy_run_identity needs at least 12 picks");
    let (base, want) = budget_run(fresh, n, None, "budget run")?;

    // Refused at pick 5 (decoded all the same), resumed, refused at pick 3 of the
    // second run, then the plain loop to the end.
    let mut s = fresh()?;
    let got = run(&mut s, (want[0], n, None), Some(5))?;
    ensure!(got == want[1..6], "refused run: picks differ");
    ensure!(
        s.tokens().len() == base.tokens().len() - n + 6,
        "refused run: the refused pick was not decoded"
    );
    let got = run(&mut s, (want[6], n - 6, None), Some(3))?;
    ensure!(got == want[7..10], "resumed run: picks differ");
    while s.tokens().len() < base.tokens().len() {
        let t = argmax_skip(s.logits(), None);
        s.decode(t)?;
    }
    same_state(&s, &base, "resumed run, then plain decode")?;

    // A token left out: the first plain pick, so the run differs from the one above.
    budget_run(fresh, n, Some(want[1]), "run with a token left out")?;
    Ok(())
}

/// The samplers the sampled-run checks use (the CPU's in CI, the device's in
/// `gpu-selftest`): a flat one (many distinct tokens) and every filter at once.
pub fn run_samplers() -> [SamplerConfig; 2] {
    [
        SamplerConfig {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 5,
        },
        SamplerConfig {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.02,
            seed: 9,
        },
    ]
}

/// [`Session::sample_run`] against the plain sampled loop (`decode(t); t =
/// sampler.sample(logits())`) with samplers of `cfg` on sessions from `fresh`: the same
/// picks and state after a run to its budget, and after a run that a refused pick
/// ended, resumed by the plain loop — which also checks that the sampler's stream
/// stands where the plain loop's does (the draw of the pick never delivered given
/// back). `n` ≥ 12.
pub fn sample_run_identity(
    fresh: &mut dyn FnMut() -> Result<Session>,
    n: usize,
    cfg: &SamplerConfig,
) -> Result<()> {
    ensure!(n >= 12, "sample_run_identity needs at least 12 picks");
    ensure!(cfg.temperature > 0.0, "sample_run_identity samples");
    let mut base = fresh()?;
    let mut a = Sampler::new(cfg.clone());
    let mut want = vec![a.sample(base.logits())];
    // Picks that are not the argmax: a check that samples.
    let mut off_argmax = usize::from(want[0] != argmax_skip(base.logits(), None));
    for _ in 0..n {
        base.decode(*want.last().expect("one pick"))?;
        let t = a.sample(base.logits());
        off_argmax += usize::from(t != argmax_skip(base.logits(), None));
        want.push(t);
    }
    ensure!(
        off_argmax > 0,
        "every pick of {cfg:?} was the argmax: the check would not see sampling"
    );
    let distinct = {
        let mut v = want.clone();
        v.sort_unstable();
        v.dedup();
        v.len()
    };

    let mut s = fresh()?;
    let mut b = Sampler::new(cfg.clone());
    let first = b.sample(s.logits());
    ensure!(first == want[0], "the first pick differs");
    let mut got = Vec::new();
    s.sample_run(first, n, &mut b, &mut |p| {
        got.push(p);
        true
    })?;
    ensure!(
        got == want[1..],
        "budget run: picks differ from the plain loop's ({distinct} distinct tokens)"
    );
    same_state(&s, &base, "budget run")?;
    ensure!(
        b.uniform() == a.uniform(),
        "budget run: the sampler's stream is not the plain loop's"
    );

    // Refused at pick 5 (decoded all the same), then the plain loop to the end.
    let mut s = fresh()?;
    let mut c = Sampler::new(cfg.clone());
    let first = c.sample(s.logits());
    let mut got = Vec::new();
    s.sample_run(first, n, &mut c, &mut |p| {
        got.push(p);
        got.len() < 5
    })?;
    ensure!(got == want[1..6], "refused run: picks differ");
    while s.tokens().len() < base.tokens().len() {
        let t = c.sample(s.logits());
        let i = s.tokens().len() - (base.tokens().len() - n);
        ensure!(t == want[i], "after the refused run: pick {i} differs");
        s.decode(t)?;
    }
    same_state(&s, &base, "refused run, then the plain loop")?;
    Ok(())
}
