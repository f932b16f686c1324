//! Multi-row steps (#20 item 1): `Session::step_rows` runs R tokens at once and
//! `commit_rows(a)` keeps the first `a`. After any accept/reject pattern the session
//! must equal — bit for bit: exported KV cache (every field: raw ring, compressed and
//! index rows, frontiers, n_tokens), tokens, logits, and the logits of the tokens
//! decoded next — a session that decoded the accepted tokens one by one.
//!
//! The tiny fixture model has a 16-token window, ratio-4 (overlapping, with indexer,
//! top-k 8: the indexer selects from position 35) and ratio-128 layers, so the steps
//! below straddle the raw window wrap, ratio-4 and ratio-128 window ends and the
//! indexer threshold, with the closing row among the accepted or the rejected rows.
//!
//! Every check runs on a [`Rig`] (a backend factory): the CPU always, CUDA on device 0
//! when there is one (else the test records "skipped: no CUDA driver").

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{load, tokens};
use ds4_engine::dev::{KvCache, Model, SessionExt};
use ds4_engine::{EngineError, Numerics, Session, SessionOptions};

const VOCAB: usize = 512;
const CTX: usize = 4096;
const MAX: usize = Session::MAX_STEP_ROWS;

/// Sessions of one model, numerics and backend.
struct Rig {
    name: &'static str,
    make: Box<dyn Fn(usize) -> Session>,
    /// 0: the step must equal one-by-one decode bit for bit (the CPU). Else the
    /// largest difference allowed, relative to the largest value (the CUDA step runs
    /// its rows through batch kernels: the attention in one chunk per row instead of
    /// decode's split, the products through multi-token kernels), and the greedy
    /// token must agree.
    tol: f32,
}

/// `got` equals `want` within `tol` (see [`Rig::tol`]).
fn close(got: &[f32], want: &[f32], tol: f32) -> Result<(), String> {
    if tol == 0.0 {
        return if got == want {
            Ok(())
        } else {
            Err("not bit-identical".into())
        };
    }
    if got.len() != want.len() {
        return Err(format!("{} values, expected {}", got.len(), want.len()));
    }
    let scale = want
        .iter()
        .fold(1f32, |m, v| if v.is_finite() { m.max(v.abs()) } else { m });
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| if a == b { 0.0 } else { (a - b).abs() })
        .fold(0f32, f32::max);
    if worst.is_nan() || worst > tol * scale {
        return Err(format!(
            "differs by {worst} (scale {scale}, tolerance {tol})"
        ));
    }
    Ok(())
}

/// Logits within `tol`, with the same greedy token.
fn close_logits(got: &[f32], want: &[f32], tol: f32) -> Result<(), String> {
    close(got, want, tol)?;
    let (a, b) = (ds4_engine::argmax(got), ds4_engine::argmax(want));
    if tol > 0.0 && a != b {
        return Err(format!("greedy token {a}, expected {b}"));
    }
    Ok(())
}

/// Two caches equal within `tol`: every field of every layer.
fn close_kv(got: &KvCache, want: &KvCache, tol: f32) -> Result<(), String> {
    if tol == 0.0 {
        return if got == want {
            Ok(())
        } else {
            Err("caches differ".into())
        };
    }
    if (got.n_tokens, got.layers.len()) != (want.n_tokens, want.layers.len()) {
        return Err(format!("n_tokens {} vs {}", got.n_tokens, want.n_tokens));
    }
    for (il, (a, b)) in got.layers.iter().zip(&want.layers).enumerate() {
        let parts = |l: &ds4_engine::dev::LayerCache| {
            let mut v = vec![l.raw_rows(), l.comp.clone(), l.index.clone()];
            for f in [&l.comp_state, &l.index_state].into_iter().flatten() {
                v.push(f.kv.clone());
                v.push(f.score.clone());
            }
            v
        };
        for (i, (x, y)) in parts(a).iter().zip(parts(b).iter()).enumerate() {
            close(x, y, tol).map_err(|e| format!("layer {il} part {i}: {e}"))?;
        }
    }
    Ok(())
}

fn cpu_rig(model: &Model, numerics: Numerics) -> Rig {
    let model = model.clone();
    Rig {
        name: "cpu",
        make: Box::new(move |ctx| {
            let mut o = SessionOptions::new(ctx);
            o.numerics = Some(numerics);
            Session::with_options(&model, o).unwrap()
        }),
        tol: 0.0,
    }
}

#[cfg(feature = "cuda")]
fn cuda_rig(model: &Model, numerics: Numerics) -> Option<Rig> {
    use ds4_engine::dev::{CudaBackend, CudaWeights};
    use std::sync::Arc;
    let gpu = Arc::new(ds4_cuda::selftest::open_for_test(0).expect("opening the GPU")?);
    let w = Arc::new(CudaWeights::upload(&gpu, model, &|_| {}).expect("upload"));
    let model = model.clone();
    Some(Rig {
        name: "cuda",
        make: Box::new(move |ctx| {
            let b = CudaBackend::new(&w, ctx, numerics).expect("a CUDA session");
            Session::with_backend(&model, Box::new(b), numerics, 2048)
        }),
        tol: match numerics {
            Numerics::Exact => 1e-3,
            // A KV value whose f32 moved across an FP8 rounding boundary moves by a
            // step of e4m3 (1/8 of its magnitude).
            Numerics::Fast => 0.1,
        },
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_rig(_: &Model, _: Numerics) -> Option<Rig> {
    None
}

/// The CPU rig and, with a GPU, the CUDA one.
fn rigs(model: &Model, numerics: Numerics) -> Vec<Rig> {
    let mut r = vec![cpu_rig(model, numerics)];
    r.extend(cuda_rig(model, numerics));
    r
}

/// A token that is not `t`: what a rejected draft row runs.
fn draft(t: u32) -> u32 {
    (t * 7 + 3) % VOCAB as u32 + u32::from((t * 7 + 3) % VOCAB as u32 == t)
}

fn kv(s: &Session) -> KvCache {
    s.backend().export_state().unwrap()
}

/// One-by-one decode of the sequence: logits after every token, snapshots at the
/// step starts, exported caches where the steps can end.
struct Reference {
    tol: f32,
    toks: Vec<u32>,
    logits: Vec<f32>,
    starts: BTreeMap<usize, Session>,
    caches: BTreeMap<usize, KvCache>,
}

impl Reference {
    /// Decodes `toks[..n]`; snapshots at `starts`, caches at `need`.
    fn new(
        rig: &Rig,
        toks: &[u32],
        n: usize,
        starts: &[usize],
        need: &BTreeSet<usize>,
    ) -> Reference {
        let toks = toks[..n].to_vec();
        let mut s = (rig.make)(CTX);
        let mut r = Reference {
            tol: rig.tol,
            toks: toks.clone(),
            logits: Vec::with_capacity(n * VOCAB),
            starts: BTreeMap::new(),
            caches: BTreeMap::new(),
        };
        for (p, &t) in toks.iter().enumerate() {
            if starts.contains(&p) {
                r.starts.insert(p, s.try_clone().unwrap());
            }
            if need.contains(&p) {
                r.caches.insert(p, kv(&s));
            }
            r.logits.extend_from_slice(s.decode(t).unwrap());
        }
        r
    }

    /// Logits after the first `p` tokens (`p ≥ 1`).
    fn after(&self, p: usize) -> &[f32] {
        &self.logits[(p - 1) * VOCAB..p * VOCAB]
    }

    /// The step's tokens: the sequence for the accepted rows, drafts after.
    fn step_tokens(&self, p0: usize, rows: usize, accepted: usize) -> Vec<u32> {
        (p0..p0 + rows)
            .map(|p| {
                if p < p0 + accepted {
                    self.toks[p]
                } else {
                    draft(self.toks[p])
                }
            })
            .collect()
    }

    /// `s` equals the reference after `p` tokens, and keeps equalling it over the
    /// `next` tokens decoded after.
    fn check(&self, s: &mut Session, p: usize, next: usize, what: &str) {
        assert_eq!(s.n_tokens(), p, "{what}: n_tokens");
        assert_eq!(s.tokens(), &self.toks[..p], "{what}: tokens");
        assert_eq!(s.pending_rows(), 0, "{what}: nothing pending");
        if p == 0 {
            assert!(s.logits().is_empty(), "{what}: logits before any token");
        } else {
            let c = close_logits(s.logits(), self.after(p), self.tol);
            c.unwrap_or_else(|e| panic!("{what}: logits {e}"));
        }
        let got = kv(s);
        let want = &self.caches[&p];
        if let Err(e) = close_kv(&got, want, self.tol) {
            let bad: Vec<usize> = (0..got.layers.len())
                .filter(|&il| got.layers[il] != want.layers[il])
                .collect();
            panic!("{what}: cache differs ({e}; layers {bad:?})");
        }
        for k in 0..next {
            let l = s.decode(self.toks[p + k]).unwrap();
            let c = close_logits(l, self.after(p + k + 1), self.tol);
            c.unwrap_or_else(|e| panic!("{what}: decode +{k} after: {e}"));
        }
    }

    /// Steps `rows` rows from `p0`, keeps `accepted`, checks against the reference.
    fn case(&self, p0: usize, rows: usize, accepted: usize, tag: &str) {
        let mut s = self.starts[&p0].try_clone().unwrap();
        let toks = self.step_tokens(p0, rows, accepted);
        let what = format!("{tag} p0 {p0} R {rows} a {accepted}");
        let out = s.step_rows(&toks).unwrap().to_vec();
        assert_eq!(out.len(), rows * VOCAB, "{what}: rows");
        // Accepted rows are the sequence's tokens: their logits are decode's.
        for i in 0..accepted {
            let c = close_logits(
                &out[i * VOCAB..(i + 1) * VOCAB],
                self.after(p0 + i + 1),
                self.tol,
            );
            c.unwrap_or_else(|e| panic!("{what}: row {i} logits: {e}"));
        }
        assert_eq!(s.pending_rows(), rows);
        assert_eq!(
            s.n_tokens(),
            p0 + rows,
            "{what}: pending step holds every row"
        );
        assert!(s.logits() == &out[(rows - 1) * VOCAB..], "{what}: last row");
        s.commit_rows(accepted).unwrap();
        // The cache holds everything the next token reads; one decode checks that.
        self.check(&mut s, p0 + accepted, 1, &what);
    }
}

/// Raw window wrap (16), ratio-4 ends, the indexer threshold (35), the ratio-128
/// ends at 127 and 255, and the empty session.
const STARTS: [usize; 5] = [0, 9, 27, 118, 247];

fn sweep(variant: &str, numerics: Numerics, full: bool) {
    let model = load(variant, numerics);
    let seq = tokens("c");
    for rig in rigs(&model, numerics) {
        let tag = format!("{} {variant} {numerics:?}", rig.name);
        let n = STARTS.iter().max().unwrap() + MAX + 3;
        let need = STARTS.iter().flat_map(|&p| p..=p + MAX).collect();
        let r = Reference::new(&rig, &seq, n, &STARTS, &need);
        for &p0 in &STARTS {
            let plan: Vec<(usize, usize)> = if full {
                // R = 16 with every accept count; every other R (a few at the
                // starts without a ring wrap or ratio-128 end) with an accept count
                // that varies with the start; the chained walk mixes the rest.
                let mut v: Vec<(usize, usize)> = (0..=MAX).map(|a| (MAX, a)).collect();
                let all_r = p0 == 9 || p0 == 118;
                v.extend(
                    (1..MAX)
                        .filter(|r| all_r || [1, 5, 8, 13].contains(r))
                        .map(|rows| (rows, (rows * 7 + p0 * 3) % (rows + 1))),
                );
                v
            } else {
                vec![(MAX, 0), (MAX, 5), (MAX, 11), (MAX, MAX), (3, 1), (9, 9)]
            };
            for (rows, a) in plan {
                r.case(p0, rows, a, &tag);
            }
        }
    }
}

#[test]
fn exact_rollback_equals_one_by_one_decode() {
    sweep("q2", Numerics::Exact, true);
}

#[test]
fn fast_rollback_equals_one_by_one_decode() {
    sweep("q4", Numerics::Fast, false);
}

/// A speculative-decoding walk: steps of varying size with varying accept counts,
/// each starting from the last one's rolled-back state, across every boundary up to
/// position 270; checked after every commit.
#[test]
fn chained_steps_equal_one_by_one_decode() {
    let numerics = Numerics::Exact;
    let model = load("q2", numerics);
    let seq = tokens("c");
    // The walk: (p0, rows, accepted) per step; `check` decodes two more tokens (as
    // the next accepted ones), so the next step starts at p0 + a + 2.
    let n = 272;
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = |m: usize| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % m as u64) as usize
    };
    let mut walk = Vec::new();
    let mut p0 = 0;
    while p0 + MAX <= n {
        let rows = 1 + next(MAX);
        let a = next(rows + 1);
        walk.push((p0, rows, a));
        p0 += a + 2;
    }
    assert!(walk.len() > 20, "{} steps", walk.len());
    let need = walk.iter().map(|&(p0, _, a)| p0 + a).collect();
    for rig in rigs(&model, numerics) {
        let r = Reference::new(&rig, &seq, n + 3, &[], &need);
        let mut s = (rig.make)(CTX);
        for (i, &(p0, rows, a)) in walk.iter().enumerate() {
            assert_eq!(s.n_tokens(), p0);
            s.step_rows(&r.step_tokens(p0, rows, a)).unwrap();
            s.commit_rows(a).unwrap();
            let what = format!("{} step {i} p0 {p0} R {rows} a {a}", rig.name);
            r.check(&mut s, p0 + a, 2, &what);
        }
    }
}

/// Row counts, full contexts, bad tokens and misplaced commits are errors that change
/// nothing; a pending step is accepted by the next decode; truncate inside a pending
/// step is its commit.
#[test]
fn errors_and_pending_rules() {
    let numerics = Numerics::Exact;
    let model = load("q2", numerics);
    let seq = tokens("c");
    for rig in rigs(&model, numerics) {
        let ctx = 40;
        let mut s = (rig.make)(ctx);
        let same = |a: &Session, b: &Session, what: &str| {
            let what = format!("{}: {what}", rig.name);
            assert_eq!(a.tokens(), b.tokens(), "{what}: tokens");
            let c = close(a.logits(), b.logits(), rig.tol);
            c.unwrap_or_else(|e| panic!("{what}: logits {e}"));
            assert_eq!(a.pending_rows(), b.pending_rows(), "{what}: pending rows");
            let c = close_kv(&kv(a), &kv(b), rig.tol);
            c.unwrap_or_else(|e| panic!("{what}: KV state {e}"));
        };
        // No step pending: only a zero commit is valid.
        s.commit_rows(0).unwrap();
        assert!(matches!(s.commit_rows(1), Err(EngineError::Invalid(_))));
        s.prefill(&seq[..30]).unwrap();
        let before = s.try_clone().unwrap();
        for bad in [0, MAX + 1] {
            let e = s.step_rows(&seq[30..30 + bad]).unwrap_err();
            assert!(matches!(e, EngineError::Invalid(_)), "{bad} rows: {e}");
            same(&s, &before, "bad row count");
        }
        let e = s.step_rows(&seq[30..41]).unwrap_err();
        assert!(matches!(e, EngineError::ContextFull { .. }), "{e}");
        same(&s, &before, "context full");
        let e = s.step_rows(&[1, VOCAB as u32]).unwrap_err();
        assert!(matches!(e, EngineError::BadToken { .. }), "{e}");
        same(&s, &before, "bad token");

        // A pending step: bad commits and refused steps keep it pending.
        s.step_rows(&seq[30..36]).unwrap();
        let pending = s.try_clone().unwrap();
        assert_eq!(pending.pending_rows(), 0, "a clone holds every row");
        assert_eq!(pending.n_tokens(), 36);
        assert!(matches!(s.commit_rows(7), Err(EngineError::Invalid(_))));
        assert!(matches!(
            s.step_rows(&seq[36..41]),
            Err(EngineError::ContextFull { .. })
        ));
        assert_eq!(s.pending_rows(), 6);
        // Truncating inside the step is its commit; below it, the slow path.
        s.truncate(33).unwrap();
        assert_eq!(s.pending_rows(), 0);
        let mut one = before.try_clone().unwrap();
        // Decode, not prefill: CUDA's batched prefill need not match decode bit for bit.
        for &tok in &seq[30..33] {
            one.decode(tok).unwrap();
        }
        same(&s, &one, "truncate inside the step");
        s.step_rows(&seq[33..37]).unwrap();
        s.truncate(20).unwrap();
        let mut twenty = (rig.make)(ctx);
        twenty.prefill(&seq[..20]).unwrap();
        same(&s, &twenty, "truncate below the step");

        // a = 0 is a no-op, a = R equals plain decode.
        s.step_rows(&seq[20..24]).unwrap();
        s.commit_rows(0).unwrap();
        same(&s, &twenty, "a = 0");
        s.step_rows(&seq[20..24]).unwrap();
        s.commit_rows(4).unwrap();
        for &tok in &seq[20..24] {
            twenty.decode(tok).unwrap();
        }
        same(&s, &twenty, "a = R");

        // A step left pending is accepted by the next decode.
        s.step_rows(&[draft(seq[24]), draft(seq[25])]).unwrap();
        s.decode(seq[26]).unwrap();
        assert_eq!(s.pending_rows(), 0);
        for tok in [draft(seq[24]), draft(seq[25]), seq[26]] {
            twenty.decode(tok).unwrap();
        }
        same(&s, &twenty, "pending step accepted by decode");
        assert!(
            matches!(s.commit_rows(1), Err(EngineError::Invalid(_))),
            "{}",
            rig.name
        );

        // A payload saved during a step holds every row; loading one (like importing
        // a state) accepts the loader's own pending step first.
        let at = s.n_tokens();
        let mut all = s.tokens().to_vec();
        all.extend_from_slice(&seq[at..at + 3]);
        s.step_rows(&seq[at..at + 3]).unwrap();
        let mut bytes = Vec::new();
        s.save_payload(&mut bytes).unwrap();
        assert_eq!(s.tokens(), all);
        // A load rebuilds the ring oldest-first: compare with a fresh load.
        let mut whole = (rig.make)(ctx);
        whole.load_payload(&mut bytes.as_slice()).unwrap();
        assert_eq!(whole.tokens(), all);
        s.commit_rows(1).unwrap();
        s.step_rows(&seq[at + 1..at + 2]).unwrap();
        s.load_payload(&mut bytes.as_slice()).unwrap();
        same(&s, &whole, "payload loaded over a step");
        s.step_rows(&seq[at + 3..at + 5]).unwrap();
        s.import_state(twenty.export_state().unwrap()).unwrap();
        same(&s, &twenty, "state imported over a step");
    }
}
