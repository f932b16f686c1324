//! Shared code of the `ds4`, `ds4-tool` and `ds4-bench` programs.

pub mod disk;
pub mod download;
pub mod logging;
