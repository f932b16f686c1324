//! `logprob-vectors`: the official top-logprob vectors (`tests/test-vectors/official.vec`
//! of the reference, its `ds4_test --logprob-vectors`; server.md §8).
//!
//! Format (`#` lines and blank lines ignored):
//! ```text
//! case <id> <ctx> <steps> <prompt-file>
//! step <index> <selected-token-hex> <top-count>
//! top <token-hex> <official-logprob>
//! end
//! ```
//! Token texts are hex-encoded bytes. The prompt file is tried as written, then
//! relative to the .vec file's directory, then as `prompts/NAME` there. Per case the
//! prompt is BOS `<｜User｜>` text `<｜Assistant｜></think>`; at each step the local
//! greedy token's bytes must equal the official selected token's, and every official
//! top token must be among the local top 20 with |Δ logprob| ≤ 4. The local greedy
//! token is then decoded (the local trajectory, as the reference does).
//! `long_memory_archive` is skipped, as in the reference (the API and the official
//! graph disagree there).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ds4_cli::paths::{PathFlag, Want};

use crate::quality::{argmax, chat_prompt, log_sum_exp, EngineArgs};

/// Local alternatives an official top token must be among.
const LOCAL_TOP: usize = 20;
/// Largest |local − official| logprob accepted.
const MAX_DELTA: f64 = 4.0;
/// Cases the reference skips.
const SKIPPED: &[&str] = &["long_memory_archive"];

#[derive(clap::Args)]
pub struct Args {
    /// The vector file (official.vec format).
    #[arg(long = "vec", value_name = "FILE")]
    vec: PathBuf,
    #[command(flatten)]
    engine: EngineArgs,
    /// Use at most this context per case (the file's ctx is often 16384).
    #[arg(long, value_name = "N")]
    max_ctx: Option<usize>,
}

impl Args {
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        vec![
            PathFlag::new("vec", &self.vec, Want::File),
            PathFlag::new("model", &self.engine.model, Want::Model),
        ]
    }
}

#[derive(Debug, Default)]
pub struct Step {
    pub selected: Vec<u8>,
    pub top: Vec<(Vec<u8>, f64)>,
    /// The declared top count (the reference refuses more `top` lines).
    pub ntop: usize,
}

#[derive(Debug)]
pub struct VecCase {
    pub id: String,
    pub ctx: usize,
    pub prompt: String,
    pub steps: Vec<Step>,
}

fn hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Parses a whole .vec file; errors name the line.
pub fn parse(text: &str) -> Result<Vec<VecCase>> {
    let mut out: Vec<VecCase> = Vec::new();
    let mut open = false;
    let mut cur_step: Option<usize> = None;
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let err = |m: &str| anyhow::anyhow!("line {}: {m}: {line:?}", n + 1);
        match (f[0], open) {
            ("case", false) => {
                let [_, id, ctx, steps, prompt] = f[..] else {
                    return Err(err("expected `case ID CTX STEPS PROMPT`"));
                };
                let ctx: usize = ctx.parse().map_err(|_| err("bad ctx"))?;
                let steps: usize = steps.parse().map_err(|_| err("bad step count"))?;
                if steps == 0 || steps > 64 || ctx == 0 {
                    return Err(err("step count or ctx out of range"));
                }
                out.push(VecCase {
                    id: id.into(),
                    ctx,
                    prompt: prompt.into(),
                    steps: (0..steps).map(|_| Step::default()).collect(),
                });
                open = true;
                cur_step = None;
            }
            ("end", true) => {
                let c = out.last().expect("open");
                if let Some(i) = c.steps.iter().position(|s| s.selected.is_empty()) {
                    return Err(err(&format!("case {} has no step {i}", c.id)));
                }
                open = false;
            }
            ("step", true) => {
                let [_, i, sel, ntop] = f[..] else {
                    return Err(err("expected `step I HEX NTOP`"));
                };
                let c = out.last_mut().expect("open");
                let i: usize = i.parse().map_err(|_| err("bad step index"))?;
                let ntop: usize = ntop.parse().map_err(|_| err("bad top count"))?;
                let sel = hex(sel)
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| err("bad hex"))?;
                let s = c
                    .steps
                    .get_mut(i)
                    .ok_or_else(|| err("step index out of range"))?;
                *s = Step {
                    selected: sel,
                    top: Vec::with_capacity(ntop),
                    ntop,
                };
                cur_step = Some(i);
            }
            ("top", true) => {
                let [_, h, lp] = f[..] else {
                    return Err(err("expected `top HEX LOGPROB`"));
                };
                let i = cur_step.ok_or_else(|| err("`top` before any `step`"))?;
                let b = hex(h)
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| err("bad hex"))?;
                let lp: f64 = lp.parse().map_err(|_| err("bad logprob"))?;
                let s = &mut out.last_mut().expect("open").steps[i];
                if s.top.len() == s.ntop {
                    return Err(err(&format!("more than the {} top lines declared", s.ntop)));
                }
                s.top.push((b, lp));
            }
            (_, true) => return Err(err("unexpected line inside a case")),
            (_, false) => return Err(err("unexpected line outside a case")),
        }
    }
    if open {
        bail!("unterminated case {}", out.last().expect("open").id);
    }
    Ok(out)
}

fn prompt_path(vec: &Path, written: &str) -> Option<PathBuf> {
    let p = PathBuf::from(written);
    let dir = vec.parent().unwrap_or(Path::new("."));
    let name = p.file_name().map(PathBuf::from).unwrap_or_default();
    [p.clone(), dir.join(&p), dir.join("prompts").join(name)]
        .into_iter()
        .find(|t| t.is_file())
}

fn show(b: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(b))
}

pub fn run(a: Args) -> Result<()> {
    let text = std::fs::read_to_string(&a.vec)
        .with_context(|| format!("cannot read {}", a.vec.display()))?;
    let cases = parse(&text).with_context(|| format!("{}", a.vec.display()))?;
    if cases.is_empty() {
        bail!("{}: no cases", a.vec.display());
    }
    let engine = a.engine.open()?;
    let tok = engine.tokenizer()?;
    let vocab = engine.info().hparams.vocab;
    let bytes_of: Vec<Vec<u8>> = (0..vocab as u32)
        .map(|id| tok.decode_to_bytes(&[id], false))
        .collect();
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    for c in &cases {
        if SKIPPED.contains(&c.id.as_str()) {
            println!(
                "{}: skipped (API/official graph mismatch, as the reference)",
                c.id
            );
            skipped += 1;
            continue;
        }
        let path = prompt_path(&a.vec, &c.prompt)
            .with_context(|| format!("case {}: prompt file {} not found", c.id, c.prompt))?;
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let prompt = chat_prompt(&tok, &text)?;
        let ctx = a.max_ctx.map_or(c.ctx, |m| m.min(c.ctx));
        if prompt.len() + c.steps.len() > ctx {
            bail!(
                "case {}: {} prompt tokens exceed ctx={ctx}",
                c.id,
                prompt.len()
            );
        }
        let mut s = engine.new_session(ctx)?;
        s.prefill(&prompt)?;
        let mut problems = Vec::new();
        for (i, step) in c.steps.iter().enumerate() {
            let l = s.logits().to_vec();
            let lse = log_sum_exp(&l);
            let greedy = argmax(&l);
            if bytes_of[greedy as usize] != step.selected {
                problems.push(format!(
                    "step {i}: greedy token {} differs from the official {}",
                    show(&bytes_of[greedy as usize]),
                    show(&step.selected)
                ));
            }
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|&x, &y| l[y as usize].total_cmp(&l[x as usize]).then(x.cmp(&y)));
            order.truncate(LOCAL_TOP);
            for (b, official) in &step.top {
                match order.iter().find(|&&id| &bytes_of[id as usize] == b) {
                    None => problems.push(format!(
                        "step {i}: official top token {} is not in the local top {LOCAL_TOP}",
                        show(b)
                    )),
                    Some(&id) => {
                        let local = l[id as usize] as f64 - lse;
                        if (local - official).abs() > MAX_DELTA {
                            problems.push(format!(
                                "step {i}: token {} logprob local {local:.4} official {official:.4} (|Δ| > {MAX_DELTA})",
                                show(b)
                            ));
                        }
                    }
                }
            }
            if i + 1 < c.steps.len() {
                s.decode(greedy)?;
            }
        }
        if problems.is_empty() {
            println!("{}: ok ({} steps)", c.id, c.steps.len());
            passed += 1;
        } else {
            println!("{}: FAIL", c.id);
            for p in &problems {
                println!("  {p}");
            }
            failed += 1;
        }
    }
    println!("summary: {passed} passed, {failed} failed, {skipped} skipped");
    if failed > 0 {
        bail!("{failed} of {} vector cases failed", cases.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_official_layout() {
        let t = "# ds4-official-logprob-vectors-v1\n\ncase a 4096 2 tests/p/a.txt\nstep 0 416461 2\ntop 416461 0\ntop 20 -1.5\nstep 1 0a 0\nend\n";
        let c = parse(t).unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(
            (c[0].id.as_str(), c[0].ctx, c[0].prompt.as_str()),
            ("a", 4096, "tests/p/a.txt")
        );
        assert_eq!(c[0].steps[0].selected, b"Ada");
        assert_eq!(
            c[0].steps[0].top,
            vec![(b"Ada".to_vec(), 0.0), (b" ".to_vec(), -1.5)]
        );
        assert_eq!(c[0].steps[1].selected, b"\n");
        for bad in [
            "case a 4096 2 p\nstep 0 41 0\nend\n", // step 1 missing
            "case a 4096 1 p\nstep 0 4 0\nend\n",  // odd hex
            "case a 4096 1 p\nstep 0 41 0\n",      // unterminated
            "step 0 41 0\n",                       // outside a case
            "case a 4096 1 p\ntop 41 0\nend\n",    // top before step
            "case a 4096 1 p\nstep 0 41 1\ntop 41 x\nend\n", // bad logprob
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
