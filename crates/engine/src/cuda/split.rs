//! A model split by layers over several GPUs of one host (issue 23, architecture.md
//! §4.1): stage k holds layers `range_k` (`CudaWeights::range`) with their KV, plus the
//! embedding and the head, and runs them with the single-GPU code. Between stages only
//! the hyper-connection streams of the tokens cross (4 × 4,096 floats, 64 KiB a token),
//! through the host: tiny next to a token's ~6 ms, and it needs no peer access between
//! the cards. Every kernel is the single-GPU one on the same inputs, so a split run's
//! logits equal the single-GPU run's bit for bit (gpu-selftest checks it with both
//! stages on one card).
//!
//! Multi-row steps run stage by stage the same way (each stage keeps its own undo
//! record and commits its own layers); the MTP draft block runs on the last stage,
//! where the last layer's streams are. Imatrix collection runs on one GPU only (the
//! backend refuses it with the default error).

use std::sync::Arc;

use super::state::DeviceState;
use super::CudaWeights;
use crate::backend::{
    check_accepted, check_rows, check_tokens, check_vocab, no_pending, Backend, HcSource, LogitRows,
};
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::mtp::Mtp;
use crate::ops::linear::Numerics;
use crate::steer::Steering;

struct Stage {
    weights: Arc<CudaWeights>,
    state: DeviceState,
}

/// A session whose layers run on several GPUs in turn.
pub struct SplitBackend {
    stages: Vec<Stage>,
    numerics: Numerics,
    name: String,
    /// Multi-token forwards run as batched prefill (as `CudaBackend`'s).
    batched: bool,
    /// `reset` was called: the frontiers are cleared before the next forward.
    stale: bool,
    steering: Option<Arc<Steering>>,
}

impl SplitBackend {
    /// A new empty session over `stages` (each uploaded for its layer range; together
    /// they must cover every layer once, in order).
    pub fn new(
        stages: &[Arc<CudaWeights>],
        ctx: usize,
        numerics: Numerics,
    ) -> Result<SplitBackend> {
        check_stages(stages)?;
        let stages = stages
            .iter()
            .map(|w| {
                Ok(Stage {
                    weights: w.clone(),
                    state: DeviceState::new(w, ctx, w.plan)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let name = format!("cuda (layers split over {} GPUs)", stages.len());
        Ok(SplitBackend {
            stages,
            numerics,
            name,
            batched: std::env::var("DS4_CUDA_BATCH").map_or(true, |v| v != "0"),
            stale: false,
            steering: None,
        })
    }

    /// Whether multi-token forwards run as batched prefill.
    pub fn set_batched(&mut self, batched: bool) {
        self.batched = batched;
    }

    fn first(&self) -> &Stage {
        &self.stages[0]
    }

    fn last_mut(&mut self) -> &mut Stage {
        self.stages.last_mut().expect("a split has stages")
    }

    /// Drops a pending multi-row step's record on every stage (all rows kept).
    fn accept_rows(&mut self) {
        for st in &mut self.stages {
            st.state.accept_rows();
        }
    }

    fn fresh(&mut self) -> Result<()> {
        if self.stale {
            for st in &mut self.stages {
                st.state.clear(&st.weights)?;
            }
            self.stale = false;
        }
        Ok(())
    }

    /// One prefill chunk through every stage; the last stage's requested logits.
    fn chunk(&mut self, part: &[u32], head: bool, all_rows: bool) -> Result<Vec<f32>> {
        let numerics = self.numerics;
        let last = self.stages.len() - 1;
        let mut h = Vec::new();
        for (i, st) in self.stages.iter_mut().enumerate() {
            let w = &st.weights;
            if i > 0 {
                st.state.set_input(w, &h, true)?;
            }
            if i == last {
                return st.state.prefill(w, numerics, part, head, all_rows);
            }
            st.state.prefill(w, numerics, part, false, false)?;
            h = st.state.hidden(w, part.len(), true)?;
        }
        unreachable!("a split has a last stage")
    }

    /// One token through every stage; the logits when `want`.
    fn token(&mut self, t: u32, want: bool) -> Result<Option<Vec<f32>>> {
        let numerics = self.numerics;
        let last = self.stages.len() - 1;
        let mut h = Vec::new();
        for (i, st) in self.stages.iter_mut().enumerate() {
            let w = &st.weights;
            if i > 0 {
                st.state.set_input(w, &h, false)?;
            }
            st.state.decode(w, numerics, t, want && i == last)?;
            if i < last {
                h = st.state.hidden(w, 1, false)?;
            } else if want {
                return Ok(Some(st.state.logits(w)?));
            }
        }
        Ok(None)
    }
}

/// Stages that cover every layer once, in order, on one model.
fn check_stages(stages: &[Arc<CudaWeights>]) -> Result<()> {
    let Some(first) = stages.first() else {
        return Err(EngineError::Invalid("a split over no GPUs".into()));
    };
    let n_layer = first.config.n_layer;
    let mut next = 0;
    for w in stages {
        if w.range.start != next || w.config.n_layer != n_layer {
            return Err(EngineError::Invalid(format!(
                "stage layers {:?} do not follow layer {next}",
                w.range
            )));
        }
        next = w.range.end;
    }
    if next != n_layer {
        return Err(EngineError::Invalid(format!(
            "the stages end at layer {next} of {n_layer}"
        )));
    }
    Ok(())
}

impl Backend for SplitBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn preferred_batch(&self) -> usize {
        self.stages
            .iter()
            .map(|s| s.state.chunk())
            .min()
            .unwrap_or(1)
    }

    fn n_tokens(&self) -> usize {
        self.first().state.n_tokens
    }

    fn ctx(&self) -> usize {
        self.first().state.ctx
    }

    fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>> {
        self.accept_rows();
        let vocab = self.first().weights.config.vocab;
        check_tokens(tokens, vocab, self.n_tokens(), self.ctx())?;
        self.fresh()?;
        let mut out = Vec::new();
        if tokens.len() > 1 && self.batched {
            let chunk = self.preferred_batch();
            let n_chunks = tokens.len().div_ceil(chunk);
            for (i, part) in tokens.chunks(chunk).enumerate() {
                let last = i + 1 == n_chunks;
                let head = last && rows == LogitRows::Last;
                out.extend(self.chunk(part, head, rows == LogitRows::All)?);
            }
            return Ok(out);
        }
        for (i, &t) in tokens.iter().enumerate() {
            let want = rows.wants(i, tokens.len());
            if let Some(logits) = self.token(t, want)? {
                out.extend(logits);
            }
        }
        Ok(out)
    }

    fn export_state(&self) -> Result<KvCache> {
        let first = self.first();
        if self.stale {
            return Ok(KvCache::new(&first.weights.config, first.state.ctx));
        }
        let mut kv = first.state.export(&first.weights)?;
        for st in &self.stages[1..] {
            let mut part = st.state.export(&st.weights)?;
            for il in st.weights.range.clone() {
                std::mem::swap(&mut kv.layers[il], &mut part.layers[il]);
            }
        }
        Ok(kv)
    }

    fn step_rows(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        check_rows(tokens.len())?;
        self.accept_rows();
        let vocab = self.first().weights.config.vocab;
        check_tokens(tokens, vocab, self.n_tokens(), self.ctx())?;
        self.fresh()?;
        let numerics = self.numerics;
        let last = self.stages.len() - 1;
        let mut h: Vec<f32> = Vec::new();
        for i in 0..self.stages.len() {
            let st = &mut self.stages[i];
            let h_in = (i > 0).then_some(&h[..]);
            match st
                .state
                .step_rows_stage(&st.weights, numerics, tokens, h_in, i == last)
            {
                Ok(out) if i == last => return Ok(out),
                Ok(out) => h = out,
                Err(e) => {
                    // The earlier stages ran their rows: take them back, so that no
                    // step is half applied (a failing rewind is reported instead).
                    for st in &mut self.stages[..i] {
                        st.state.commit_rows(&st.weights, numerics, 0)?;
                    }
                    return Err(e);
                }
            }
        }
        unreachable!("a split has a last stage")
    }

    fn commit_rows(&mut self, accepted: usize) -> Result<()> {
        let rows = self.pending_rows();
        if rows == 0 {
            return no_pending(accepted);
        }
        check_accepted(accepted, rows)?;
        let numerics = self.numerics;
        for st in &mut self.stages {
            st.state.commit_rows(&st.weights, numerics, accepted)?;
        }
        Ok(())
    }

    fn pending_rows(&self) -> usize {
        self.first().state.pending_rows()
    }

    /// The block runs on the last stage's GPU (the last layer's streams are there),
    /// with the block uploaded to that GPU once per engine.
    fn mtp_draft(&mut self, mtp: &Mtp, token: u32, src: HcSource, pos: usize) -> Result<Vec<f32>> {
        let st = self.last_mut();
        check_vocab(&[token], st.weights.config.vocab)?;
        let mw = st.weights.mtp(mtp)?;
        st.state
            .mtp_draft(&st.weights, &mw, mtp.numerics(), (token, src, pos))
    }

    fn mtp_mark(&mut self) {
        self.last_mut().state.mtp_mark();
    }

    fn mtp_keep(&mut self, n: usize) -> Result<()> {
        let st = self.last_mut();
        st.state.mtp_keep(&st.weights, n)
    }

    fn import_state(&mut self, state: KvCache) -> Result<()> {
        self.accept_rows();
        self.last_mut().state.mtp_clear();
        self.fresh()?;
        for st in &mut self.stages {
            st.state.import(&st.weights, &state)?;
        }
        Ok(())
    }

    fn reset(&mut self) {
        self.accept_rows();
        self.last_mut().state.mtp_clear();
        for st in &mut self.stages {
            st.state.n_tokens = 0;
        }
        self.stale = true;
    }

    fn try_clone_box(&self) -> Result<Box<dyn Backend>> {
        let mut stages = Vec::with_capacity(self.stages.len());
        for st in &self.stages {
            let mut state = st.state.duplicate(&st.weights)?;
            state.set_steering(&st.weights, self.steering.as_deref())?;
            stages.push(Stage {
                weights: st.weights.clone(),
                state,
            });
        }
        Ok(Box::new(SplitBackend {
            stages,
            numerics: self.numerics,
            name: self.name.clone(),
            batched: self.batched,
            stale: self.stale,
            steering: self.steering.clone(),
        }))
    }

    fn set_steering(&mut self, steering: Option<Arc<Steering>>) -> Result<()> {
        for st in &mut self.stages {
            st.state.set_steering(&st.weights, steering.as_deref())?;
        }
        self.steering = steering;
        Ok(())
    }
}
