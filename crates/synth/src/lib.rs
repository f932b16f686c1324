//! Synthetic DeepSeek V4 models in the exact published layout, with random weights, for
//! `ds4-tool synth`, `ds4-bench --synthetic-weights` and tests that need a model file.
//!
//! Every tensor is generated directly as quantised blocks (random quants, scales set
//! for a target RMS), chunk by chunk from independent seeded streams, so a full-size
//! file can be written by all cores at disk speed with positioned writes and is the
//! same for the same seed whatever the thread count.
//!
//! * [`Plan`]: metadata, tensor table and layout of one file; writes it or builds it in memory.
//! * [`Vocab`]: the `tokenizer.ggml.*` metadata, built in or converted from a `tokenizer.json`.
//! * [`Rng`] and [`fill_blocks`]: the seeded generator and random quantised blocks, also
//!   used for the random inputs of the GPU kernel checks.

mod fill;
mod plan;
pub mod rng;
pub mod vocab;

pub use fill::fill_blocks;
pub use plan::{flash_config, Plan};
pub use rng::Rng;
pub use vocab::Vocab;
