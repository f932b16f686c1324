//! Speculative decoding (#20 item 2, `Speculator`): on the tiny fixture model (6 layers:
//! ratio 0, 4 and 128, a 16-token window) with a synthetic MTP file made for it in
//! memory. Greedy output and the session state afterwards must equal the plain loop's
//! bit for bit (Exact numerics); temperature sampling must keep the target
//! distribution; the margin gate, stop tokens and the `max` budget must cut cycles
//! where the contract says; the MTP ring must rewind exactly.
//!
//! Random MTP weights accept ~nothing, so most tests also propose drafts through the
//! draft hook: the true next greedy tokens (from a plain reference run) with some
//! probability, so that full accepts, partial accepts and rejects all happen.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use common::{load, tokens};
use ds4_engine::dev::layout::ExpertQuant;
use ds4_engine::dev::{Backend, CpuBackend, HcSource, LogitRows, Model, SessionExt};
use ds4_engine::{
    generate, Mtp, Numerics, Sampler, SamplerConfig, Session, SessionOptions, SpecOptions,
    SpecStats, Speculator,
};
use ds4_gguf::GgufFile;
use ds4_synth::Plan;

/// Generated tokens of the identity runs: the 512.
const N_GEN: usize = 512;

fn model() -> Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load("q2", Numerics::Exact)).clone()
}

/// A synthetic MTP file matching the fixture model, built once in memory.
fn mtp() -> Mtp {
    static F: OnceLock<Arc<GgufFile>> = OnceLock::new();
    let file = F.get_or_init(|| {
        let plan = Plan::mtp(model().config().clone(), ExpertQuant::Q4, "spec test").unwrap();
        Arc::new(GgufFile::from_bytes(plan.build(21, &|_| {})).unwrap())
    });
    Mtp::from_gguf(&model(), file.clone()).unwrap()
}

fn prompt() -> Vec<u32> {
    tokens("b")[..24].to_vec()
}

fn session() -> Session {
    let ctx = prompt().len() + N_GEN + 8;
    Session::with_options(&model(), SessionOptions::new(ctx)).unwrap()
}

fn greedy() -> Sampler {
    Sampler::new(SamplerConfig::greedy())
}

/// The plain loop: `n` tokens after the prompt, and the session afterwards.
fn plain(n: usize, stop: &[u32]) -> (Vec<u32>, Session) {
    let mut s = session();
    s.prefill(&prompt()).unwrap();
    let (out, _) = generate(&mut s, &mut greedy(), n, stop).unwrap();
    (out, s)
}

fn reference() -> &'static (Vec<u32>, ds4_engine::SessionState) {
    static R: OnceLock<(Vec<u32>, ds4_engine::SessionState)> = OnceLock::new();
    R.get_or_init(|| {
        let (out, s) = plain(N_GEN, &[]);
        (out, s.export_state().unwrap())
    })
}

/// Per-cycle outcomes: (full accepts, partial accepts, rejects) of cycles with drafts.
#[derive(Debug, Default)]
struct Outcomes {
    full: usize,
    partial: usize,
    rejected: usize,
    /// The run ended on a stop token that was an accepted draft.
    stopped_in_drafts: bool,
}

/// The speculative loop like `generate`: the first token from the prompt's logits,
/// then `advance` until `n` tokens or a stop token; `cap` bounds each call's `max`.
fn speculate(
    spec: &mut Speculator,
    sampler: &mut Sampler,
    n: usize,
    cap: usize,
    stop: &[u32],
) -> (Vec<u32>, Session, Outcomes) {
    let mut s = session();
    s.prefill(&prompt()).unwrap();
    let mut out = vec![sampler.sample(s.logits())];
    let mut o = Outcomes::default();
    while out.len() < n && !stop.contains(out.last().unwrap()) {
        let before = spec.stats();
        let max = (n - out.len()).min(cap);
        let got = spec
            .advance(&mut s, sampler, *out.last().unwrap(), max, stop)
            .unwrap();
        assert!(
            !got.is_empty() && got.len() <= max,
            "{} of max {max}",
            got.len()
        );
        let stop_at = got.iter().position(|t| stop.contains(t));
        assert!(
            stop_at.is_none_or(|i| i + 1 == got.len()),
            "tokens after a stop"
        );
        let after = spec.stats();
        let (d, a) = (
            after.drafted - before.drafted,
            after.accepted - before.accepted,
        );
        match (d, a) {
            (0, _) => {}
            (d, a) if a == d => o.full += 1,
            (_, 0) => o.rejected += 1,
            _ => o.partial += 1,
        }
        o.stopped_in_drafts = stop_at.is_some() && a as usize == got.len();
        out.extend(got);
    }
    (out, s, o)
}

/// A hook proposing the reference's greedy token at the position with probability
/// `p_true` (else a wrong token), deterministic per `seed`.
fn truth_hook(p_true: f64, seed: u64) -> Box<dyn FnMut(usize) -> Option<u32> + Send> {
    let truth = reference().0.clone();
    let p0 = prompt().len();
    let mut x = seed;
    Box::new(move |pos| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        // Past the plain run's tokens: the MTP's own draft.
        let t = truth.get(pos - p0).copied()?;
        Some(if u < p_true {
            t
        } else {
            (t + 1 + (x % 7) as u32) % 512
        })
    })
}

fn speculator(draft: usize, margin: f32) -> Speculator {
    Speculator::new(mtp(), SpecOptions { draft, margin }).unwrap()
}

/// Greedy output and the final state with `draft` tokens a cycle equal the plain
/// loop's over [`N_GEN`] tokens, with the margin gate off and at its default.
fn greedy_identity(draft: usize) {
    let (want, want_state) = reference();
    for margin in [0.0, SpecOptions::default().margin] {
        let mut spec = speculator(draft, margin);
        let (got, s, _) = speculate(&mut spec, &mut greedy(), N_GEN, usize::MAX, &[]);
        let st = spec.stats();
        let what = format!("draft {draft}, margin {margin}: {st:?}");
        assert_eq!(&got, want, "{what}");
        assert_eq!(&s.export_state().unwrap(), want_state, "{what}");
        assert_eq!(st.emitted as usize, N_GEN - 1, "{what}");
        if margin == 0.0 {
            // Every cycle but the last (`max` 1) drafts.
            assert!(st.drafted + 1 >= st.cycles, "{what}");
        }
    }
}

#[test]
fn greedy_identity_draft_1() {
    greedy_identity(1);
}

#[test]
fn greedy_identity_draft_2() {
    greedy_identity(2);
}

#[test]
fn greedy_identity_draft_4() {
    greedy_identity(4);
}

/// [`greedy_identity`] with drafts that are the true next tokens 75% of the time:
/// full accepts, partial accepts (draft > 1) and rejects all happen.
fn hooked_identity(draft: usize) {
    let (want, want_state) = reference();
    let mut spec = speculator(draft, 0.0);
    spec.set_draft_hook(truth_hook(0.75, draft as u64));
    let (got, s, o) = speculate(&mut spec, &mut greedy(), N_GEN, usize::MAX, &[]);
    let st: SpecStats = spec.stats();
    let what = format!("draft {draft}: {st:?}, {o:?}");
    assert_eq!(&got, want, "{what}");
    assert_eq!(&s.export_state().unwrap(), want_state, "{what}");
    assert!(st.accepted > 0 && o.full > 0 && o.rejected > 0, "{what}");
    if draft > 1 {
        assert!(o.partial > 0, "{what}");
    }
    assert!(st.tokens_per_cycle() > 1.2, "{what}");
}

#[test]
fn hooked_identity_draft_1() {
    hooked_identity(1);
}

#[test]
fn hooked_identity_draft_2() {
    hooked_identity(2);
}

#[test]
fn hooked_identity_draft_4() {
    hooked_identity(4);
}

#[test]
fn the_margin_gate_stops_drafting() {
    let (want, want_state) = reference();
    let n = 96;
    // No MTP logits have a top-2 gap this wide: every cycle is a plain decode.
    let mut spec = speculator(4, 1e9);
    spec.set_draft_hook(truth_hook(1.0, 1));
    let (got, s, _) = speculate(&mut spec, &mut greedy(), n, usize::MAX, &[]);
    assert_eq!(got, want[..n]);
    let st = spec.stats();
    assert_eq!((st.drafted, st.accepted), (0, 0), "{st:?}");
    assert_eq!(st.cycles, st.emitted);
    // The same with the gate off drafts and accepts.
    let mut spec = speculator(4, 0.0);
    spec.set_draft_hook(truth_hook(1.0, 1));
    let (got, s2, _) = speculate(&mut spec, &mut greedy(), n, usize::MAX, &[]);
    assert_eq!(got, want[..n]);
    assert!(spec.stats().tokens_per_cycle() > 4.0, "{:?}", spec.stats());
    assert_eq!(s.export_state().unwrap(), s2.export_state().unwrap());
    assert_eq!(s.n_tokens(), want_state.tokens().len() - (N_GEN - n));
}

#[test]
fn a_stop_token_ends_the_cycle_undecoded_even_among_accepted_drafts() {
    let want = &reference().0;
    let mut in_drafts = 0;
    // Stop tokens first seen at several offsets, so that they fall on every slot of a
    // 4-draft cycle (and on the bonus token).
    for j in 2..16 {
        let stop = [want[j]];
        if want[..j].contains(&stop[0]) {
            continue;
        }
        let (plain_out, plain_s) = plain(N_GEN, &stop);
        assert_eq!(plain_out, want[..=j]);
        let mut spec = speculator(4, 0.0);
        spec.set_draft_hook(truth_hook(1.0, j as u64));
        let (got, s, o) = speculate(&mut spec, &mut greedy(), N_GEN, usize::MAX, &stop);
        assert_eq!(got, plain_out, "stop at {j}");
        assert_eq!(s.export_state().unwrap(), plain_s.export_state().unwrap());
        in_drafts += o.stopped_in_drafts as usize;
    }
    assert!(in_drafts > 0, "no stop token fell among accepted drafts");
}

#[test]
fn max_bounds_each_cycle() {
    let (want, want_state) = reference();
    for cap in [1, 2] {
        let mut spec = speculator(4, 0.0);
        spec.set_draft_hook(truth_hook(1.0, 3));
        let (got, s, _) = speculate(&mut spec, &mut greedy(), N_GEN, cap, &[]);
        assert_eq!(&got, want, "max {cap}");
        assert_eq!(&s.export_state().unwrap(), want_state, "max {cap}");
        let st = spec.stats();
        if cap == 1 {
            assert_eq!(st.drafted, 0, "{st:?}");
        } else {
            // One draft per cycle (max 2), all accepted: two tokens a cycle.
            assert_eq!(st.drafted, st.cycles - 1, "{st:?}");
            assert_eq!(st.accepted, st.drafted, "{st:?}");
        }
    }
    let mut spec = speculator(1, 0.0);
    let mut s = session();
    s.prefill(&prompt()).unwrap();
    assert!(spec.advance(&mut s, &mut greedy(), 1, 0, &[]).is_err());
    assert_eq!(s.n_tokens(), prompt().len());
}

#[test]
fn after_an_import_the_loop_regrows_its_draft_state() {
    let want = &reference().0;
    let n = 160;
    let mut spec = speculator(2, 0.0);
    spec.set_draft_hook(truth_hook(0.8, 5));
    let mut sampler = greedy();
    let (mut out, s, _) = speculate(&mut spec, &mut sampler, 80, usize::MAX, &[]);
    // Into a fresh session: no HC state, no MTP ring — the next cycle decodes plainly.
    let mut t = session();
    t.import_state(s.export_state().unwrap()).unwrap();
    let before = spec.stats();
    let got = spec
        .advance(&mut t, &mut sampler, *out.last().unwrap(), 8, &[])
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(spec.stats().drafted, before.drafted);
    out.extend(got);
    while out.len() < n {
        let max = n - out.len();
        out.extend(
            spec.advance(&mut t, &mut sampler, *out.last().unwrap(), max, &[])
                .unwrap(),
        );
    }
    assert_eq!(out, want[..n]);
    assert!(spec.stats().drafted > before.drafted);
    let (_, plain_s) = plain(n, &[]);
    assert_eq!(t.export_state().unwrap(), plain_s.export_state().unwrap());
}

/// Probabilities (or counts) of token pairs.
type Pairs<T> = BTreeMap<(u32, u32), T>;

/// The exact joint distribution of the two tokens after `t0` in the plain loop, and
/// the empirical one of the speculative loop over `seeds` (each a fresh sampler).
fn two_token_distributions(
    cfg: &SamplerConfig,
    spec: &mut Speculator,
    seeds: u64,
) -> (Pairs<f64>, Pairs<usize>) {
    let mut base = session();
    base.prefill(&prompt()).unwrap();
    // The caller's token: the greedy one (any token would do).
    let t0 = ds4_engine::argmax(base.logits());
    let sampler = Sampler::new(cfg.clone());
    let mut exact = BTreeMap::new();
    let mut s1 = base.try_clone().unwrap();
    s1.decode(t0).unwrap();
    for (t1, p1) in sampler.candidates(s1.logits()) {
        let mut s2 = s1.try_clone().unwrap();
        s2.decode(t1).unwrap();
        for (t2, p2) in sampler.candidates(s2.logits()) {
            exact.insert((t1, t2), p1 * p2);
        }
    }
    let mut seen = BTreeMap::new();
    for seed in 0..seeds {
        let mut s = base.try_clone().unwrap();
        let mut sampler = Sampler::new(SamplerConfig {
            seed,
            ..cfg.clone()
        });
        let mut got = spec.advance(&mut s, &mut sampler, t0, 2, &[]).unwrap();
        if got.len() == 1 {
            got.extend(spec.advance(&mut s, &mut sampler, got[0], 1, &[]).unwrap());
        }
        *seen.entry((got[0], got[1])).or_insert(0) += 1;
    }
    (exact, seen)
}

/// Pearson's chi-square of `seen` against `exact` (an unexpected pair fails at once).
fn chi_square(exact: &Pairs<f64>, seen: &Pairs<usize>) -> f64 {
    let n: usize = seen.values().sum();
    for k in seen.keys() {
        assert!(exact.contains_key(k), "{k:?} cannot be sampled");
    }
    exact
        .iter()
        .map(|(k, &p)| {
            let e = p * n as f64;
            let o = *seen.get(k).unwrap_or(&0) as f64;
            (o - e) * (o - e) / e
        })
        .sum()
}

/// The two tokens after the caller's token, sampled at temperature 1 from the top 3
/// with and without speculation (draft 2), must have the same distribution.
fn sampling_keeps_the_target_distribution(hooked: bool) {
    let cfg = SamplerConfig {
        temperature: 1.0,
        top_k: 3,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
    };
    let mut spec = speculator(2, 0.0);
    if hooked {
        // Point-mass proposals: one of the target's top 3 for the first token, or the
        // MTP's own draft.
        let mut s = session();
        s.prefill(&prompt()).unwrap();
        s.decode(ds4_engine::argmax(s.logits())).unwrap();
        let first = Sampler::new(cfg.clone());
        let cands: Vec<u32> = first.candidates(s.logits()).iter().map(|c| c.0).collect();
        let mut i = 0u32;
        spec.set_draft_hook(Box::new(move |_| {
            i += 1;
            match i % 4 {
                0 => None,
                k => cands.get(k as usize - 1).copied(),
            }
        }));
    }
    let (exact, seen) = two_token_distributions(&cfg, &mut spec, 500);
    let chi2 = chi_square(&exact, &seen);
    let st = spec.stats();
    let what = format!("hooked {hooked}: chi² {chi2:.2}, {st:?}, {seen:?} vs {exact:?}");
    // ≤ 8 degrees of freedom: 26.1 is the 0.1% critical value (the seeds are fixed,
    // so the test is deterministic).
    assert!(chi2 < 26.1, "{what}");
    assert!(exact.len() > 3, "{what}");
    assert!(st.drafted > 0 && st.accepted < st.drafted, "{what}");
    if hooked {
        assert!(st.accepted > 0, "{what}");
    }
}

/// The MTP's own draft distribution (random weights: it disagrees with the target
/// almost always, so every draft goes through the rejection and residual draw).
#[test]
fn sampling_with_mtp_drafts_keeps_the_target_distribution() {
    sampling_keeps_the_target_distribution(false);
}

/// Hooked point-mass proposals that are right about a third of the time: accepts and
/// rejects both happen.
#[test]
fn sampling_with_hooked_drafts_keeps_the_target_distribution() {
    sampling_keeps_the_target_distribution(true);
}

/// The CPU backend's MTP ring: `mtp_keep(n)` after `k` drafts leaves exactly the ring
/// of a backend that drafted only the first `n` — across the 16-row ring's wrap.
#[test]
fn mtp_keep_rewinds_the_ring_exactly() {
    let (m, mtp) = (model(), mtp());
    let mut a = CpuBackend::new(&m, 256, Numerics::Exact);
    assert!(a.mtp_state().is_none());
    a.forward(&prompt(), LogitRows::None).unwrap();
    let mut b = a.clone();
    let mut pos = prompt().len();
    // (drafts, kept): 40 rows kept in all, past the ring's capacity twice.
    let cycles = [
        (4, 2),
        (3, 3),
        (4, 0),
        (1, 1),
        (5, 5),
        (6, 1),
        (16, 9),
        (2, 2),
        (8, 4),
        (3, 1),
        (5, 3),
        (7, 7),
        (2, 2),
    ];
    let tok = |c: usize, i: usize| (10 + 37 * c + 11 * i) as u32 % 512;
    for (c, &(k, keep)) in cycles.iter().enumerate() {
        for (be, n) in [(&mut a, k), (&mut b, keep)] {
            be.mtp_mark();
            for i in 0..n {
                let src = if i == 0 {
                    HcSource::Last
                } else {
                    HcSource::Chain
                };
                be.mtp_draft(&mtp, tok(c, i), src, pos + i).unwrap();
            }
            be.mtp_keep(keep).unwrap();
        }
        assert_eq!(
            a.mtp_state(),
            b.mtp_state(),
            "cycle {c}: {k} drafts, {keep} kept"
        );
        // The main model moves on too (the next cycle's HcSource::Last).
        let adv = [tok(c, 0)];
        a.forward(&adv, LogitRows::None).unwrap();
        b.forward(&adv, LogitRows::None).unwrap();
        pos += 1;
    }
    let ring = a.mtp_state().unwrap();
    assert_eq!(ring.n_raw(), ring.capacity());
    // Keeping more than ran is refused and changes nothing; the mark stays usable.
    a.mtp_mark();
    for i in 0..2 {
        let src = if i == 0 {
            HcSource::Last
        } else {
            HcSource::Chain
        };
        a.mtp_draft(&mtp, 5, src, pos + i).unwrap();
    }
    assert!(a.mtp_keep(3).is_err());
    a.mtp_keep(0).unwrap();
    assert_eq!(a.mtp_state(), b.mtp_state());
    // Without a mark only keep(0) is valid.
    assert!(a.mtp_keep(1).is_err());
    a.mtp_keep(0).unwrap();
    // At most a step's worth of drafts between mark and keep.
    a.mtp_mark();
    let over: Vec<bool> = (0..17)
        .map(|i| {
            let src = if i == 0 {
                HcSource::Last
            } else {
                HcSource::Chain
            };
            a.mtp_draft(&mtp, 5, src, pos + i).is_ok()
        })
        .collect();
    assert_eq!(over.iter().filter(|&&ok| ok).count(), 16);
    a.mtp_keep(0).unwrap();
    assert_eq!(a.mtp_state(), b.mtp_state());
}

/// `HcSource::Last` is the state of the session's last token: after `commit_rows(a)`
/// the step's row `a − 1`, after `commit_rows(0)` the one from before the step; none
/// after `reset` or `import_state` (which also empty the ring), and a chained draft
/// needs a previous draft.
#[test]
fn the_last_hc_state_follows_commits_and_is_dropped_by_reset_and_import() {
    let (m, mtp) = (model(), mtp());
    let p = prompt();
    let rows = [40u32, 41, 42, 43];
    let draft = |b: &mut CpuBackend| {
        let pos = b.n_tokens();
        b.mtp_draft(&mtp, 7, HcSource::Last, pos).unwrap()
    };
    let mut fresh = CpuBackend::new(&m, 256, Numerics::Exact);
    assert!(fresh.mtp_draft(&mtp, 7, HcSource::Last, 0).is_err());
    assert!(fresh.mtp_draft(&mtp, 7, HcSource::Chain, 0).is_err());
    for keep in 0..=rows.len() {
        let mut a = CpuBackend::new(&m, 256, Numerics::Exact);
        a.forward(&p, LogitRows::None).unwrap();
        a.step_rows(&rows).unwrap();
        a.commit_rows(keep).unwrap();
        let mut b = CpuBackend::new(&m, 256, Numerics::Exact);
        b.forward(&p, LogitRows::None).unwrap();
        for &t in &rows[..keep] {
            b.forward(&[t], LogitRows::Last).unwrap();
        }
        assert_eq!(draft(&mut a), draft(&mut b), "{keep} rows kept");
        assert_eq!(a.export_state().unwrap(), b.export_state().unwrap());
        assert_eq!(a.mtp_state(), b.mtp_state());
    }
    let mut a = CpuBackend::new(&m, 256, Numerics::Exact);
    a.forward(&p, LogitRows::None).unwrap();
    draft(&mut a);
    let state = a.export_state().unwrap();
    a.reset();
    assert!(a.mtp_state().is_none());
    assert!(a.mtp_draft(&mtp, 7, HcSource::Last, 0).is_err());
    a.forward(&p, LogitRows::None).unwrap();
    draft(&mut a);
    a.import_state(state).unwrap();
    assert!(a.mtp_state().is_none());
    assert!(a.mtp_draft(&mtp, 7, HcSource::Last, p.len()).is_err());
    assert!(a.mtp_draft(&mtp, 7, HcSource::Chain, p.len()).is_err());
}
