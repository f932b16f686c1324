//! The CPU backend: the reference implementation of the forward pass.

pub(crate) mod forward;
pub(crate) mod rows;

use std::sync::Arc;

use crate::backend::{check_accepted, check_rows, no_pending, Backend, HcSource, LogitRows};
use crate::error::{EngineError, Result};
use crate::imatrix::MoeObserver;
use crate::kv::KvCache;
use crate::model::Model;
use crate::mtp::ring::DraftRing;
use crate::mtp::{Mtp, MtpState};
use crate::ops::linear::Numerics;
use crate::steer::{Component, Steering};

#[derive(Clone)]
pub struct CpuBackend {
    model: Model,
    numerics: Numerics,
    cache: KvCache,
    /// The thread pool of the forward pass (`None`: rayon's global pool).
    pool: Option<Arc<rayon::ThreadPool>>,
    /// The pending multi-row step's undo record.
    undo: Option<rows::Undo>,
    /// The final HC state of the last token held ([`HcSource::Last`]); `None` after
    /// `reset`/`import_state` until the next forward. A few KB, copied per forward.
    last_hc: Option<Vec<f32>>,
    /// While a step is pending: the final HC state of each of its rows
    /// (`[rows][n_hc·n_embd]`), and `last_hc` from before it.
    step_hc: Option<(Vec<f32>, Option<Vec<f32>>)>,
    /// The MTP block's ring and chained state (never part of the exported state).
    mtp: DraftRing,
    /// Directional steering of every forward pass (`crate::steer`).
    steering: Option<Arc<Steering>>,
}

impl CpuBackend {
    pub fn new(model: &Model, ctx: usize, numerics: Numerics) -> CpuBackend {
        CpuBackend {
            model: model.clone(),
            numerics,
            cache: KvCache::new(model.config(), ctx),
            pool: None,
            undo: None,
            last_hc: None,
            step_hc: None,
            mtp: DraftRing::default(),
            steering: None,
        }
    }

    /// Steers every later forward pass with `steering` (`None`: none).
    pub fn with_steering(mut self, steering: Option<Arc<Steering>>) -> CpuBackend {
        self.steering = steering;
        self
    }

    /// [`Backend::forward`] of `tokens` returning the last token's logits and the
    /// component `c` of every layer and token (`[n_layer][n][n_embd]`, after steering):
    /// what `ds4-tool steer build` averages.
    pub fn forward_tap(&mut self, tokens: &[u32], c: Component) -> Result<(Vec<f32>, Vec<f32>)> {
        self.accept_all();
        let mut act = Vec::new();
        let mut hc = self.last_hc.take().unwrap_or_default();
        let taps = forward::Taps {
            last_hc: Some(&mut hc),
            act: Some((c, &mut act)),
            ..Default::default()
        };
        let out = self.run(tokens, LogitRows::Last, taps);
        self.last_hc = (!hc.is_empty()).then_some(hc);
        Ok((out?, act))
    }

    /// The MTP block's raw ring (`None` before the first draft).
    pub fn mtp_state(&self) -> Option<&MtpState> {
        self.mtp.state()
    }

    /// Drops a pending step's record, keeping every row (the HC of its last).
    fn accept_all(&mut self) {
        self.undo = None;
        if let Some((rows, _)) = self.step_hc.take() {
            let w = self.model.config().n_hc * self.model.config().n_embd;
            self.last_hc = Some(rows[rows.len() - w..].to_vec());
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
        let logits = Backend::forward(self, tokens, rows)?;
        let hc = self.last_hc.clone().unwrap_or_default();
        Ok((logits, hc))
    }

    // One lifetime for self and the taps: `Taps` is invariant in it (its `&mut`s), and
    // the steering it gets is borrowed from self.
    fn run<'a>(
        &'a mut self,
        tokens: &[u32],
        rows: LogitRows,
        taps: forward::Taps<'a>,
    ) -> Result<Vec<f32>> {
        let (m, numerics, cache) = (self.model.inner(), self.numerics, &mut self.cache);
        let taps = forward::Taps {
            steer: self.steering.as_deref(),
            ..taps
        };
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
        self.accept_all();
        if tokens.is_empty() {
            return self.run(tokens, rows, forward::Taps::default());
        }
        let mut hc = self.last_hc.take().unwrap_or_default();
        let taps = forward::Taps {
            last_hc: Some(&mut hc),
            ..Default::default()
        };
        let out = self.run(tokens, rows, taps);
        // On error the cache is untouched and `hc` is the old state, or empty if
        // there was none.
        self.last_hc = (!hc.is_empty()).then_some(hc);
        out
    }

    fn forward_observed(&mut self, tokens: &[u32], obs: &mut dyn MoeObserver) -> Result<()> {
        self.accept_all();
        let mut hc = self.last_hc.take().unwrap_or_default();
        let taps = forward::Taps {
            last_hc: Some(&mut hc),
            moe: Some(obs),
            ..Default::default()
        };
        let out = self.run(tokens, LogitRows::None, taps);
        self.last_hc = (!hc.is_empty()).then_some(hc);
        out.map(|_| ())
    }

    fn step_rows(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        check_rows(tokens.len())?;
        self.accept_all();
        let mut undo = rows::Undo::mark(&self.cache, tokens.len());
        let mut hc = Vec::new();
        // The forward pass fails before touching the cache or not at all.
        let logits = self.run(
            tokens,
            LogitRows::All,
            forward::Taps {
                last_hc: None,
                rows_hc: Some(&mut hc),
                journal: Some(&mut undo.journal),
                ..Default::default()
            },
        )?;
        self.undo = Some(undo);
        self.step_hc = Some((hc, self.last_hc.take()));
        Ok(logits)
    }

    fn commit_rows(&mut self, accepted: usize) -> Result<()> {
        let Some(undo) = &self.undo else {
            return no_pending(accepted);
        };
        check_accepted(accepted, undo.rows())?;
        let undo = self.undo.take().expect("checked above");
        undo.keep(self.model.inner(), &mut self.cache, accepted);
        let (rows, before) = self.step_hc.take().expect("set with the undo record");
        let w = self.model.config().n_hc * self.model.config().n_embd;
        self.last_hc = match accepted {
            0 => before,
            a => Some(rows[(a - 1) * w..a * w].to_vec()),
        };
        Ok(())
    }

    fn pending_rows(&self) -> usize {
        self.undo.as_ref().map_or(0, |u| u.rows())
    }

    fn export_state(&self) -> Result<KvCache> {
        Ok(self.cache.clone())
    }

    fn kv_bytes(&self) -> Option<u64> {
        Some(self.cache.bytes() as u64)
    }

    fn import_state(&mut self, state: KvCache) -> Result<()> {
        self.forget();
        self.cache = state;
        Ok(())
    }

    fn reset(&mut self) {
        self.forget();
        self.cache = KvCache::new(self.model.config(), self.cache.ctx);
    }

    /// The copy has no pending step (it holds every row of one).
    fn try_clone_box(&self) -> Result<Box<dyn Backend>> {
        let mut c = self.clone();
        c.accept_all();
        Ok(Box::new(c))
    }

    fn mtp_draft(&mut self, mtp: &Mtp, token: u32, src: HcSource, pos: usize) -> Result<Vec<f32>> {
        let w = self.model.config().n_hc * self.model.config().n_embd;
        // A pending step's last row, else the last forward's.
        let last = match &self.step_hc {
            Some((rows, _)) => Some(&rows[rows.len() - w..]),
            None => self.last_hc.as_deref(),
        };
        let g = match src {
            HcSource::Last => Some(last.ok_or_else(|| {
                EngineError::Invalid(
                    "no main-model HC state to draft from: decode a token first \
                     (the state is not kept across a reset or import)"
                        .into(),
                )
            })?),
            HcSource::Chain => None,
        };
        let (m, ring) = (&self.pool, &mut self.mtp);
        let mut run = || ring.draft(mtp, token, g, pos);
        match m {
            Some(pool) => pool.install(run),
            None => run(),
        }
    }

    fn mtp_mark(&mut self) {
        self.mtp.mark();
    }

    fn mtp_keep(&mut self, n: usize) -> Result<()> {
        self.mtp.keep(n)
    }

    fn set_steering(&mut self, steering: Option<Arc<Steering>>) -> Result<()> {
        self.steering = steering;
        Ok(())
    }
}

impl CpuBackend {
    /// Drops the pending step, the HC state and the MTP ring (reset, import).
    fn forget(&mut self) {
        self.undo = None;
        self.step_hc = None;
        self.last_hc = None;
        self.mtp.clear();
    }
}
