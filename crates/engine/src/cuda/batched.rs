//! [`Backend::decode_rows`] on the GPU: the sessions of one weight upload decode their
//! tokens in batched steps of up to [`MAX_ROWS`] rows (`state/batch.rs`), one pass over
//! the weights for all of them; any other row (another backend, another upload or
//! numerics, a steered session, a lone row) decodes on its own. Each row's result is
//! its own, as the trait asks.
//!
//! `DS4_CUDA_BATCH_STEP=0` turns the batched step off (every row decodes on its own),
//! for timing the two in one build.

use std::sync::Arc;

use super::state::{decode_batch, unbatchable, DeviceState};
use super::CudaBackend;
use crate::backend::{decode_rows_mismatch, Backend, LogitRows, MAX_ROWS};
use crate::error::{EngineError, Result};

fn batch_step_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DS4_CUDA_BATCH_STEP").map_or(true, |v| v != "0"))
}

impl CudaBackend {
    /// Whether `other` is a session this one can share a batched step with.
    fn batches_with(&self, other: &dyn Backend) -> bool {
        other
            .as_any()
            .and_then(|a| a.downcast_ref::<CudaBackend>())
            .is_some_and(|o| Arc::ptr_eq(&o.weights, &self.weights) && o.numerics == self.numerics)
    }

    /// A row's checks before it joins a step (as `forward` makes them): its token and
    /// room, a pending multi-row step accepted, a reset state cleared.
    fn prepare_row(&mut self, token: u32) -> Result<()> {
        self.state.accept_rows();
        self.check_tokens(&[token])?;
        self.fresh()
    }
}

/// See the module doc. `first` is `self` of [`Backend::decode_rows`].
pub(super) fn decode_rows(
    first: &mut CudaBackend,
    others: &mut [&mut dyn Backend],
    tokens: &[u32],
) -> Vec<Result<Vec<f32>>> {
    let n = others.len() + 1;
    if let Some(err) = decode_rows_mismatch(n, tokens.len()) {
        return err;
    }
    let mut out: Vec<Option<Result<Vec<f32>>>> = (0..n).map(|_| None).collect();
    let joins: Vec<bool> = others
        .iter()
        .map(|b| batch_step_enabled() && first.batches_with(&**b))
        .collect();
    let weights = first.weights.clone();
    let numerics = first.numerics;
    // The rows that may share steps: (row, session).
    let mut group: Vec<(usize, &mut CudaBackend)> = Vec::with_capacity(n);
    match first.prepare_row(tokens[0]) {
        Ok(()) => group.push((0, first)),
        Err(e) => out[0] = Some(Err(e)),
    }
    for (i, b) in others.iter_mut().enumerate() {
        let row = i + 1;
        if !joins[i] {
            out[row] = Some(b.forward(&tokens[row..=row], LogitRows::Last));
            continue;
        }
        let cb = b
            .as_any_mut()
            .and_then(|a| a.downcast_mut::<CudaBackend>())
            .expect("checked by batches_with");
        match cb.prepare_row(tokens[row]) {
            Ok(()) => group.push((row, cb)),
            Err(e) => out[row] = Some(Err(e)),
        }
    }
    for chunk in group.chunks_mut(MAX_ROWS) {
        let rows: Vec<usize> = chunk.iter().map(|(r, _)| *r).collect();
        let toks: Vec<u32> = rows.iter().map(|&r| tokens[r]).collect();
        let why = {
            let view: Vec<&DeviceState> = chunk.iter().map(|(_, b)| &b.state).collect();
            unbatchable(&weights, &view)
        };
        if let Some(why) = why {
            if chunk.len() > 1 {
                tracing::debug!("decoding {} rows one by one: {why}", chunk.len());
            }
            for (r, b) in chunk.iter_mut() {
                out[*r] = Some(b.forward(&tokens[*r..=*r], LogitRows::Last));
            }
            continue;
        }
        let mut states: Vec<&mut DeviceState> =
            chunk.iter_mut().map(|(_, b)| &mut b.state).collect();
        match decode_batch(&weights, numerics, &mut states, &toks) {
            Ok(logits) => {
                for (r, l) in rows.iter().zip(logits) {
                    out[*r] = Some(Ok(l));
                }
            }
            Err(e) => {
                // One device error fails every row of the step; the first gets it as is.
                let msg = e.to_string();
                let mut e = Some(e);
                for &r in &rows {
                    let err = e.take().unwrap_or_else(|| {
                        EngineError::Invalid(format!("the batched step failed: {msg}"))
                    });
                    out[r] = Some(Err(err));
                }
            }
        }
    }
    out.into_iter()
        .map(|r| r.expect("every row has a result"))
        .collect()
}
