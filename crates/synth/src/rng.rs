//! The seedable generator of the synthetic weights (it lives beside the random blocks
//! it drives, in `ds4_gguf::quant::random`, which the CUDA kernel checks share).

pub use ds4_gguf::quant::random::Rng;
