//! A generation session: token history, current logits and a backend holding the state.

use crate::backend::{Backend, LogitRows};
use crate::cpu::CpuBackend;
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::ops::linear::Numerics;

#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Context capacity in tokens.
    pub ctx: usize,
    /// `None`: the model's default.
    pub numerics: Option<Numerics>,
    /// Tokens per forward call during prefill (results do not depend on it).
    pub prefill_chunk: usize,
}

impl SessionOptions {
    pub fn new(ctx: usize) -> SessionOptions {
        SessionOptions {
            ctx,
            numerics: None,
            prefill_chunk: 2048,
        }
    }
}

pub struct Session {
    model: Model,
    backend: Box<dyn Backend>,
    tokens: Vec<u32>,
    logits: Vec<f32>,
    numerics: Numerics,
    prefill_chunk: usize,
}

impl Clone for Session {
    /// A snapshot: an independent copy of the whole state.
    fn clone(&self) -> Session {
        Session {
            model: self.model.clone(),
            backend: self.backend.clone_box(),
            tokens: self.tokens.clone(),
            logits: self.logits.clone(),
            numerics: self.numerics,
            prefill_chunk: self.prefill_chunk,
        }
    }
}

impl Session {
    /// A CPU session with the model's numeric mode.
    pub fn new(model: &Model, ctx: usize) -> Result<Session> {
        Session::with_options(model, SessionOptions::new(ctx))
    }

    pub fn with_options(model: &Model, opts: SessionOptions) -> Result<Session> {
        if opts.ctx == 0 {
            return Err(EngineError::Invalid(
                "context must hold at least one token".into(),
            ));
        }
        let numerics = opts.numerics.unwrap_or(model.numerics());
        let backend = Box::new(CpuBackend::new(model, opts.ctx, numerics));
        Ok(Session::with_backend(
            model,
            backend,
            numerics,
            opts.prefill_chunk,
        ))
    }

    /// A session on another backend (which must start empty).
    pub fn with_backend(
        model: &Model,
        backend: Box<dyn Backend>,
        numerics: Numerics,
        prefill_chunk: usize,
    ) -> Session {
        Session {
            model: model.clone(),
            backend,
            tokens: Vec::new(),
            logits: Vec::new(),
            numerics,
            prefill_chunk: prefill_chunk.max(1),
        }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn ctx(&self) -> usize {
        self.backend.ctx()
    }

    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Logits after the last token (empty before the first).
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    fn check_room(&self, adding: usize) -> Result<()> {
        if self.tokens.len() + adding > self.ctx() {
            return Err(EngineError::ContextFull {
                ctx: self.ctx(),
                have: self.tokens.len(),
                adding,
            });
        }
        Ok(())
    }

    /// Appends `tokens` in chunks of `prefill_chunk`; keeps the last token's logits.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.check_room(tokens.len())?;
        let chunks: Vec<&[u32]> = tokens.chunks(self.prefill_chunk).collect();
        for (i, c) in chunks.iter().enumerate() {
            let rows = if i + 1 == chunks.len() {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            let l = self.backend.forward(c, rows)?;
            self.tokens.extend_from_slice(c);
            if !l.is_empty() {
                self.logits = l;
            }
        }
        Ok(())
    }

    /// Appends `tokens` and returns the logits after each of them (`[n][vocab]`).
    pub fn prefill_all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_room(tokens.len())?;
        let vocab = self.model.config().vocab;
        let mut all = Vec::with_capacity(tokens.len() * vocab);
        for c in tokens.chunks(self.prefill_chunk) {
            let l = self.backend.forward(c, LogitRows::All)?;
            self.tokens.extend_from_slice(c);
            all.extend_from_slice(&l);
        }
        if !tokens.is_empty() {
            self.logits = all[all.len() - vocab..].to_vec();
        }
        Ok(all)
    }

    /// Appends one token; returns its logits.
    pub fn decode(&mut self, token: u32) -> Result<&[f32]> {
        self.check_room(1)?;
        self.logits = self.backend.forward(&[token], LogitRows::Last)?;
        self.tokens.push(token);
        Ok(&self.logits)
    }

    /// Keeps the first `n` tokens. The compressed/windowed state cannot be rewound in
    /// place (the raw ring and the compressor frontiers have dropped older data), so
    /// this re-runs the kept prefix from an empty state; it is a no-op when `n` is the
    /// current length. Callers that rewind often should keep `clone()` snapshots.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n >= self.tokens.len() {
            return Ok(());
        }
        let keep = self.tokens[..n].to_vec();
        self.reset();
        self.prefill(&keep)
    }

    /// Forgets every token.
    pub fn reset(&mut self) {
        self.backend.reset();
        self.tokens.clear();
        self.logits.clear();
    }

    pub(crate) fn parts_mut(&mut self) -> (&mut Box<dyn Backend>, &mut Vec<u32>, &mut Vec<f32>) {
        (&mut self.backend, &mut self.tokens, &mut self.logits)
    }
}
