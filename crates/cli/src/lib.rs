//! Shared code of the `ds4`, `ds4-tool` and `ds4-bench` programs.

pub mod download;
pub mod logging;
