//! The forward pass against the official reference's logits on the tiny fixtures
//! (fixtures/tiny/README.md): every variant × sequence × position, both numeric
//! modes, and the 16-step greedy continuations.

mod common;

use common::*;
use ds4_engine::dev::SessionExt;
use ds4_engine::{Numerics, Session};

const VOCAB: usize = 512;

/// Runs all three sequences (all-position prefill, then 16 greedy decode steps from
/// the end of the prefill) and checks them against the tier of `numerics`.
fn check_variant(variant: &str, numerics: Numerics) {
    let model = load(variant, numerics);
    let mut failures = Vec::new();
    for seq in ["a", "b", "c"] {
        let e = expected(variant, seq);
        let margins = floats(&e["top1_top2_margin"]);
        let want = read_f32(e["logits"].as_str().unwrap());
        let mut s = Session::new(&model, 4096).unwrap();
        let got = s.prefill_all_logits(&tokens(seq)).unwrap();
        let st = compare(&got, &want, VOCAB, &margins);
        println!(
            "{variant:5} {seq} {numerics:?}: positions {:3}  max {:.3e}  median {:.3e}  p99 {:.3e}  argmax {:.1}%  worst mismatch margin {:.3}",
            st.per_pos.len(),
            st.max,
            st.median,
            st.p99,
            100.0 * st.argmax_agree,
            st.worst_mismatch_margin
        );
        match numerics {
            Numerics::Exact => {
                if st.max > 1e-3 || st.median > 1e-4 || st.worst_mismatch_margin >= 2e-3 {
                    failures.push(format!("{variant} {seq}: exact tier failed: {st:?}"));
                }
            }
            Numerics::Fast => {
                if st.max > 1.0
                    || st.median > 0.15
                    || st.p99 > 0.5
                    || st.argmax_agree < 0.95
                    || st.worst_mismatch_margin >= 0.75
                {
                    failures.push(format!("{variant} {seq}: ds4 tier failed: {st:?}"));
                }
            }
        }

        // Greedy continuation: row 0 is the last prefill row, row i follows i tokens.
        let g = &e["greedy"];
        let want_tokens = ids(&g["tokens"]);
        let gmargins = floats(&g["top1_top2_margin"]);
        let want_logits = read_f32(g["logits"].as_str().unwrap());
        let mut got_tokens = Vec::new();
        let mut max_d = 0.0f64;
        for i in 0..want_tokens.len() {
            if i > 0 {
                s.decode(*got_tokens.last().unwrap()).unwrap();
            }
            let l = s.logits();
            let w = &want_logits[i * VOCAB..(i + 1) * VOCAB];
            // Logits are only comparable while the token histories agree.
            if got_tokens == want_tokens[..i] {
                let d = l
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (*a as f64 - *b as f64).abs())
                    .fold(0.0, f64::max);
                max_d = max_d.max(d);
            }
            got_tokens.push(argmax(l) as u32);
        }
        let first_diff = got_tokens
            .iter()
            .zip(&want_tokens)
            .position(|(a, b)| a != b);
        println!(
            "{variant:5} {seq} {numerics:?}: greedy {} / 16 tokens identical, max |Δ| {:.3e}",
            first_diff.unwrap_or(16),
            max_d
        );
        match numerics {
            Numerics::Exact => {
                if first_diff.is_some() || max_d > 1e-3 {
                    failures.push(format!(
                        "{variant} {seq}: greedy {got_tokens:?} vs {want_tokens:?}, max {max_d}"
                    ));
                }
            }
            Numerics::Fast => {
                // Identical up to the first step whose expected margin is < 0.75.
                let limit = gmargins.iter().position(|&m| m < 0.75).unwrap_or(16);
                if let Some(d) = first_diff {
                    if d < limit {
                        failures.push(format!(
                            "{variant} {seq}: greedy differs at step {d} (margin {} ≥ 0.75)",
                            gmargins[d]
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// One test per variant and numeric mode.
macro_rules! variant_tests {
    ($($name:ident: $variant:literal, $numerics:ident;)*) => {$(
        #[test]
        fn $name() {
            check_variant($variant, Numerics::$numerics);
        }
    )*};
}

variant_tests! {
    exact_plain: "plain", Exact;
    exact_q2: "q2", Exact;
    exact_q4: "q4", Exact;
    fast_plain: "plain", Fast;
    fast_q2: "q2", Fast;
    fast_q4: "q4", Fast;
}
