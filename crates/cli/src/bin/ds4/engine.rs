//! Opening the model on the chosen backend, its tokenizer, creating sessions.

use std::io::IsTerminal;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ds4_engine::{
    BackendChoice, EngineOptions, ModelInfo, Numerics, Session, SpecOptions, Speculator,
};
use ds4_tokenizer::{SpecialIds, Tokenizer};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{Args, BackendArg};

/// Says the model file is missing and how to get it.
pub fn check_model_exists(path: &Path) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    bail!(
        "model file {} not found.\n\
         Download the published weights (about 81 GB) and link ./ds4flash.gguf with:\n\
         \n    ds4-tool download q2-imatrix\n\n\
         or point -m at a GGUF file.",
        path.display()
    )
}

/// Everything a run needs: the engine (model on its backend) and the tokenizer.
pub struct Engine {
    engine: ds4_engine::Engine,
    pub tok: Arc<Tokenizer>,
    /// `--trace`: one record per run.
    trace: Option<crate::trace::Trace>,
}

impl Engine {
    pub fn load(
        path: &Path,
        numerics: Numerics,
        want: Option<BackendArg>,
        memory: ds4_engine::MemoryOptions,
    ) -> Result<Engine> {
        check_model_exists(path)?;
        let backend = match want {
            None => BackendChoice::Auto,
            // `-t` already sized rayon's global pool, which the CPU backend uses.
            Some(BackendArg::Cpu) => BackendChoice::Cpu { threads: None },
            Some(BackendArg::Cuda) => BackendChoice::Cuda { device: 0 },
        };
        let bar = upload_bar();
        let progress = {
            let bar = bar.clone();
            Box::new(move |done: u64, total: u64| {
                bar.set_length(total);
                bar.set_position(done);
            })
        };
        let engine = ds4_engine::Engine::open(
            path,
            EngineOptions {
                backend,
                numerics,
                progress: Some(progress),
                memory,
            },
        )
        .with_context(|| format!("cannot load {}", path.display()))?;
        bar.finish_and_clear();
        let tok = engine
            .tokenizer()
            .with_context(|| format!("tokenizer of {}", path.display()))?;
        tok.special_ids()
            .context("the model's vocabulary lacks the chat markers")?;
        Ok(Engine {
            engine,
            tok,
            trace: None,
        })
    }

    /// The `--dir-steering-*` and `--warm-weights` flags, after the model loaded.
    pub fn configure(&mut self, args: &Args) -> Result<()> {
        let steering = self
            .engine
            .steer_from_flags(
                args.dir_steering_file.as_deref(),
                args.dir_steering_ffn,
                args.dir_steering_attn,
            )
            .context("--dir-steering-file")?;
        if let Some(s) = steering {
            eprintln!(
                "ds4: directional steering: {} ffn={} attn={}",
                args.dir_steering_file
                    .as_deref()
                    .unwrap_or(Path::new(""))
                    .display(),
                s.ffn,
                s.attn
            );
        }
        if args.warm_weights {
            self.warm(&args.model)?;
        }
        if let Some(path) = &args.trace {
            self.trace = Some(crate::trace::Trace::create(path)?);
        }
        Ok(())
    }

    /// Writes `run`'s `--trace` record (nothing without the flag).
    pub fn trace(&self, args: &Args, run: crate::trace::Run) -> Result<()> {
        match &self.trace {
            Some(t) => t.record(args, &self.tok, &run),
            None => Ok(()),
        }
    }

    /// `--warm-weights`: reads the model file once (a bar on a terminal). On CUDA the
    /// weights were read by the upload, so there is nothing left to do.
    fn warm(&self, path: &Path) -> Result<()> {
        if self.engine.backend() != ds4_engine::BackendKind::Cpu {
            eprintln!(
                "ds4: --warm-weights: nothing to do on {} (the upload read every weight)",
                self.backend_name()
            );
            return Ok(());
        }
        let bar = upload_bar();
        bar.set_style(
            ProgressStyle::with_template(
                "warming weights {bar:40} {binary_bytes}/{binary_total_bytes}",
            )
            .expect("valid template"),
        );
        let t0 = std::time::Instant::now();
        let n = ds4_cli::warm::warm_file(path, |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        })
        .with_context(|| format!("--warm-weights: reading {}", path.display()))?;
        bar.finish_and_clear();
        eprintln!(
            "ds4: warm weights: read {:.1} GiB in {:.1} s",
            n as f64 / (1u64 << 30) as f64,
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Steering in force as (ffn, attn) scales, for the trace (`None`: off).
    pub fn steering(&self) -> Option<(f32, f32)> {
        self.engine.steering().map(|s| (s.ffn, s.attn))
    }

    pub fn backend_name(&self) -> &'static str {
        self.engine.backend().name()
    }

    pub fn numerics(&self) -> Numerics {
        self.engine.numerics()
    }

    pub fn info(&self) -> &ModelInfo {
        self.engine.info()
    }

    pub fn specials(&self) -> &SpecialIds {
        self.tok
            .special_ids()
            .expect("checked when the engine was loaded")
    }

    /// A fresh, empty session of `ctx` tokens on the chosen backend.
    pub fn session(&self, ctx: usize) -> Result<Session> {
        Ok(self.engine.new_session(ctx)?)
    }

    /// The speculative loop of `--mtp` (`None` without it): loads the MTP file, which
    /// must match the model.
    pub fn speculator(&self, args: &Args) -> Result<Option<Speculator>> {
        let Some(path) = &args.mtp else {
            return Ok(None);
        };
        let mtp = self
            .engine
            .load_mtp(path)
            .with_context(|| format!("cannot load the MTP file {}", path.display()))?;
        let opts = SpecOptions {
            draft: args.mtp_draft,
            margin: args.mtp_margin,
        };
        Ok(Some(Speculator::new(mtp, opts)?))
    }

    /// One line for stderr at startup.
    pub fn describe(&self) -> String {
        let c = self.info();
        format!(
            "ds4: {} layers, vocab {}, backend {} ({}), {} numerics",
            c.hparams.n_layer,
            c.hparams.vocab,
            self.backend_name(),
            self.engine.backend_reason(),
            match self.numerics() {
                Numerics::Exact => "exact (--quality)",
                Numerics::Fast => "fast",
            }
        )
    }
}

/// The weight-upload bar (hidden unless stderr is a terminal).
fn upload_bar() -> ProgressBar {
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "uploading weights {bar:40} {binary_bytes}/{binary_total_bytes}",
        )
        .expect("valid template"),
    );
    bar
}
