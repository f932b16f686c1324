//! A model split by layers over several GPUs of one host (issue 23, architecture.md
//! §4.1): stage k holds layers `range_k` (`CudaWeights::range`) with their KV, plus the
//! embedding and the head, and runs them with the single-GPU code. Between stages only
//! the hyper-connection streams of the tokens cross (4 × 4,096 floats, 64 KiB a token),
//! through the host: tiny next to a token's ~6 ms, and it needs no peer access between
//! the cards. Every kernel is the single-GPU one on the same inputs, so a split run's
//! logits equal the single-GPU run's bit for bit (gpu-selftest checks it with both
//! stages on one card).
//!
//! Multi-row steps (MTP verification), the MTP draft block and imatrix collection run
//! on one GPU only for now: the backend refuses them with the default errors.

use std::sync::Arc;

use super::state::DeviceState;
use super::CudaWeights;
use crate::backend::{check_tokens, Backend, LogitRows};
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
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
            let want = match rows {
                LogitRows::None => false,
                LogitRows::Last => i + 1 == tokens.len(),
                LogitRows::All => true,
            };
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

    fn import_state(&mut self, state: KvCache) -> Result<()> {
        self.fresh()?;
        for st in &mut self.stages {
            st.state.import(&st.weights, &state)?;
        }
        Ok(())
    }

    fn reset(&mut self) {
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
