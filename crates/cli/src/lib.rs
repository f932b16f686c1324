//! Shared code of the `ds4`, `ds4-tool` and `ds4-bench` programs.

pub mod bench_plot;
pub mod download;
pub mod fixture_check;
pub mod gpu_attention_check;
pub mod gpu_matmul_check;
pub mod gpu_selftest;
pub mod gpu_variant_check;
pub mod rng;
pub mod synth;
pub mod vocab;
