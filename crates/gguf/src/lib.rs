//! GGUF v3 container (read, write) and the quantisation formats of DeepSeek V4 GGUF
//! files: block layouts, dequantisation, activation quantisation and dot products.

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
pub use writer::{GgufWriter, Layout, WriteError};
