//! Speculative decoding on the CUDA backend (#20): the greedy tokens of
//! [`Speculator::advance`] — MTP drafts verified by the native multi-row step, rejected
//! rows rolled back on the device — must be exactly the plain decode loop's, on each
//! tiny fixture model in Exact numerics. Random MTP weights accept almost nothing, so
//! a draft hook proposes the plain run's own next token 3 times in 4: full, partial
//! and rejected cycles all happen.

use std::sync::Arc;

use anyhow::Result;

use super::Tally;
use crate::dev::{CudaBackend, CudaWeights, Model, SessionExt};
use crate::mtp::Mtp;
use crate::{argmax, Numerics, Sampler, SamplerConfig, Session, SpecOptions, Speculator};

/// Tokens generated after the prompt.
const N_GEN: usize = 160;

/// A session on `stages`: one upload (a single GPU), or several (a split model,
/// `cuda/split.rs`, whose multi-row steps and drafts run stage by stage).
fn session(model: &Model, stages: &[Arc<CudaWeights>], prompt: &[u32]) -> Result<Session> {
    let b: Box<dyn crate::dev::Backend> = match stages {
        [one] => Box::new(CudaBackend::new(one, 4096, Numerics::Exact)?),
        many => Box::new(crate::cuda::SplitBackend::new(many, 4096, Numerics::Exact)?),
    };
    let mut s = Session::with_backend(model, b, Numerics::Exact, 2048);
    s.prefill(prompt)?;
    Ok(s)
}

/// One model's check: plain greedy tokens, then the speculative ones for drafts of 1, 2
/// and 4. Returns the report line and whether it passed.
pub(super) fn spec_identity(
    model: &Model,
    weights: &[Arc<CudaWeights>],
    mtp: &Mtp,
    prompt: &[u32],
    variant: &str,
    tally: &mut Tally,
    line: &mut dyn FnMut(&str),
) -> Result<()> {
    let mtp = mtp.clone().with_numerics(Numerics::Exact);
    let mut plain = session(model, weights, prompt)?;
    let mut want = vec![argmax(plain.logits())];
    while want.len() < N_GEN {
        plain.decode(*want.last().expect("one token"))?;
        want.push(argmax(plain.logits()));
    }
    // The gate at 0.25 stops some drafts (the host then reads each draft's gap before
    // the verify is launched); without it the verify follows the drafts at once.
    for (draft, margin) in [(1usize, 0.0f32), (2, 0.0), (4, 0.0), (2, 0.25)] {
        let mut spec = Speculator::new(mtp.clone(), SpecOptions { draft, margin })?;
        let (truth, p0) = (want.clone(), prompt.len());
        let mut x = draft as u64;
        // The plain run's token 2 times in 4, another token once, and once the MTP's
        // own draft (on CUDA the device's pick, which the host never sees first).
        spec.set_draft_hook(Box::new(move |pos| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let t = truth.get(pos - p0).copied()?;
            match x >> 62 {
                0 => Some(t ^ 1),
                1 => None,
                _ => Some(t),
            }
        }));
        let mut s = session(model, weights, prompt)?;
        let mut sampler = Sampler::new(SamplerConfig::greedy());
        let mut got = vec![argmax(s.logits())];
        // After every cycle the session's logits (on CUDA a row kept on the device by
        // the commit, fetched by this read) pick the cycle's last token.
        let mut logits_ok = true;
        while got.len() < N_GEN {
            let last = *got.last().expect("one token");
            let out = spec.advance(&mut s, &mut sampler, last, N_GEN - got.len(), &[])?;
            logits_ok &= out.last() == Some(&argmax(s.logits()));
            got.extend(out);
        }
        // And at the end they are the plain loop's (the last cycle's step rows against
        // single decodes: the same tokens, sums in another order in places).
        let scale = plain.logits().iter().fold(1f32, |m, v| m.max(v.abs()));
        let diff = (s.logits().iter().zip(plain.logits()))
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        let same_logits = s.n_tokens() == plain.n_tokens()
            && s.logits().len() == plain.logits().len()
            && diff <= 1e-4;
        let st = spec.stats();
        let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
        let ok =
            got == want && logits_ok && same_logits && st.accepted > 0 && st.accepted < st.drafted;
        let gate = if margin > 0.0 {
            format!(
                ", gate {margin}: {} drafts in {} cycles",
                st.drafted, st.cycles
            )
        } else {
            String::new()
        };
        tally.record(
            line,
            ok,
            format_args!(
                "{variant:<6} spec{} Exact  draft {draft}: {N_GEN} greedy tokens {} the plain loop's, logits {} of theirs ({:.2} tokens/cycle, {}/{} drafts accepted{gate})",
                if weights.len() > 1 { " split" } else { "" },
                match first_diff {
                    None => "equal".to_string(),
                    Some(i) => format!("differ from (first at {i})"),
                },
                match (logits_ok, same_logits) {
                    (true, true) => format!("within {diff:.1e}"),
                    (false, _) => "NOT picking each cycle's last token".to_string(),
                    (true, false) => format!(
                        "NOT the plain loop's at the end ({diff:.1e}, {} / {} tokens)",
                        s.n_tokens(),
                        plain.n_tokens()
                    ),
                },
                st.tokens_per_cycle(),
                st.accepted,
                st.drafted
            ),
        );
    }
    Ok(())
}
