//! DeepSeek V4 Flash inference engine.
//!
//! [`Model::load`] maps a GGUF and binds its tensors; a [`Session`] holds one
//! sequence's state on a [`Backend`] (the CPU reference here) and runs prefill and
//! decode in one of two [`Numerics`] modes.
pub mod backend;
pub mod config;
pub mod cpu;
pub mod cuda;
/// Developer checks over the tiny fixtures (`ds4-tool gpu-selftest`, tests); to be
/// folded into the developer module `dev`.
pub mod dev_fixture;
pub mod error;
pub mod kv;
pub mod layout;
pub mod model;
pub mod ops;
pub mod payload;
pub mod sampling;
pub mod session;
pub mod weights;

pub use backend::{Backend, LogitRows};
pub use config::Config;
pub use cpu::CpuBackend;
pub use error::{EngineError, Result};
pub use kv::KvCache;
pub use model::{LoadOptions, Model};
pub use ops::linear::Numerics;
pub use sampling::{argmax, generate, Sampler, SamplerConfig, StopReason};
pub use session::{Session, SessionOptions};
