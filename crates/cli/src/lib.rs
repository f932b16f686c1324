//! Shared code of the `ds4`, `ds4-tool` and `ds4-bench` programs.

pub mod bench_plot;
pub mod download;
pub mod rng;
pub mod synth;
pub mod vocab;
