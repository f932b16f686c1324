//! Imatrix collection on the tiny fixture (issue 24, part 3): the collector's `.dat`
//! equals a direct recomputation from a raw activation tap; the tapped activations are
//! the experts' real inputs (recomputed from the weights); observing changes nothing.

mod common;

use ds4_engine::dev::ops::moe::route;
use ds4_engine::dev::ops::norm::silu;
use ds4_engine::dev::{Model, SessionExt};
use ds4_engine::{
    split_dataset, Imatrix, ImatrixCollector, MoeActivations, MoeObserver, Numerics, Session,
};

/// One observation: (layer, x, experts, mid).
type Call = (usize, Vec<f32>, Vec<u32>, Vec<f32>);

/// Keeps every observation as it came (the independent tap).
#[derive(Default)]
struct Tap {
    calls: Vec<Call>,
}

impl MoeObserver for Tap {
    fn observe(&mut self, a: &MoeActivations) {
        self.calls
            .push((a.layer, a.x.to_vec(), a.experts.to_vec(), a.mid.to_vec()));
    }
}

/// Forwards to both.
struct Both<'a>(&'a mut Tap, &'a mut ImatrixCollector);

impl MoeObserver for Both<'_> {
    fn observe(&mut self, a: &MoeActivations) {
        self.0.observe(a);
        self.1.observe(a);
    }
}

const DATASET: &str = "header text is ignored\n\
===== DS4_IMATRIX_PROMPT 0 =====\n\
<｜begin▁of▁sentence｜><｜User｜>Tell me about the sea and the sky.<｜Assistant｜></think>\n\
===== DS4_IMATRIX_PROMPT 1 =====\n\
<｜begin▁of▁sentence｜>system<｜User｜>Count: one two three four five six seven.<｜Assistant｜><think>\n";

fn prompts(model: &Model) -> Vec<Vec<u32>> {
    let tok = model.tokenizer().unwrap();
    split_dataset(DATASET)
        .iter()
        .map(|p| tok.encode(p))
        .collect()
}

#[test]
fn dat_equals_recomputation_from_a_tap() {
    let model = common::load("q2", Numerics::Exact);
    let cfg = model.config().clone();
    let ps = prompts(&model);
    assert_eq!(ps.len(), 2);
    let (mut tap, mut coll) = (Tap::default(), ImatrixCollector::new(&cfg));
    // A prefill chunk of 7 splits each prompt into several batches.
    let mut s = Session::with_options(&model, {
        let mut o = ds4_engine::SessionOptions::new(256);
        o.prefill_chunk = Some(7);
        o
    })
    .unwrap();
    for p in &ps {
        s.reset();
        s.prefill_observed(p, &mut Both(&mut tap, &mut coll))
            .unwrap();
    }
    let chunks: usize = ps.iter().map(|p| p.len().div_ceil(7)).sum();
    assert_eq!(tap.calls.len(), chunks * cfg.n_layer);

    let mut buf = Vec::new();
    coll.to_imatrix("ds.txt").write_to(&mut buf).unwrap();
    let m = Imatrix::read_from(&mut buf.as_slice()).unwrap();
    assert_eq!(m.entries.len(), 3 * cfg.n_layer);
    assert_eq!(m.last_call as usize, chunks * cfg.n_layer);
    assert_eq!(m.dataset, "ds.txt");

    // Direct recomputation in f64 from the tap.
    let (e, ff, k, nx) = (cfg.n_embd, cfg.n_ff_exp, cfg.n_expert_used, cfg.n_expert);
    let mut gu = vec![0.0f64; cfg.n_layer * nx * e];
    let mut dn = vec![0.0f64; cfg.n_layer * nx * ff];
    let mut cnt = vec![0u32; cfg.n_layer * nx];
    for (il, x, ex, mid) in &tap.calls {
        for t in 0..x.len() / e {
            for j in 0..k {
                let slot = il * nx + ex[t * k + j] as usize;
                cnt[slot] += 1;
                for c in 0..e {
                    gu[slot * e + c] += (x[t * e + c] as f64).powi(2);
                }
                for c in 0..ff {
                    dn[slot * ff + c] += (mid[(t * k + j) * ff + c] as f64).powi(2);
                }
            }
        }
    }
    let close = |got: f32, sum: f64, n: u32| {
        let want = if n == 0 { 1.0 } else { sum / n as f64 };
        (got as f64 - want).abs() <= 1e-5 * want.abs().max(1e-6)
    };
    let mut routed = 0;
    for il in 0..cfg.n_layer {
        let names = ["gate", "up", "down"].map(|t| format!("blk.{il}.ffn_{t}_exps.weight"));
        for (i, name) in names.iter().enumerate() {
            let ent = m.get(name).unwrap_or_else(|| panic!("{name} missing"));
            assert_eq!(ent.ncall, 1);
            let cols = if i == 2 { ff } else { e };
            let sums = if i == 2 { &dn } else { &gu };
            assert_eq!(ent.values.len(), nx * cols, "{name}");
            for ex in 0..nx {
                let slot = il * nx + ex;
                for c in 0..cols {
                    assert!(
                        close(ent.values[ex * cols + c], sums[slot * cols + c], cnt[slot]),
                        "{name} expert {ex} col {c}: {} vs {}/{}",
                        ent.values[ex * cols + c],
                        sums[slot * cols + c],
                        cnt[slot]
                    );
                }
                routed += (cnt[slot] > 0) as usize;
            }
        }
    }
    // Most experts of the tiny model are routed at least once (else the test is weak).
    assert!(routed > 3 * cfg.n_layer * nx / 2, "{routed}");
    assert_eq!(
        coll.routes() as usize,
        cfg.n_layer * k * ps.iter().map(Vec::len).sum::<usize>()
    );
}

/// The tapped rows are what the experts multiply: the experts are those the router
/// (or the hash table) picks for `x`, and `mid` is SwiGLU of the expert's gate and up
/// products of `x`, times the route weight (recomputed here from dequantised rows).
#[test]
fn tapped_rows_are_the_expert_inputs() {
    let model = common::load("q2", Numerics::Exact);
    let cfg = model.config().clone();
    let w = model.weights();
    let p = &prompts(&model)[0];
    let mut tap = Tap::default();
    let mut s = Session::new(&model, 256).unwrap();
    s.prefill_observed(p, &mut tap).unwrap();
    let (e, ff, k) = (cfg.n_embd, cfg.n_ff_exp, cfg.n_expert_used);
    let dot = |m: ds4_engine::dev::weights::MatRef, r: usize, x: &[f32]| {
        let mut row = vec![0.0f32; m.n_in];
        m.dequant_row(r, &mut row);
        row.iter()
            .zip(x)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum::<f64>()
    };
    let mut worst = 0.0f64;
    for (il, x, ex, mid) in &tap.calls {
        let lw = &w.layers[*il];
        let clamp = cfg.swiglu_clamp[*il] as f64;
        for t in 0..p.len() {
            let xt = &x[t * e..(t + 1) * e];
            let logits: Vec<f32> = (0..cfg.n_expert)
                .map(|r| dot(lw.gate_inp.view(), r, xt) as f32)
                .collect();
            let hash = lw
                .tid2eid
                .as_ref()
                .map(|tab| &tab[p[t] as usize * k..(p[t] as usize + 1) * k]);
            let r = route(
                &logits,
                lw.exp_probs_b.as_deref(),
                hash,
                k,
                cfg.expert_weights_scale,
                cfg.expert_weights_norm,
            );
            let got: Vec<usize> = ex[t * k..(t + 1) * k].iter().map(|&v| v as usize).collect();
            assert_eq!(got, r.experts, "layer {il} token {t}");
            for (j, &x_id) in r.experts.iter().enumerate() {
                for c in (0..ff).step_by(17) {
                    let g = dot(lw.gate_exps.expert(x_id), c, xt).min(clamp);
                    let u = dot(lw.up_exps.expert(x_id), c, xt).clamp(-clamp, clamp);
                    let want = silu(g as f32) as f64 * u * r.weights[j] as f64;
                    let d = (mid[(t * k + j) * ff + c] as f64 - want).abs();
                    worst = worst.max(d / want.abs().max(1e-2));
                }
            }
        }
    }
    assert!(
        worst < 1e-3,
        "mid differs from the recomputation by {worst}"
    );
}

/// Observing is read-only: the state and the next logits equal a plain prefill's.
#[test]
fn observing_changes_nothing() {
    let model = common::load("q2", Numerics::Fast);
    let p = &prompts(&model)[1];
    let mut a = Session::new(&model, 256).unwrap();
    let mut b = Session::new(&model, 256).unwrap();
    a.prefill(p).unwrap();
    b.prefill_observed(p, &mut Tap::default()).unwrap();
    assert!(b.logits().is_empty());
    assert_eq!(a.tokens(), b.tokens());
    let (ka, kb) = (
        a.backend().export_state().unwrap(),
        b.backend().export_state().unwrap(),
    );
    assert!(ka == kb, "the KV state differs");
    let la = a.decode(7).unwrap().to_vec();
    let lb = b.decode(7).unwrap().to_vec();
    assert_eq!(la, lb);
}
