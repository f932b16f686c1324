//! DeepSeek V4 Flash inference engine.
//!
//! The API at the crate root is narrow, in the spirit of the reference's `ds4.h`, so
//! that the CLI and the HTTP server do not depend on tensor or device internals:
//!
//! * [`Engine::open`] maps a GGUF, binds its tensors and brings the model up on the
//!   backend [`BackendChoice`] asks for (CUDA or the CPU reference, chosen in one place
//!   and reported by [`Engine::backend`] / [`Engine::backend_reason`]). The engine
//!   answers [`Engine::tokenizer`], [`Engine::routed_quant_bits`] and
//!   [`Engine::info`], and creates [`Session`]s.
//! * A [`Session`] holds one sequence's state and runs prefill and decode in one of
//!   two [`Numerics`] modes. Its state can be copied ([`Session::try_clone`]), moved
//!   through host memory ([`Session::export_state`] / [`Session::import_state`]) or
//!   written as the `DSV4` payload of the disk KV cache ([`Session::save_payload`] /
//!   [`Session::load_payload`]); all of these are fallible, since device memory can
//!   run out.
//! * [`EngineError`]s keep their cause; [`EngineError::kind`] sorts them.
//! * Sampling: [`Sampler`], [`generate`], [`argmax`].
//! * [`Engine::load_mtp`] loads the optional MTP GGUF as an [`Mtp`] draft block
//!   (CPU; its own [`MtpState`], never part of a session's state); a [`Speculator`]
//!   runs speculative decoding with it ([`Speculator::advance`]).
//!
//! Tools, benchmarks and tests that need the model internals (config, tensor layout,
//! ops, backends, KV cache) use [`dev`], which makes no stability promise.
//!
//! The CUDA backend is behind the default `cuda` feature.

mod backend;
mod config;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod dev;
mod dev_fixture;
mod engine;
mod error;
mod imatrix;
mod kv;
mod layout;
mod model;
mod mtp;
mod ops;
mod payload;
mod placement;
mod sampling;
mod session;
mod spec;
mod steer;
mod tokenizer;
mod weights;

pub use config::Config;
pub use engine::{
    load_tokenizer, BackendChoice, BackendKind, Engine, EngineOptions, ModelInfo, UploadProgress,
};
pub use error::{ConfigError, EngineError, ErrorKind, Result};
pub use imatrix::{
    split_dataset, Imatrix, ImatrixCollector, ImatrixEntry, MoeActivations, MoeObserver,
    PROMPT_MARKER,
};
pub use mtp::{Mtp, MtpDraft, MtpState};
pub use ops::linear::Numerics;
pub use placement::{
    describe_split, parse_device_map, parse_gpus, plan_device_map, plan_split, split_layers,
    DeviceMap, GpuList, MemoryNeeds, MemoryOptions, Offload, Placement, PlanError, Stage,
    DEFAULT_PLAN_CTX,
};
pub use sampling::{argmax, argmax_skip, generate, Sampler, SamplerConfig, StopReason};
pub use session::{Session, SessionOptions, SessionState, DEFAULT_PREFILL_CHUNK};
pub use spec::{SpecOptions, SpecStats, Speculator, MAX_DRAFT};
pub use steer::{Component, Steering};
