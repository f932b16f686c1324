//! Simulations of the model's quantisation-aware training (FP8 E4M3 on KV nope dims,
//! FP4 E2M1 after a Hadamard rotation on indexer queries and index rows). They live in
//! `ds4_gguf::quant::qat` so that the CUDA kernel checks (`ds4_cuda::selftest`), which
//! cannot depend on this crate, use the same reference.

pub use ds4_gguf::quant::qat::*;
