//! `ds4 --trace FILE`: one record per run (a one-shot prompt, or each interactive
//! turn), in the layout of ds4-server's `--trace` (docs/server.md): a header with the
//! settings, the rendered prompt, the generated text, then the result and timings.
//! The file is truncated at start and each record is written whole, unbuffered.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result};
use ds4_tokenizer::Tokenizer;

use crate::args::{Args, Think};
use crate::generate::Generated;

pub struct Trace {
    file: Mutex<(File, usize)>,
}

/// What one run did, for its record.
pub struct Run<'a> {
    pub mode: &'static str,
    pub think: Think,
    /// The tokens this run prefilled (the whole prompt, or a turn's new tokens) and
    /// the tokens of the context before them (reused state).
    pub prompt: &'a [u32],
    pub cached: usize,
    pub prefill: Duration,
    pub generated: &'a Generated,
    /// Tokens the run was allowed to generate.
    pub max: usize,
    /// The backend and the steering in force (`ffn`, `attn`), for the header.
    pub backend: &'a str,
    pub steering: Option<(f32, f32)>,
}

impl Trace {
    pub fn create(path: &Path) -> Result<Trace> {
        let f = File::create(path).with_context(|| format!("--trace {}", path.display()))?;
        Ok(Trace {
            file: Mutex::new((f, 0)),
        })
    }

    /// Appends the record of `run`.
    pub fn record(&self, args: &Args, tok: &Tokenizer, run: &Run) -> Result<()> {
        let text = |ids: &[u32]| {
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&t| tok.token_bytes(t).to_vec())
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        };
        let g = run.generated;
        let finish = if g.interrupted {
            "interrupted"
        } else if g.tokens.len() >= run.max {
            "length"
        } else {
            "stop"
        };
        let rate = |n: usize, d: Duration| match d.as_secs_f64() {
            s if s > 0.0 => n as f64 / s,
            _ => 0.0,
        };
        let mut guard = self.file.lock().expect("trace lock");
        let (f, n) = &mut *guard;
        *n += 1;
        let mut s = format!("===== run {n} {} =====\n", ds4_cli::clock::utc_now());
        s.push_str(&format!(
            "kind: {}\nmodel: {}\nbackend: {}\nthink_mode: {}\nprompt_tokens: {}\ncached_tokens: {}\nmax_tokens: {}\ntemperature: {}\ntop_p: {}\nmin_p: {}\nseed: {}\n",
            run.mode,
            args.model.display(),
            run.backend,
            run.think.name(),
            run.prompt.len(),
            run.cached,
            run.max,
            args.temp,
            args.top_p,
            args.min_p,
            args.seed.map_or("clock".to_string(), |v| v.to_string()),
        ));
        if let Some((ffn, attn)) = run.steering {
            s.push_str(&format!("dir_steering: ffn={ffn} attn={attn}\n"));
        }
        s.push_str("--- rendered prompt ---\n");
        s.push_str(&text(run.prompt));
        s.push_str("\n--- generated text ---\n");
        s.push_str(&text(&g.tokens));
        s.push_str("\n--- parsed message ---\n");
        s.push_str(&format!(
            "finish: {finish}\ngenerated_tokens: {}\nprefill_sec: {:.3}\nprefill_tps: {:.2}\nelapsed_sec: {:.3}\ngeneration_tps: {:.2}\n",
            g.tokens.len(),
            run.prefill.as_secs_f64(),
            rate(run.prompt.len(), run.prefill),
            g.elapsed.as_secs_f64(),
            rate(g.tokens.len(), g.elapsed),
        ));
        s.push_str(&format!("===== end run {n} =====\n"));
        f.write_all(s.as_bytes()).context("writing the trace")?;
        Ok(())
    }
}
