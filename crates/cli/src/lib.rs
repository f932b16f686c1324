//! Shared code of the `ds4`, `ds4-tool` and `ds4-bench` programs.

pub mod download;
pub mod fixture_check;
pub mod gpu_attention_check;
pub mod gpu_matmul_check;
pub mod gpu_selftest;
pub mod gpu_variant_check;
pub mod logging;
pub mod tok;

// The GPU kernel checks draw their random inputs from the synthetic-model generator
// (`crate::rng::Rng`, `crate::synth::fill_blocks`), which lives in ds4-synth.
use ds4_synth as synth;
use ds4_synth::rng;
