//! The CPU backend: the reference implementation of the forward pass.

pub mod forward;

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
}

impl CpuBackend {
    pub fn new(model: &Model, ctx: usize, numerics: Numerics) -> CpuBackend {
        CpuBackend {
            model: model.clone(),
            numerics,
            cache: KvCache::new(model.config(), ctx),
        }
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
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
        forward::forward(
            self.model.inner(),
            self.numerics,
            &mut self.cache,
            tokens,
            rows,
        )
    }

    fn export_state(&self) -> KvCache {
        self.cache.clone()
    }

    fn import_state(&mut self, state: KvCache) -> Result<()> {
        self.cache = state;
        Ok(())
    }

    fn reset(&mut self) {
        self.cache = KvCache::new(self.model.config(), self.cache.ctx);
    }

    fn clone_box(&self) -> Box<dyn Backend> {
        Box::new(self.clone())
    }
}
