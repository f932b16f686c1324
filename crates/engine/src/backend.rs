//! The boundary between a session and the device that runs the forward pass.
//!
//! A backend owns its KV state (a GPU keeps it in device memory) and exposes it in
//! the host form [`KvCache`] only for snapshots and payloads, so the payload layout
//! is the same on every backend.

use crate::error::Result;
use crate::kv::KvCache;

/// Which logits rows a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    /// The last token's row only (prefill, decode).
    Last,
    /// One row per token (scoring, tests).
    All,
}

pub trait Backend: Send {
    fn name(&self) -> &str;

    /// Positions held.
    fn n_tokens(&self) -> usize;

    /// Context capacity in tokens.
    fn ctx(&self) -> usize;

    /// Runs `tokens` at positions `n_tokens()..`, appending them to the state, and
    /// returns the requested logits rows (`[rows][vocab]`). Must equal running the
    /// tokens one at a time.
    fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>>;

    /// The state in host form (a device backend copies it back, which can fail).
    fn export_state(&self) -> Result<KvCache>;

    /// Replaces the state.
    fn import_state(&mut self, state: KvCache) -> Result<()>;

    /// Forgets every position.
    fn reset(&mut self);

    /// An independent copy of the whole state (a device backend allocates a second
    /// state, which can run out of memory).
    fn try_clone_box(&self) -> Result<Box<dyn Backend>>;

    /// Tokens per `forward` call that keep this backend efficient: callers that split
    /// a prompt (for progress or cancellation) should not pass fewer.
    fn preferred_batch(&self) -> usize {
        512
    }
}
