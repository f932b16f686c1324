//! GGUF v3 container (read, write) and the quantisation formats of DeepSeek V4 GGUF
//! files: block layouts, dequantisation, activation quantisation and dot products.

// Kernel code indexes several parallel arrays with one loop variable, mirroring the
// format descriptions in the architecture document; iterator chains would hide that.
#![allow(clippy::needless_range_loop)]
// `is_multiple_of` needs Rust 1.87; the workspace's rust-version is 1.85.
#![allow(clippy::manual_is_multiple_of)]

mod error;
pub mod quant;
mod reader;
mod types;
mod value;
mod writer;

pub use error::{GgufError, QuantError};
pub use reader::{GgufFile, TensorInfo, TensorView, DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION};
pub use types::GgmlType;
pub use value::{Value, ValueType};
pub use writer::{write_at, GgufWriter, Layout, WriteError};
