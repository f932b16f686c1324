//! State consistency: one prefill, chunked prefill, token-by-token decode, clone
//! snapshots, payload save/restore and truncate must all give **bit-identical**
//! logits in the same numeric mode (every output value is the same dot on the same
//! inputs, whatever the batching).

mod common;

use common::*;
use ds4_engine::dev::{Model, SessionExt};
use ds4_engine::{EngineError, Numerics, Session, SessionOptions};

/// Sequence b covers the raw-window wrap, the indexer's top-k (from position 35)
/// and the first ratio-128 row (position 127).
fn seq() -> Vec<u32> {
    tokens("b")
}

fn session(model: &Model, chunk: usize) -> Session {
    let mut o = SessionOptions::new(4096);
    o.prefill_chunk = Some(chunk);
    Session::with_options(model, o).unwrap()
}

fn check_modes(variant: &str, numerics: Numerics) {
    let model = load(variant, numerics);
    let toks = seq();
    let n = toks.len();

    let mut full = session(&model, 4096);
    let all = full.prefill_all_logits(&toks).unwrap();

    // Chunked prefill (chunks straddle compressor windows).
    let mut chunked = session(&model, 7);
    let all_chunked = chunked.prefill_all_logits(&toks).unwrap();
    assert!(
        all == all_chunked,
        "{variant} {numerics:?}: chunked prefill differs"
    );

    // Token by token.
    let mut dec = session(&model, 4096);
    for (t, &tok) in toks.iter().enumerate() {
        let l = dec.decode(tok).unwrap();
        assert!(
            l == &all[t * 512..(t + 1) * 512],
            "{variant} {numerics:?}: decode differs at position {t}"
        );
    }

    // Half prefill (last-row logits only), then decode.
    let half = n / 2;
    let mut hp = session(&model, 4096);
    hp.prefill(&toks[..half]).unwrap();
    assert!(hp.logits() == &all[(half - 1) * 512..half * 512]);
    for (t, &tok) in toks.iter().enumerate().skip(half) {
        hp.decode(tok).unwrap();
        assert!(hp.logits() == &all[t * 512..(t + 1) * 512], "position {t}");
    }

    // Snapshot (clone) at 130, continue both ways.
    let cut = 130;
    let mut a = session(&model, 64);
    a.prefill(&toks[..cut]).unwrap();
    let snap = a.try_clone().unwrap();
    a.prefill(&toks[cut..]).unwrap();
    assert!(a.logits() == &all[(n - 1) * 512..]);
    let mut b = snap.try_clone().unwrap();
    for &tok in &toks[cut..] {
        b.decode(tok).unwrap();
    }
    assert!(b.logits() == a.logits());

    // Payload save → load into a fresh session → continue.
    let mut bytes = Vec::new();
    snap.save_payload(&mut bytes).unwrap();
    // Same prefill chunk: it is recorded in the header.
    let mut restored = session(&model, 64);
    restored.load_payload(&mut bytes.as_slice()).unwrap();
    assert_eq!(restored.tokens(), &toks[..cut]);
    assert!(restored.logits() == snap.logits());
    let mut again = Vec::new();
    restored.save_payload(&mut again).unwrap();
    assert!(bytes == again, "payload round trip is not byte-identical");
    restored.prefill(&toks[cut..]).unwrap();
    assert!(restored.logits() == a.logits(), "restored session diverges");

    // Truncate back to the snapshot point and continue.
    let mut tr = full.try_clone().unwrap();
    tr.truncate(cut).unwrap();
    assert_eq!(tr.n_tokens(), cut);
    assert!(tr.logits() == snap.logits());
    tr.decode(toks[cut]).unwrap();
    assert!(tr.logits() == &all[cut * 512..(cut + 1) * 512]);
}

#[test]
fn exact_mode_is_bit_identical_across_batching_snapshots_and_payloads() {
    check_modes("q2", Numerics::Exact);
}

#[test]
fn fast_mode_is_bit_identical_across_batching_snapshots_and_payloads() {
    check_modes("q4", Numerics::Fast);
}

#[test]
fn payload_layout_header() {
    let model = load("q2", Numerics::Fast);
    let toks = tokens("a");
    let mut s = session(&model, 4096);
    s.prefill(&toks).unwrap();
    let mut bytes = Vec::new();
    s.save_payload(&mut bytes).unwrap();
    let u = |i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(u(0), 0x3456_5344);
    assert_eq!(u(1), 1);
    assert_eq!(u(2), 4096); // ctx
    assert_eq!(u(4), 16); // raw cap
    assert_eq!(u(5), 16); // window
    assert_eq!(u(6), 4096 / 4 + 2); // comp cap
    assert_eq!(u(7), 12); // tokens
    assert_eq!((u(8), u(9), u(10), u(11)), (6, 160, 64, 512));
    assert_eq!(u(12), 12); // live raw rows
                           // Size: header, tokens, logits, counts, then per layer raw rows + ratio parts.
    let cfg = model.config();
    let mut want = 4 * (13 + 12 + 512 + 2 * 6);
    for il in 0..6 {
        want += 4 * 12 * 160;
        let r = cfg.compress_ratios[il];
        if r != 0 {
            let lanes = if r == 4 { 2 } else { 1 };
            want += 4 * ((12 / r) * 160 + 2 * (lanes * r) * (lanes * 160));
        }
        if r == 4 {
            want += 4 * ((12 / r) * 64 + 2 * 8 * 128);
        }
    }
    assert_eq!(bytes.len(), want);
    // A corrupted magic is rejected.
    bytes[0] ^= 1;
    let mut fresh = session(&model, 4096);
    assert!(matches!(
        fresh.load_payload(&mut bytes.as_slice()),
        Err(EngineError::Payload(_))
    ));
}

#[test]
fn context_limit_and_bad_tokens_are_errors() {
    let model = load("q2", Numerics::Fast);
    let mut s = session(&model, 4096);
    assert!(matches!(
        s.prefill(&[0, 9999]),
        Err(EngineError::BadToken { token: 9999, .. })
    ));
    let mut small = Session::new(&model, 4).unwrap();
    small.prefill(&[0, 1, 2]).unwrap();
    small.decode(3).unwrap();
    assert!(matches!(
        small.decode(4),
        Err(EngineError::ContextFull { .. })
    ));
}

#[test]
fn small_context_shrinks_the_raw_window() {
    // ctx 10 < window 16: the ring holds 10 rows, like ds4 (model-spec.md §8.14).
    let model = load("q2", Numerics::Exact);
    let toks = tokens("b");
    let mut s = Session::new(&model, 10).unwrap();
    let got = s.prefill_all_logits(&toks[..10]).unwrap();
    let want = read_f32(expected("q2", "b")["logits"].as_str().unwrap());
    let st = compare(&got, &want[..10 * 512], 512, &[0.0; 10]);
    assert!(st.max < 1e-3, "{st:?}");
}

#[test]
fn results_do_not_depend_on_thread_count() {
    for (variant, numerics) in [("q2", Numerics::Fast), ("q4", Numerics::Exact)] {
        let model = load(variant, numerics);
        let toks = tokens("b");
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| session(&model, 4096).prefill_all_logits(&toks).unwrap())
        };
        assert!(run(1) == run(3), "{variant} {numerics:?}");
    }
}
