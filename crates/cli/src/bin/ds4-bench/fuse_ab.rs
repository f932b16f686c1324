//! `ds4-bench --fuse-ab LABEL=SETTING …`: decode speed of several decode plans
//! (`DS4_CUDA_FUSE` values) in one process. The weights are generated and uploaded once
//! (most of a full-size run), then each plan, in interleaved rounds, gets a fresh
//! session of its own whose decode graph is captured under it.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ds4_cuda::DecodePlan;
use ds4_engine::dev::{CudaBackend, Model, SessionExt};
use ds4_engine::Session;

use crate::cycles::decode_greedy;
use crate::{bar, eos_token, memory, prompt_tokens, Args};

/// One setting: its label and the plan its `DS4_CUDA_FUSE` value names.
pub struct Spec {
    label: String,
    plan: DecodePlan,
}

/// `LABEL=SETTING` per option; `all` means the defaults. A setting that names no
/// variant is an error listing the valid names.
pub fn parse_specs(args: &[String]) -> Result<Vec<Spec>> {
    args.iter()
        .map(|a| {
            let Some((label, setting)) = a.split_once('=') else {
                bail!(
                    "--fuse-ab {a}: expected LABEL=SETTING (SETTING a DS4_CUDA_FUSE value, or all)"
                );
            };
            if label.is_empty() || label.contains(',') {
                bail!("--fuse-ab {a}: the label must be non-empty and without commas");
            }
            let plan = DecodePlan::parse((setting != "all").then_some(setting))
                .with_context(|| format!("--fuse-ab {a}"))?;
            Ok(Spec {
                label: label.to_string(),
                plan,
            })
        })
        .collect()
}

pub fn run(a: &Args, model: &Model, specs: &[Spec], alloc: usize) -> Result<()> {
    let total = model.gguf().tensor_bytes();
    let b = bar(total, "uploading weights to the GPU");
    let done = AtomicU64::new(0);
    let (weights, placed) = CudaBackend::load(model, a.device, &memory(a), &|n| {
        b.set_position(done.fetch_add(n as u64, Ordering::Relaxed) + n as u64)
    })
    .context("CUDA backend unavailable")?;
    eprintln!("ds4-bench: weights: {placed}");
    b.finish_and_clear();
    let numerics = model.numerics();
    let prompt = prompt_tokens(a, model, a.ctx_start)?;
    let eos = eos_token(model);
    let mut out: Box<dyn Write> = match &a.csv {
        Some(p) => Box::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        ),
        None => Box::new(std::io::stdout()),
    };
    writeln!(out, "label,round,ctx_tokens,prefill_tps,gen_tps")?;
    let rounds = a.rounds.max(1);
    let mut gen = vec![Vec::with_capacity(rounds); specs.len()];
    let mut pre = vec![Vec::with_capacity(rounds); specs.len()];
    // A setting that fails (an untried kernel variant, say) is reported and dropped; the
    // others go on, so one bad variant does not cost the whole comparison.
    let mut failed = vec![false; specs.len()];
    for round in 1..=rounds {
        // The round's first tokens, which every other setting's are compared with: a
        // variant that gives the same bits must give the same tokens (also at depth 43).
        let mut first: Option<(&str, Vec<u32>)> = None;
        for (si, spec) in specs.iter().enumerate() {
            if failed[si] {
                continue;
            }
            if round == 1 {
                eprintln!("ds4-bench: {} = {}", spec.label, spec.plan);
            }
            let run = || -> Result<(f64, f64, Vec<u32>)> {
                let be = CudaBackend::with_plan(&weights, alloc, numerics, spec.plan)?;
                let mut session = Session::with_backend(model, Box::new(be), numerics, 2048);
                let t = Instant::now();
                session.prefill(&prompt)?;
                let prefill_s = t.elapsed().as_secs_f64();
                let (timed, tokens) = decode_greedy(&mut session, a.gen_tokens, eos)?;
                Ok((prefill_s, timed.secs, tokens))
            };
            let (prefill_s, gen_s, tokens) = match run() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("ds4-bench: {} failed in round {round}: {e:#}", spec.label);
                    failed[si] = true;
                    continue;
                }
            };
            match &first {
                None => first = Some((&spec.label, tokens)),
                Some((label, want)) => match want.iter().zip(&tokens).position(|(a, b)| a != b) {
                    None if want.len() == tokens.len() => {
                        eprintln!(
                            "ds4-bench: {} round {round}: the tokens of {label}",
                            spec.label
                        )
                    }
                    at => eprintln!(
                        "ds4-bench: {} round {round}: tokens part from {label}'s at token {}",
                        spec.label,
                        at.unwrap_or(want.len().min(tokens.len()))
                    ),
                },
            }
            gen[si].push(a.gen_tokens as f64 / gen_s.max(1e-9));
            pre[si].push(prompt.len() as f64 / prefill_s.max(1e-9));
            writeln!(
                out,
                "{},{round},{},{:.2},{:.2}",
                spec.label,
                prompt.len(),
                prompt.len() as f64 / prefill_s,
                a.gen_tokens as f64 / gen_s.max(1e-9)
            )?;
            out.flush()?;
        }
    }
    for line in summary(specs, &gen, "decode") {
        eprintln!("{line}");
    }
    for line in summary(specs, &pre, "prefill") {
        eprintln!("{line}");
    }
    Ok(())
}

/// Mean speed (`what`: decode or prefill) per setting and its difference to the first
/// setting's. With two or more rounds the first is left out: a process's first sessions
/// run cold (first graphs, clocks) and would bias whichever setting comes first.
fn summary(specs: &[Spec], gen: &[Vec<f64>], what: &str) -> Vec<String> {
    let skip = usize::from(gen.first().is_some_and(|g| g.len() >= 2));
    let mean = |g: &Vec<f64>| {
        let g = if g.len() > skip { &g[skip..] } else { &g[..] };
        g.iter().sum::<f64>() / g.len().max(1) as f64
    };
    let base = gen.first().map(mean).unwrap_or(0.0);
    let rounds = if skip == 1 { "rounds 2+" } else { "all rounds" };
    specs
        .iter()
        .zip(gen)
        .map(|(spec, g)| {
            if g.is_empty() {
                return format!("ds4-bench: {what:<7} {:<12} failed", spec.label);
            }
            let m = mean(g);
            format!(
                "ds4-bench: {what:<7} {:<12} {m:9.2} tok/s ({rounds}) {:+8.2} vs {}",
                spec.label,
                m - base,
                specs[0].label
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{parse_specs, summary, DecodePlan};

    #[test]
    fn summary_leaves_the_first_round_out() {
        let specs = parse_specs(&["base=all".into(), "x=q_norm".into()]).unwrap();
        let lines = summary(
            &specs,
            &[vec![100.0, 140.0, 142.0], vec![145.0, 146.0, 148.0]],
            "decode",
        );
        assert!(lines[0].contains("decode"), "{}", lines[0]);
        assert!(
            lines[0].contains("141.00") && lines[0].contains("+0.00"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].contains("147.00") && lines[1].contains("+6.00"),
            "{}",
            lines[1]
        );
        // A failed setting says so.
        let lines = summary(&specs, &[vec![100.0, 140.0], vec![]], "decode");
        assert!(lines[1].contains("failed"), "{}", lines[1]);
        // One round: nothing left out.
        let lines = summary(&specs, &[vec![100.0], vec![110.0]], "prefill");
        assert!(
            lines[1].contains("110.00") && lines[1].contains("+10.00"),
            "{}",
            lines[1]
        );
    }

    #[test]
    fn specs_parse() {
        let s = parse_specs(&["base=all".into(), "x=q_norm,prio".into(), "none=0".into()]).unwrap();
        assert_eq!(s[0].label, "base");
        assert_eq!(s[0].plan, DecodePlan::default());
        assert_eq!(s[1].plan.to_string(), "q_norm,prio");
        assert_eq!(s[2].plan, DecodePlan::none());
        let e = parse_specs(&["x=nonsense".into()]).err().unwrap();
        assert!(format!("{e:#}").contains("q_norm"), "{e:#}");
        assert!(parse_specs(&["nolabel".into()]).is_err());
        assert!(parse_specs(&["=all".into()]).is_err());
        assert!(parse_specs(&["a,b=all".into()]).is_err());
    }
}
