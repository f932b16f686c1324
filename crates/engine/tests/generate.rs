//! Sampling on a real (tiny) model: greedy generation reproduces the reference's
//! greedy continuation; seeded sampling is reproducible; stop tokens end generation.

mod common;

use common::*;
use ds4_engine::dev::SessionExt;
use ds4_engine::{generate, Numerics, Sampler, SamplerConfig, Session, StopReason};

fn greedy_tokens(seq: &str) -> Vec<u32> {
    ids(&expected("q2", seq)["greedy"]["tokens"])
}

#[test]
fn greedy_generation_matches_reference() {
    let model = load("q2", Numerics::Exact);
    let mut s = Session::new(&model, 4096).unwrap();
    s.prefill(&tokens("a")).unwrap();
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    let (out, why) = generate(&mut s, &mut sampler, 16, &[]).unwrap();
    assert_eq!(why, StopReason::Limit);
    assert_eq!(out, greedy_tokens("a"));
    // The last sampled token is not fed back.
    assert_eq!(s.n_tokens(), 12 + 15);
}

#[test]
fn stop_token_ends_generation() {
    let model = load("q2", Numerics::Exact);
    let mut s = Session::new(&model, 4096).unwrap();
    s.prefill(&tokens("a")).unwrap();
    let want = greedy_tokens("a");
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    let (out, why) = generate(&mut s, &mut sampler, 16, &[want[2]]).unwrap();
    assert_eq!(why, StopReason::Eos);
    assert_eq!(out, want[..3]);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let model = load("q2", Numerics::Fast);
    let mut base = Session::new(&model, 4096).unwrap();
    base.prefill(&tokens("a")).unwrap();
    let cfg = SamplerConfig {
        temperature: 1.5,
        top_k: 50,
        top_p: 0.95,
        min_p: 0.01,
        seed: 1234,
    };
    let run = |cfg: &SamplerConfig| {
        let mut s = base.try_clone().unwrap();
        let mut sampler = Sampler::new(cfg.clone());
        generate(&mut s, &mut sampler, 12, &[1]).unwrap().0
    };
    let a = run(&cfg);
    assert_eq!(a, run(&cfg));
    assert!(!a.is_empty());
}

// Session::greedy_run on the CPU (the trait's default): the plain greedy loop's picks,
// tokens and logits, after its budget, a refused pick and a resumed run, and with a
// token left out of every pick (the CUDA twin: `gpu-selftest`, device picks).
#[test]
fn greedy_run_equals_the_plain_loop() {
    for numerics in [Numerics::Exact, Numerics::Fast] {
        let model = load("q2", numerics);
        let prompt = tokens("b");
        ds4_engine::dev::fixture::greedy_run_identity(
            &mut || {
                let mut s = Session::new(&model, 4096)?;
                s.prefill(&prompt)?;
                Ok(s)
            },
            24,
        )
        .unwrap();
    }
}

// Session::sample_run on the CPU (the trait's default): the plain sampled loop's picks,
// tokens, logits and sampler stream, after its budget and after a refused pick (the
// CUDA twin: `gpu-selftest`, the device's sampled picks).
#[test]
fn sample_run_equals_the_plain_loop() {
    let model = load("q2", Numerics::Exact);
    let prompt = tokens("b");
    for cfg in ds4_engine::dev::fixture::run_samplers() {
        ds4_engine::dev::fixture::sample_run_identity(
            &mut || {
                let mut s = Session::new(&model, 4096)?;
                s.prefill(&prompt)?;
                Ok(s)
            },
            24,
            &cfg,
        )
        .unwrap();
    }
}

#[test]
fn greedy_run_stops_at_a_full_context_and_checks_its_input() {
    let model = load("q2", Numerics::Exact);
    let prompt = tokens("a");
    let mut s = Session::new(&model, prompt.len() + 3).unwrap();
    s.prefill(&prompt).unwrap();
    let mut picks = Vec::new();
    let first = ds4_engine::argmax(s.logits());
    s.greedy_run(first, 100, None, &mut |p| {
        picks.push(p);
        true
    })
    .unwrap();
    // Room for 3 tokens: first and 2 picks decoded, 3 picks delivered.
    assert_eq!(s.n_tokens(), prompt.len() + 3);
    assert_eq!(picks.len(), 3);
    let err = s.greedy_run(picks[2], 5, None, &mut |_| true).unwrap_err();
    assert!(
        matches!(err, ds4_engine::EngineError::ContextFull { .. }),
        "{err}"
    );
    let mut s = Session::new(&model, 4096).unwrap();
    s.prefill(&prompt).unwrap();
    assert!(s.greedy_run(1_000_000, 5, None, &mut |_| true).is_err());
    assert_eq!(s.n_tokens(), prompt.len());
    s.greedy_run(first, 0, None, &mut |_| panic!("max 0 delivers nothing"))
        .unwrap();
    assert_eq!(s.n_tokens(), prompt.len());
}
