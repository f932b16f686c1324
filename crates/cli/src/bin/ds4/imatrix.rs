//! `--imatrix-dataset F --imatrix-out OUT.dat`: routed-expert importance matrix over a
//! calibration dataset (the reference's `ds4_engine_collect_imatrix`; format and
//! statistics in ds4-engine's `imatrix.rs`).

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use ds4_engine::{split_dataset, ImatrixCollector};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::Args;
use crate::engine::Engine;

/// The dataset text, read and checked before the model loads: a file that is not
/// UTF-8 or holds no prompt is a usage error (status 2), not minutes of loading.
pub fn load_dataset(path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path)
        .map_err(|e| format!("cannot read --imatrix-dataset {}: {e}", path.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| format!("--imatrix-dataset {} is not UTF-8 text", path.display()))?;
    if split_dataset(&text).is_empty() {
        return Err(format!(
            "--imatrix-dataset {} holds no prompt (expected rendered prompts, separated by \
             `{}` lines, or one prompt)",
            path.display(),
            ds4_engine::PROMPT_MARKER
        ));
    }
    Ok(text)
}

/// Prefills each prompt from an empty state (truncated to the context and to what is
/// left of --imatrix-max-tokens) with the collector observing, then writes the file.
pub fn run(engine: &Engine, args: &Args, dataset: &str) -> Result<()> {
    let (src, out) = (
        args.imatrix_dataset.as_deref().expect("clap requires it"),
        args.imatrix_out.as_deref().expect("checked by the caller"),
    );
    let prompts = split_dataset(dataset);
    let total = args
        .imatrix_max_prompts
        .map_or(prompts.len(), |m| m.min(prompts.len()));
    eprintln!(
        "ds4: collecting routed-MoE imatrix from {} ({} prompts, ctx={})",
        src.display(),
        total,
        args.ctx
    );
    let mut collector = ImatrixCollector::new(&engine.info().hparams);
    let mut session = engine.session(args.ctx)?;
    let bar = progress_bar(total as u64);
    let t0 = Instant::now();
    let (mut done, mut tokens) = (0usize, 0usize);
    for p in prompts.iter().take(total) {
        let mut ids = engine.tok.encode(p);
        ids.truncate(args.ctx);
        if let Some(max) = args.imatrix_max_tokens {
            ids.truncate(max - tokens);
        }
        if !ids.is_empty() {
            session.reset();
            session
                .prefill_observed(&ids, &mut collector)
                .with_context(|| format!("imatrix prefill failed at prompt {}", done + 1))?;
            done += 1;
            tokens += ids.len();
        }
        bar.inc(1);
        bar.set_message(format!("{tokens} tokens"));
        if args.imatrix_max_tokens.is_some_and(|m| tokens >= m) {
            break;
        }
    }
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let m = collector.to_imatrix(&src.to_string_lossy());
    let mut w = std::io::BufWriter::new(
        std::fs::File::create(out).with_context(|| format!("cannot create {}", out.display()))?,
    );
    m.write_to(&mut w)
        .and_then(|_| w.flush())
        .with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!(
        "ds4: wrote imatrix {} from {done} prompts, {tokens} tokens, {} routed expert \
         observations ({:.1} tokens/s, {} backend)",
        out.display(),
        collector.routes(),
        tokens as f64 / secs.max(1e-9),
        session.backend_name()
    );
    Ok(())
}

fn progress_bar(n: u64) -> ProgressBar {
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::new(n)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("imatrix {bar:40} {pos}/{len} prompts, {msg} ({eta})")
            .expect("valid template"),
    );
    bar
}
