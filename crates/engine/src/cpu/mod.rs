//! The CPU backend: the reference implementation of the forward pass.

pub(crate) mod forward;
pub(crate) mod rows;

use std::sync::Arc;

use crate::backend::{check_accepted, check_rows, no_pending, Backend, LogitRows};
use crate::error::Result;
use crate::kv::KvCache;
use crate::model::Model;
use crate::ops::linear::Numerics;

#[derive(Clone)]
pub struct CpuBackend {
    model: Model,
    numerics: Numerics,
    cache: KvCache,
    /// The thread pool of the forward pass (`None`: rayon's global pool).
    pool: Option<Arc<rayon::ThreadPool>>,
    /// The pending multi-row step's undo record.
    undo: Option<rows::Undo>,
}

impl CpuBackend {
    pub fn new(model: &Model, ctx: usize, numerics: Numerics) -> CpuBackend {
        CpuBackend {
            model: model.clone(),
            numerics,
            cache: KvCache::new(model.config(), ctx),
            pool: None,
            undo: None,
        }
    }

    /// Runs the forward pass in `pool` instead of rayon's global pool (results do
    /// not depend on the thread count).
    pub fn with_pool(mut self, pool: Option<Arc<rayon::ThreadPool>>) -> CpuBackend {
        self.pool = pool;
        self
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// [`Backend::forward`], also returning the final hyper-connection state of the
    /// last token (`[n_hc][n_embd]`), which the MTP draft block takes as its input.
    pub fn forward_with_hc(
        &mut self,
        tokens: &[u32],
        rows: LogitRows,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut hc = Vec::new();
        let taps = forward::Taps {
            last_hc: Some(&mut hc),
            journal: None,
        };
        let logits = self.run(tokens, rows, taps)?;
        Ok((logits, hc))
    }

    fn run(&mut self, tokens: &[u32], rows: LogitRows, taps: forward::Taps) -> Result<Vec<f32>> {
        let (m, numerics, cache) = (self.model.inner(), self.numerics, &mut self.cache);
        let run = || forward::forward(m, numerics, cache, tokens, rows, taps);
        match &self.pool {
            Some(pool) => pool.install(run),
            None => run(),
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    fn n_tokens(&self) -> usize {
        self.cache.n_tokens
    }

    fn ctx(&self) -> usize {
        self.cache.ctx
    }

    fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>> {
        self.undo = None;
        self.run(tokens, rows, forward::Taps::default())
    }

    fn step_rows(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        check_rows(tokens.len())?;
        self.undo = None;
        let mut undo = rows::Undo::mark(&self.cache, tokens.len());
        // The forward pass fails before touching the cache or not at all.
        let logits = self.run(
            tokens,
            LogitRows::All,
            forward::Taps {
                last_hc: None,
                journal: Some(&mut undo.journal),
            },
        )?;
        self.undo = Some(undo);
        Ok(logits)
    }

    fn commit_rows(&mut self, accepted: usize) -> Result<()> {
        let Some(undo) = &self.undo else {
            return no_pending(accepted);
        };
        check_accepted(accepted, undo.rows())?;
        let undo = self.undo.take().expect("checked above");
        undo.keep(self.model.inner(), &mut self.cache, accepted);
        Ok(())
    }

    fn pending_rows(&self) -> usize {
        self.undo.as_ref().map_or(0, |u| u.rows())
    }

    fn export_state(&self) -> Result<KvCache> {
        Ok(self.cache.clone())
    }

    fn import_state(&mut self, state: KvCache) -> Result<()> {
        self.undo = None;
        self.cache = state;
        Ok(())
    }

    fn reset(&mut self) {
        self.undo = None;
        self.cache = KvCache::new(self.model.config(), self.cache.ctx);
    }

    /// The copy has no pending step (it holds every row of one).
    fn try_clone_box(&self) -> Result<Box<dyn Backend>> {
        let mut c = self.clone();
        c.undo = None;
        Ok(Box::new(c))
    }
}
