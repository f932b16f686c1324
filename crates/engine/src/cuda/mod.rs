//! The CUDA backend: the whole forward pass on the GPU, weights and KV resident in
//! device memory. It implements the same [`Backend`] boundary as the CPU reference,
//! and exports/imports its state in the host [`KvCache`] form, so snapshots and
//! payloads move freely between CPU and GPU sessions.
//!
//! Numerics: activations stay f32 for the Q8_0/F16 projections (exact weights, no
//! activation quantisation); routed experts use int8 activations in `Fast` mode and
//! f32 in `Exact` mode; `Fast` rounds stored KV rows to f16 as the CPU does.

mod batched;
mod imatrix;
mod split;
mod state;
pub mod weights;

use std::sync::Arc;

use ds4_cuda::SampleSettings;
pub use ds4_cuda::{device_count, driver_present, CudaError, Gpu};
pub use split::SplitBackend;

use crate::backend::{
    check_accepted, check_rows, check_tokens, check_vocab, no_pending, Backend, CyclePicks,
    GreedyCycle, GreedyRun, HcSource, LogitRows,
};
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::mtp::Mtp;
use crate::ops::linear::Numerics;
use crate::sampling::{PickParams, Sampler};
use crate::steer::Steering;
use state::{DeviceState, PickMode};

/// The sampler's settings as the device's sampled pick takes them (`kernels/sample.cu`).
pub(crate) fn device_sample_settings(p: &PickParams) -> SampleSettings {
    SampleSettings {
        t: p.t,
        top_p: p.top_p,
        w_min: p.w_min,
        top_k: p.top_k,
    }
}
pub use weights::CudaWeights;

/// A GPU session backend.
pub struct CudaBackend {
    weights: Arc<CudaWeights>,
    numerics: Numerics,
    state: DeviceState,
    /// Multi-token forwards run as batched prefill (`DS4_CUDA_BATCH=0`: token by token).
    batched: bool,
    /// `reset` was called: the frontiers are cleared (a fallible device write) before
    /// the next forward.
    stale: bool,
    /// Directional steering (kept to carry into copies of the state).
    steering: Option<Arc<Steering>>,
}

fn batched_default() -> bool {
    std::env::var("DS4_CUDA_BATCH").map_or(true, |v| v != "0")
}

impl CudaBackend {
    /// A new empty session on `weights` (uploaded once with [`CudaWeights::upload`]),
    /// launching under the weights' plan (`DS4_CUDA_FUSE`).
    pub fn new(weights: &Arc<CudaWeights>, ctx: usize, numerics: Numerics) -> Result<CudaBackend> {
        Self::with_plan(weights, ctx, numerics, weights.plan)
    }

    /// [`CudaBackend::new`] launching under `plan` (`ds4-bench --fuse-ab`: sessions of
    /// several plans on one weight upload).
    pub fn with_plan(
        weights: &Arc<CudaWeights>,
        ctx: usize,
        numerics: Numerics,
        plan: ds4_cuda::DecodePlan,
    ) -> Result<CudaBackend> {
        Ok(CudaBackend {
            weights: weights.clone(),
            numerics,
            state: DeviceState::new(weights, ctx, plan)?,
            batched: batched_default(),
            stale: false,
            steering: None,
        })
    }

    /// Whether multi-token forwards run as batched prefill (default; `false`: one
    /// token at a time through the decode path).
    pub fn set_batched(&mut self, batched: bool) {
        self.batched = batched;
    }

    /// Lowers the batched prefill chunk (tokens per batch) to at most `chunk`; the
    /// session's initial chunk (`DS4_CUDA_PREFILL_CHUNK`, else 2,048, bounded by the
    /// context's score buffers and the free device memory) is the maximum.
    pub fn set_prefill_chunk(&mut self, chunk: usize) {
        self.state.set_chunk(chunk);
    }

    /// Tokens per batched prefill chunk.
    pub fn prefill_chunk(&self) -> usize {
        self.state.chunk()
    }

    /// Clears the state after a `reset` (see `stale`).
    fn fresh(&mut self) -> Result<()> {
        if self.stale {
            self.state.clear(&self.weights)?;
            self.stale = false;
        }
        Ok(())
    }

    /// Tokens in the vocabulary, and room for them in the context.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.weights.config.vocab;
        check_tokens(tokens, vocab, self.state.n_tokens, self.state.ctx)
    }

    /// The MTP block's ring, row count and newest position (selftest diagnosis).
    pub(crate) fn mtp_ring_debug(&self) -> Option<(Vec<f32>, usize, Option<usize>)> {
        self.state.mtp_ring_debug(&self.weights)
    }

    /// Sets the last token's HC state from host values (selftest: one state for both
    /// MTP blocks).
    pub(crate) fn set_last_hc_host(&mut self, hc: &[f32]) -> Result<()> {
        self.state.set_last_hc_host(&self.weights, hc)
    }

    /// Opens GPU `ordinal` and uploads `model` where the memory planner puts it
    /// (`memory`: expert offload, the context to leave room for); the usual way to
    /// start. Also returns the planner's line saying what went where.
    pub fn load(
        model: &Model,
        ordinal: usize,
        memory: &crate::placement::MemoryOptions,
        progress: &dyn Fn(usize),
    ) -> Result<(Arc<CudaWeights>, String)> {
        let gpu = Arc::new(Gpu::open(ordinal)?);
        let (w, line) = CudaWeights::upload_planned(&gpu, model, memory, progress)?;
        Ok((Arc::new(w), line))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        "cuda"
    }

    /// One batched prefill chunk: each chunk streams every routed expert's weights.
    fn preferred_batch(&self) -> usize {
        self.state.chunk()
    }

    fn n_tokens(&self) -> usize {
        self.state.n_tokens
    }

    fn ctx(&self) -> usize {
        self.state.ctx
    }

    fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>> {
        self.state.accept_rows();
        self.check_tokens(tokens)?;
        self.fresh()?;
        let mut out = Vec::new();
        if tokens.len() > 1 && self.batched {
            // Batched prefill, one chunk at a time.
            let chunk = self.state.chunk();
            let n_chunks = tokens.len().div_ceil(chunk);
            for (i, part) in tokens.chunks(chunk).enumerate() {
                let last = i + 1 == n_chunks;
                out.extend(self.state.prefill(
                    &self.weights,
                    self.numerics,
                    part,
                    last && rows == LogitRows::Last,
                    rows == LogitRows::All,
                )?);
            }
            return Ok(out);
        }
        for (i, &t) in tokens.iter().enumerate() {
            let want = rows.wants(i, tokens.len());
            self.state.decode(&self.weights, self.numerics, t, want)?;
            if want {
                let logits = self.state.logits(&self.weights)?;
                // One token's logits (the decode loop): no second copy.
                if out.is_empty() {
                    out = logits;
                } else {
                    out.extend(logits);
                }
            }
        }
        Ok(out)
    }

    /// The picks on the device, one token ahead (`state/pick.rs`): token k + 1's graph
    /// is launched before the host waits for token k's pick. A sampled run writes each
    /// launch's draw from the host's sampler into the sample ring first; the draw of a
    /// launch whose pick is never delivered (the run ended at a refused pick) is given
    /// back, so the stream advances as the plain loop's.
    fn greedy_run(&mut self, run: GreedyRun<'_>, decoded: &mut Vec<u32>) -> Result<Vec<f32>> {
        self.state.accept_rows();
        self.check_tokens(&[run.first])?;
        self.fresh()?;
        let (w, numerics) = (&self.weights, self.numerics);
        let mut sampler = run.sampler;
        let mode = match &sampler {
            Some(s) => {
                self.state
                    .sample_settings(w, &device_sample_settings(&s.params()))?;
                PickMode::Sample
            }
            None => PickMode::Greedy {
                skip: match run.skip {
                    Some(s) if (s as usize) < w.config.vocab => s as i32,
                    _ => -1,
                },
            },
        };
        // Before the draw of the last launch (to give it back).
        let mut before: Option<Sampler> = None;
        let mut launch = |state: &mut DeviceState, token: Option<u32>| -> Result<()> {
            if let Some(s) = sampler.as_deref_mut() {
                before = Some(s.clone());
                state.sample_draw(state.n_tokens, s.uniform())?;
            }
            state.decode_pick(w, numerics, token, mode)
        };
        let mut pos = self.state.n_tokens;
        launch(&mut self.state, Some(run.first))?;
        decoded.push(run.first);
        let mut picks = 0;
        // Whether the loop ends with a launched pick it never delivers.
        let undelivered = loop {
            picks += 1;
            let ahead = picks < run.max && decoded.len() < run.room;
            if ahead {
                launch(&mut self.state, None)?;
            }
            let (pick, nan) = self.state.pick_result(pos)?;
            pos += 1;
            if ahead {
                decoded.push(pick);
            }
            if nan {
                return Err(EngineError::nan_logits());
            }
            if !(run.on_pick)(pick) || !ahead {
                break ahead;
            }
        };
        if undelivered {
            // The pick after the refused one (its graph ran) is never delivered: its
            // draw goes back to the stream.
            if let (Some(s), Some(b)) = (sampler, before) {
                *s = b;
            }
        }
        self.state.logits(w)
    }

    /// The native step (`state/rows.rs`): one pass over the weights for every row, an
    /// undo record on the device.
    fn step_rows(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        check_rows(tokens.len())?;
        self.state.accept_rows();
        self.check_tokens(tokens)?;
        self.fresh()?;
        self.state.step_rows(&self.weights, self.numerics, tokens)
    }

    fn commit_rows(&mut self, accepted: usize) -> Result<()> {
        let rows = self.state.pending_rows();
        if rows == 0 {
            return no_pending(accepted);
        }
        check_accepted(accepted, rows)?;
        self.state
            .commit_rows(&self.weights, self.numerics, accepted)
    }

    fn pending_rows(&self) -> usize {
        self.state.pending_rows()
    }

    /// The picks on the device (`state/spec.rs`): the drafts and the verify run back
    /// to back and only their picks reach the host.
    fn greedy_cycle(&mut self, c: GreedyCycle<'_>) -> Result<CyclePicks> {
        check_rows(1 + c.drafts)?;
        self.state.accept_rows();
        self.check_tokens(&[c.token])?;
        self.fresh()?;
        let mw = self.weights.mtp(c.mtp)?;
        let numerics = (self.numerics, c.mtp.numerics());
        self.state.greedy_cycle(&self.weights, &mw, numerics, c)
    }

    fn kept_logits(&self) -> Result<Vec<f32>> {
        self.state.kept_logits(&self.weights)
    }

    fn forward_observed(
        &mut self,
        tokens: &[u32],
        obs: &mut dyn crate::imatrix::MoeObserver,
    ) -> Result<()> {
        self.observed_prefill(tokens, obs)
    }

    fn export_state(&self) -> Result<KvCache> {
        if self.stale {
            // Reset and not yet cleared on the device: the state of a new session.
            return Ok(KvCache::new(&self.weights.config, self.state.ctx));
        }
        self.state.export(&self.weights)
    }

    fn import_state(&mut self, state: KvCache) -> Result<()> {
        self.state.accept_rows();
        self.state.mtp_clear();
        self.fresh()?;
        self.state.import(&self.weights, &state)
    }

    fn reset(&mut self) {
        self.state.accept_rows();
        self.state.mtp_clear();
        self.state.n_tokens = 0;
        self.stale = true;
    }

    fn try_clone_box(&self) -> Result<Box<dyn Backend>> {
        let mut state = self.state.duplicate(&self.weights)?;
        state.set_steering(&self.weights, self.steering.as_deref())?;
        Ok(Box::new(CudaBackend {
            weights: self.weights.clone(),
            numerics: self.numerics,
            state,
            batched: self.batched,
            stale: self.stale,
            steering: self.steering.clone(),
        }))
    }

    /// The block runs on this session's decode scratch (state/mtp.rs) with the weights
    /// uploaded once per engine ([`CudaWeights::mtp`]), in the block's numerics.
    fn mtp_draft(&mut self, mtp: &Mtp, token: u32, src: HcSource, pos: usize) -> Result<Vec<f32>> {
        check_vocab(&[token], self.weights.config.vocab)?;
        let mw = self.weights.mtp(mtp)?;
        self.state
            .mtp_draft(&self.weights, &mw, mtp.numerics(), (token, src, pos))
    }

    fn mtp_mark(&mut self) {
        self.state.mtp_mark();
    }

    fn mtp_keep(&mut self, n: usize) -> Result<()> {
        self.state.mtp_keep(&self.weights, n)
    }

    fn kv_bytes(&self) -> Option<u64> {
        Some(self.state.kv_bytes_used(&self.weights.config) as u64)
    }

    /// The sessions of this upload among `others` share batched steps
    /// (`batched.rs`, `state/batch.rs`): one pass over the weights for up to
    /// `MAX_ROWS` rows.
    fn decode_rows(
        &mut self,
        others: &mut [&mut dyn Backend],
        tokens: &[u32],
    ) -> Vec<Result<Vec<f32>>> {
        batched::decode_rows(self, others, tokens)
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        let c = &self.weights.config;
        let free = self.weights.gpu.mem_info().ok()?.0 as u64;
        // Another session's KV and scratch: the prefill buffers are the GPU's, allocated
        // with the first session.
        let one = state::pool_session_bytes(c, self.state.ctx, self.state.chunk()) as u64;
        Some((free, one))
    }

    fn set_steering(&mut self, steering: Option<Arc<Steering>>) -> Result<()> {
        self.state
            .set_steering(&self.weights, steering.as_deref())?;
        self.steering = steering;
        Ok(())
    }
}
