//! `Session::decode_batch` (#21): one decode token for each of several sessions, each at
//! its own position with its own KV. Every row must equal that session decoding alone,
//! bit for bit (the CPU), and a row that fails (full context, bad token) must leave its
//! session unchanged while the other rows advance.

mod common;

use common::{load, tokens};
use ds4_engine::dev::SessionExt;
use ds4_engine::{EngineError, Numerics, Session};

/// Three sessions at different lengths (one empty-prompt-free, one mid-window, one past
/// the 16-token raw window) run a few batched steps; a twin of each decodes alone.
#[test]
fn batched_rows_equal_decoding_each_alone() {
    let model = load("q2", Numerics::Exact);
    let seq = tokens("c");
    let starts = [3usize, 17, 40];
    let mut batch: Vec<Session> = Vec::new();
    let mut alone: Vec<Session> = Vec::new();
    for &n in &starts {
        let mut a = Session::new(&model, 256).unwrap();
        a.prefill(&seq[..n]).unwrap();
        alone.push(a.try_clone().unwrap());
        batch.push(a);
    }
    for step in 0..6 {
        let toks: Vec<u32> = starts.iter().map(|&n| seq[n + step]).collect();
        let mut rows: Vec<(&mut Session, u32)> =
            batch.iter_mut().zip(toks.iter().copied()).collect();
        let res = Session::decode_batch(&mut rows);
        assert!(res.iter().all(|r| r.is_ok()), "step {step}: {res:?}");
        for (i, a) in alone.iter_mut().enumerate() {
            a.decode(toks[i]).unwrap();
            assert_eq!(batch[i].tokens(), a.tokens(), "step {step} row {i}");
            assert!(
                batch[i].logits() == a.logits(),
                "step {step} row {i}: logits differ"
            );
        }
    }
    for (b, a) in batch.iter().zip(&alone) {
        assert!(b.export_state().unwrap() == a.export_state().unwrap());
        assert_eq!(b.kv_bytes(), a.kv_bytes());
    }
    // The CPU backend reports its KV bytes, more for a longer session.
    assert!(batch[0].kv_bytes().unwrap() > 0);
    assert!(batch[2].kv_bytes().unwrap() >= batch[0].kv_bytes().unwrap());
}

#[test]
fn a_failing_row_leaves_its_session_and_the_others_advance() {
    let model = load("q2", Numerics::Exact);
    let seq = tokens("b");
    let mut full = Session::new(&model, 8).unwrap();
    full.prefill(&seq[..8]).unwrap();
    let mut ok = Session::new(&model, 64).unwrap();
    ok.prefill(&seq[..5]).unwrap();
    let mut bad_tok = Session::new(&model, 64).unwrap();
    bad_tok.prefill(&seq[..4]).unwrap();
    let mut twin = ok.try_clone().unwrap();
    let (full_before, bad_before) = (
        full.export_state().unwrap(),
        bad_tok.export_state().unwrap(),
    );
    let mut rows = vec![
        (&mut full, seq[8]),
        (&mut ok, seq[5]),
        (&mut bad_tok, 1 << 30),
    ];
    let res = Session::decode_batch(&mut rows);
    assert!(
        matches!(res[0], Err(EngineError::ContextFull { .. })),
        "{:?}",
        res[0]
    );
    assert!(res[1].is_ok());
    assert!(
        matches!(res[2], Err(EngineError::BadToken { .. })),
        "{:?}",
        res[2]
    );
    twin.decode(seq[5]).unwrap();
    assert!(ok.logits() == twin.logits());
    assert_eq!(ok.tokens(), twin.tokens());
    assert!(full.export_state().unwrap() == full_before);
    assert!(bad_tok.export_state().unwrap() == bad_before);
    // No rows at all is a no-op.
    assert!(Session::decode_batch(&mut []).is_empty());
}
