//! The official DeepSeek V4 Flash checkpoint (Hugging Face safetensors: FP8 E4M3
//! block-scaled dense weights, FP4 E2M1 routed experts, BF16/F32 rest) to DS4 GGUF
//! files in the published layouts, for `ds4-tool quantize` and `ds4-tool splice`.
//!
//! * [`hf::Checkpoint`]: the shards, memory-mapped, tensors by name;
//! * [`formats`]: exact FP8/FP4/UE8M0 decoding (and encoders for test checkpoints);
//! * [`names`]: GGUF ↔ official parameter names;
//! * [`plan::Plan`]: target types (the q2/q4 mixes), metadata, layout, `--dry-run`;
//! * [`write::write`]: the streaming, restartable conversion;
//! * [`imatrix`]: the legacy llama.cpp `.dat` importance matrix;
//! * [`compare`], [`splice`]: `--compare-tensor` and mixed q2/q4 files;
//! * [`testckpt`]: a tiny checkpoint in the official naming and dtypes, made from a
//!   GGUF's weights (for tests).

pub mod compare;
pub mod formats;
pub mod hf;
pub mod hfconfig;
pub mod imatrix;
pub mod names;
pub mod plan;
pub mod splice;
pub mod testckpt;
pub mod write;

pub use plan::{Mix, Options, Plan};
