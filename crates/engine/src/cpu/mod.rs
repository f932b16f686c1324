//! The CPU backend: the reference implementation of the forward pass.

pub(crate) mod forward;

use std::sync::Arc;

use crate::backend::{Backend, LogitRows};
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
}

impl CpuBackend {
    pub fn new(model: &Model, ctx: usize, numerics: Numerics) -> CpuBackend {
        CpuBackend {
            model: model.clone(),
            numerics,
            cache: KvCache::new(model.config(), ctx),
            pool: None,
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
        let mut run = || {
            forward::forward_hc(
                self.model.inner(),
                self.numerics,
                &mut self.cache,
                tokens,
                rows,
                Some(&mut hc),
            )
        };
        let logits = match &self.pool {
            Some(pool) => pool.install(run),
            None => run(),
        }?;
        Ok((logits, hc))
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
        let mut run = || {
            forward::forward(
                self.model.inner(),
                self.numerics,
                &mut self.cache,
                tokens,
                rows,
            )
        };
        match &self.pool {
            Some(pool) => pool.install(run),
            None => run(),
        }
    }

    fn export_state(&self) -> Result<KvCache> {
        Ok(self.cache.clone())
    }

    fn import_state(&mut self, state: KvCache) -> Result<()> {
        self.cache = state;
        Ok(())
    }

    fn reset(&mut self) {
        self.cache = KvCache::new(self.model.config(), self.cache.ctx);
    }

    fn try_clone_box(&self) -> Result<Box<dyn Backend>> {
        Ok(Box::new(self.clone()))
    }
}
