//! `quality`: target-token NLL of official continuations (issue 24, part 4), the
//! reference's `gguf-tools/quality-testing/score_official.c`.
//!
//! Data layout (the reference's `collect_official.py` output): `DIR/manifest.tsv`
//! with rows `id  prompt_file  continuation_file  [response_file]` (`#` lines are
//! comments), or, without a manifest, `DIR/prompts/ID.txt` with
//! `DIR/continuations/ID.txt`. Manifest paths are tried as written, then relative to
//! DIR, then as `DIR/prompts/NAME` / `DIR/continuations/NAME` (the reference writes
//! them relative to its own checkout).
//!
//! Per case the prompt is BOS `<｜User｜>` text `<｜Assistant｜></think>` (no system
//! text, thinking off, as the official continuations were collected), the
//! continuation is tokenized as plain text, and each continuation token is scored by
//! its log-softmax probability after the tokens before it (teacher forcing). The
//! reference's TSV columns are printed (plus `ppl`), with the greedy first-token match
//! and greedy longest common prefix; `--csv`/`--json` write the same rows to files.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ds4_cli::paths::{PathFlag, Want};
use ds4_engine::{BackendChoice, Engine, EngineOptions, Numerics};
use ds4_tokenizer::Tokenizer;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    Cpu,
    Cuda,
}

/// What selects the engine, shared with `logprob-vectors`.
#[derive(clap::Args)]
pub struct EngineArgs {
    /// The GGUF model.
    #[arg(short = 'm', long)]
    pub model: PathBuf,
    /// Backend (default: cuda when a GPU is usable, else cpu).
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// Exact f32 numerics (the official math) instead of ds4's quantised activations.
    #[arg(long)]
    pub quality: bool,
}

impl EngineArgs {
    pub fn open(&self) -> Result<Engine> {
        let backend = match self.backend {
            None => BackendChoice::Auto,
            Some(BackendArg::Cpu) => BackendChoice::Cpu { threads: None },
            Some(BackendArg::Cuda) => BackendChoice::Cuda { device: 0 },
        };
        let numerics = if self.quality {
            Numerics::Exact
        } else {
            Numerics::Fast
        };
        let engine = Engine::open(
            &self.model,
            EngineOptions {
                backend,
                numerics,
                ..EngineOptions::default()
            },
        )
        .with_context(|| format!("cannot load {}", self.model.display()))?;
        eprintln!(
            "{}: backend {} ({}), {:?} numerics",
            self.model.display(),
            engine.backend().name(),
            engine.backend_reason(),
            numerics
        );
        Ok(engine)
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// Directory of official continuations (manifest.tsv, or prompts/ and continuations/).
    #[arg(long, value_name = "DIR")]
    vectors: PathBuf,
    #[command(flatten)]
    engine: EngineArgs,
    /// Context size of the scoring session (at least 1024, as the reference).
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Also write the per-case rows as CSV to this file.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Also write the rows and the summary as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

impl Args {
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        let mut v = vec![
            PathFlag::new("vectors", &self.vectors, Want::Dir),
            PathFlag::new("model", &self.engine.model, Want::Model),
        ];
        if let Some(p) = &self.csv {
            v.push(PathFlag::new("csv", p, Want::OutFile));
        }
        if let Some(p) = &self.json {
            v.push(PathFlag::new("json", p, Want::OutFile));
        }
        v
    }
}

/// BOS `<｜User｜>` text `<｜Assistant｜></think>`: the official vectors' prompt.
pub fn chat_prompt(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let sp = tok
        .special_ids()
        .context("the model's vocabulary lacks the chat markers")?;
    let mut v = vec![sp.bos, sp.user];
    v.extend(tok.encode_plain(text));
    v.push(sp.assistant);
    v.push(sp.think_end);
    Ok(v)
}

/// `log(sum(exp(logits)))` in f64, as the reference's logprob helpers.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| (v as f64 - max).exp())
        .sum();
    max + sum.ln()
}

/// The first index of the largest logit.
pub fn argmax(logits: &[f32]) -> u32 {
    ds4_engine::argmax(logits)
}

struct Case {
    id: String,
    prompt: PathBuf,
    continuation: PathBuf,
}

/// One scored case (a row of the reference's TSV, plus `ppl`).
#[derive(serde::Serialize)]
pub struct Score {
    pub id: String,
    pub prompt_tokens: usize,
    pub target_tokens: usize,
    pub nll: f64,
    pub avg_nll: f64,
    pub ppl: f64,
    pub first_match: bool,
    pub greedy_lcp: usize,
}

fn resolve(dir: &Path, written: &str, sub: &str) -> Result<PathBuf> {
    let p = PathBuf::from(written);
    let name = p.file_name().map(PathBuf::from).unwrap_or_default();
    let tries = [p.clone(), dir.join(&p), dir.join(sub).join(name)];
    tries
        .iter()
        .find(|t| t.is_file())
        .cloned()
        .with_context(|| format!("{written}: not found as written, under {}", dir.display()))
}

fn cases(dir: &Path) -> Result<Vec<Case>> {
    let manifest = dir.join("manifest.tsv");
    let mut out = Vec::new();
    if manifest.is_file() {
        let text = std::fs::read_to_string(&manifest)
            .with_context(|| format!("cannot read {}", manifest.display()))?;
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let f: Vec<&str> = line.split('\t').collect();
            if f.len() < 3 || f[..3].iter().any(|s| s.is_empty()) {
                bail!(
                    "{}:{}: bad manifest row (id, prompt file, continuation file)",
                    manifest.display(),
                    n + 1
                );
            }
            out.push(Case {
                id: f[0].to_string(),
                prompt: resolve(dir, f[1], "prompts")?,
                continuation: resolve(dir, f[2], "continuations")?,
            });
        }
    } else {
        let pdir = dir.join("prompts");
        let rd = std::fs::read_dir(&pdir).with_context(|| {
            format!(
                "{}: no manifest.tsv and no prompts/ directory",
                dir.display()
            )
        })?;
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.ends_with(".txt"))
            .collect();
        names.sort();
        for n in names {
            out.push(Case {
                id: n.trim_end_matches(".txt").to_string(),
                prompt: pdir.join(&n),
                continuation: resolve(dir, &format!("continuations/{n}"), "continuations")?,
            });
        }
    }
    if out.is_empty() {
        bail!("{}: no cases", dir.display());
    }
    Ok(out)
}

fn read(p: &Path) -> Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
}

pub fn run(a: Args) -> Result<()> {
    let cases = cases(&a.vectors)?;
    let ctx = a.ctx.max(1024);
    let engine = a.engine.open()?;
    let tok = engine.tokenizer()?;
    let mut session = engine.new_session(ctx)?;
    let vocab = session.vocab();
    println!("id\tprompt_tokens\ttarget_tokens\tnll\tavg_nll\tfirst_match\tgreedy_lcp\tppl");
    let mut scores = Vec::new();
    for c in &cases {
        let prompt = chat_prompt(&tok, &read(&c.prompt)?)?;
        let target = tok.encode_plain(&read(&c.continuation)?);
        if prompt.len() + target.len() + 1 >= ctx {
            bail!("{} exceeds ctx={ctx}", c.id);
        }
        session.reset();
        session.prefill(&prompt)?;
        let mut rows = session.logits().to_vec();
        // Teacher forcing: the logits after each continuation token but the last.
        if target.len() > 1 {
            rows.extend(session.prefill_all_logits(&target[..target.len() - 1])?);
        }
        let (mut nll, mut lcp, mut matching) = (0.0f64, 0usize, true);
        let mut first_match = false;
        for (i, &t) in target.iter().enumerate() {
            let l = &rows[i * vocab..(i + 1) * vocab];
            let greedy = argmax(l);
            if i == 0 {
                first_match = greedy == t;
            }
            if matching && greedy == t {
                lcp += 1;
            } else {
                matching = false;
            }
            nll -= l[t as usize] as f64 - log_sum_exp(l);
        }
        let n = target.len();
        let avg = if n > 0 { nll / n as f64 } else { 0.0 };
        let s = Score {
            id: c.id.clone(),
            prompt_tokens: prompt.len(),
            target_tokens: n,
            nll,
            avg_nll: avg,
            ppl: avg.exp(),
            first_match,
            greedy_lcp: lcp,
        };
        println!(
            "{}\t{}\t{}\t{:.9}\t{:.9}\t{}\t{}\t{:.6}",
            s.id,
            s.prompt_tokens,
            s.target_tokens,
            s.nll,
            s.avg_nll,
            s.first_match as u8,
            s.greedy_lcp,
            s.ppl
        );
        scores.push(s);
    }
    let tokens: usize = scores.iter().map(|s| s.target_tokens).sum();
    let total: f64 = scores.iter().map(|s| s.nll).sum();
    let avg = if tokens > 0 {
        total / tokens as f64
    } else {
        0.0
    };
    let first = scores.iter().filter(|s| s.first_match).count();
    let avg_lcp = scores.iter().map(|s| s.greedy_lcp).sum::<usize>() as f64 / scores.len() as f64;
    eprintln!(
        "summary cases={} tokens={tokens} avg_nll={avg:.9} ppl={:.6} first_match={first} avg_lcp={avg_lcp:.3}",
        scores.len(),
        avg.exp()
    );
    if let Some(p) = &a.csv {
        let mut s =
            String::from("id,prompt_tokens,target_tokens,nll,avg_nll,ppl,first_match,greedy_lcp\n");
        for r in &scores {
            s += &format!(
                "{},{},{},{:.9},{:.9},{:.6},{},{}\n",
                r.id,
                r.prompt_tokens,
                r.target_tokens,
                r.nll,
                r.avg_nll,
                r.ppl,
                r.first_match as u8,
                r.greedy_lcp
            );
        }
        std::fs::write(p, s).with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &a.json {
        let v = serde_json::json!({
            "model": a.engine.model.display().to_string(),
            "cases": scores,
            "summary": {
                "cases": scores.len(), "tokens": tokens, "nll": total, "avg_nll": avg,
                "ppl": avg.exp(), "first_token_matches": first, "avg_greedy_lcp": avg_lcp,
            },
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}
