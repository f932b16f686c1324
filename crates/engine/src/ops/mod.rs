//! The model's operations, independent of any backend's memory layout.

pub mod attention;
pub mod compressor;
pub mod dot;
pub mod hc;
pub mod indexer;
pub mod linear;
pub mod moe;
pub mod norm;
pub mod qat;
pub mod rope;
