//! Loading the model and tokenizer, choosing the backend, creating sessions.

use std::io::IsTerminal;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use ds4_engine::cuda::{driver_present, CudaBackend, CudaWeights};
use ds4_engine::{LoadOptions, Model, Numerics, Session, SessionOptions};
use ds4_gguf::GgufFile;
use ds4_tokenizer::{SpecialIds, Tokenizer};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::BackendArg;

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

/// The tokenizer of a DS4 GGUF, from its `tokenizer.ggml.*` metadata.
pub fn tokenizer_from_gguf(gguf: &GgufFile) -> Result<Tokenizer> {
    ds4_cli::tok::from_gguf(gguf)
}

/// Everything a run needs: model, tokenizer, backend choice.
pub struct Engine {
    pub model: Model,
    pub tok: Tokenizer,
    pub numerics: Numerics,
    cuda: Option<Arc<CudaWeights>>,
}

impl Engine {
    pub fn load(path: &Path, numerics: Numerics, want: Option<BackendArg>) -> Result<Engine> {
        check_model_exists(path)?;
        let model = Model::load(path, LoadOptions { numerics })
            .with_context(|| format!("cannot load {}", path.display()))?;
        let tok = tokenizer_from_gguf(model.gguf())
            .with_context(|| format!("tokenizer of {}", path.display()))?;
        tok.special_ids()
            .context("the model's vocabulary lacks the chat markers")?;
        let cuda = match want {
            Some(BackendArg::Cpu) => None,
            _ if !driver_present() => {
                if want == Some(BackendArg::Cuda) {
                    eprintln!("ds4: no CUDA driver on this machine; using the CPU backend");
                }
                None
            }
            _ => match upload(&model) {
                Ok(w) => Some(w),
                Err(e) => {
                    eprintln!("ds4: CUDA backend unavailable ({e:#}); using the CPU backend");
                    None
                }
            },
        };
        Ok(Engine {
            model,
            tok,
            numerics,
            cuda,
        })
    }

    pub fn backend_name(&self) -> &'static str {
        if self.cuda.is_some() {
            "cuda"
        } else {
            "cpu"
        }
    }

    pub fn specials(&self) -> &SpecialIds {
        self.tok
            .special_ids()
            .expect("checked when the engine was loaded")
    }

    /// A fresh, empty session of `ctx` tokens on the chosen backend.
    pub fn session(&self, ctx: usize) -> Result<Session> {
        let opts = SessionOptions {
            numerics: Some(self.numerics),
            ..SessionOptions::new(ctx)
        };
        match &self.cuda {
            None => Ok(Session::with_options(&self.model, opts)?),
            Some(w) => {
                let b = CudaBackend::new(w, ctx, self.numerics)?;
                Ok(Session::with_backend(
                    &self.model,
                    Box::new(b),
                    self.numerics,
                    opts.prefill_chunk,
                ))
            }
        }
    }

    /// One line for stderr at startup.
    pub fn describe(&self) -> String {
        let c = self.model.config();
        format!(
            "ds4: {} layers, vocab {}, backend {}, {} numerics",
            c.n_layer,
            c.vocab,
            self.backend_name(),
            match self.numerics {
                Numerics::Exact => "exact (--quality)",
                Numerics::Fast => "fast",
            }
        )
    }
}

fn upload(model: &Model) -> Result<Arc<CudaWeights>> {
    let total = model.gguf().tensor_bytes();
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::new(total)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(
            "uploading weights {bar:40} {binary_bytes}/{binary_total_bytes}",
        )
        .expect("valid template"),
    );
    let w = CudaBackend::load(model, 0, &|bytes| bar.inc(bytes as u64))?;
    bar.finish_and_clear();
    Ok(w)
}
