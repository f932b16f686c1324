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

use std::sync::{Arc, OnceLock};

use common::{load, tokens};
use ds4_engine::dev::layout::ExpertQuant;
use ds4_engine::dev::{Model, SessionExt};
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
        out.extend(got);
    }
    (out, s, o)
}

/// A hook proposing the reference's greedy token at the position with probability
/// `p_true` (else a wrong token), deterministic per `seed`.
fn truth_hook(p_true: f64, seed: u64) -> Box<dyn FnMut(usize, u32) -> u32 + Send> {
    let truth = reference().0.clone();
    let p0 = prompt().len();
    let mut x = seed;
    Box::new(move |pos, tok| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        let t = truth.get(pos - p0).copied().unwrap_or(tok);
        if u < p_true {
            t
        } else {
            (t + 1 + (x % 7) as u32) % 512
        }
    })
}

fn speculator(draft: usize, margin: f32) -> Speculator {
    Speculator::new(mtp(), SpecOptions { draft, margin }).unwrap()
}

#[test]
fn greedy_speculation_emits_exactly_the_plain_tokens_and_state() {
    let (want, want_state) = reference();
    for draft in [1, 2, 4] {
        for margin in [0.0, 3.0] {
            let mut spec = speculator(draft, margin);
            let (got, s, _) = speculate(&mut spec, &mut greedy(), N_GEN, usize::MAX, &[]);
            let what = format!("draft {draft}, margin {margin}: {:?}", spec.stats());
            assert_eq!(&got, want, "{what}");
            assert_eq!(&s.export_state().unwrap(), want_state, "{what}");
            let st = spec.stats();
            assert_eq!(st.emitted as usize, N_GEN - 1, "{what}");
            if margin == 0.0 {
                // Every cycle but the last (`max` 1) drafts.
                assert!(st.drafted + 1 >= st.cycles, "{what}");
            }
        }
    }
}

#[test]
fn greedy_identity_holds_through_accepts_partial_accepts_and_rejects() {
    let (want, want_state) = reference();
    for draft in [1, 2, 4] {
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
}
