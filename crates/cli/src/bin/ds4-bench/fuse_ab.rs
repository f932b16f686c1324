//! `ds4-bench --fuse-ab LABEL=SETTING …`: decode speed of several `DS4_CUDA_FUSE`
//! settings in one process. The weights are generated and uploaded once (most of a
//! full-size run), then each setting, in interleaved rounds, gets a fresh session
//! whose decode graph is captured under it.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ds4_engine::cuda::CudaBackend;
use ds4_engine::{Model, Session};

use crate::{bar, decode_greedy, eos_token, prompt_tokens, Args};

/// One setting: its label and the `DS4_CUDA_FUSE` value (`None`: the defaults).
pub struct Spec {
    label: String,
    setting: Option<String>,
}

/// `LABEL=SETTING` per option; `all` means the defaults.
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
            Ok(Spec {
                label: label.to_string(),
                setting: (setting != "all").then(|| setting.to_string()),
            })
        })
        .collect()
}

pub fn run(a: &Args, model: &Model, specs: &[Spec], alloc: usize) -> Result<()> {
    let total = model.gguf().tensor_bytes();
    let b = bar(total, "uploading weights to the GPU");
    let done = AtomicU64::new(0);
    let weights = CudaBackend::load(model, a.device, &|n| {
        b.set_position(done.fetch_add(n as u64, Ordering::Relaxed) + n as u64)
    })
    .context("CUDA backend unavailable")?;
    b.finish_and_clear();
    let gpu = weights.gpu.clone();
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
    for round in 1..=a.rounds.max(1) {
        for spec in specs {
            let kept = gpu.set_fusions(spec.setting.as_deref());
            if round == 1 {
                eprintln!("ds4-bench: {} = {}", spec.label, kept.join(","));
            }
            let be = CudaBackend::new(&weights, alloc, numerics)?;
            let mut session = Session::with_backend(model, Box::new(be), numerics, 2048);
            let t = Instant::now();
            session.prefill(&prompt)?;
            let prefill_s = t.elapsed().as_secs_f64();
            let gen_s = decode_greedy(&mut session, a.gen_tokens, eos)?;
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_specs;

    #[test]
    fn specs_parse() {
        let s = parse_specs(&["base=all".into(), "x=q_norm,prio".into(), "none=0".into()]).unwrap();
        assert_eq!(s[0].label, "base");
        assert_eq!(s[0].setting, None);
        assert_eq!(s[1].setting.as_deref(), Some("q_norm,prio"));
        assert_eq!(s[2].setting.as_deref(), Some("0"));
        assert!(parse_specs(&["nolabel".into()]).is_err());
        assert!(parse_specs(&["=all".into()]).is_err());
        assert!(parse_specs(&["a,b=all".into()]).is_err());
    }
}
