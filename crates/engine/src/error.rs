//! Engine errors.

use std::path::PathBuf;

use ds4_gguf::{GgmlType, GgufError};

use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: GgufError,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("tensor {name} is missing (expected {expected})")]
    MissingTensor { name: String, expected: String },
    #[error("tensor {name}: dims {got:?}, expected {expected:?}")]
    TensorDims {
        name: String,
        got: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("tensor {name}: type {got:?} is not supported here (expected {expected})")]
    TensorType {
        name: String,
        got: GgmlType,
        expected: String,
    },
    #[error("tensor {name}: {msg}")]
    TensorData { name: String, msg: String },
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    BadToken { token: u32, vocab: usize },
    #[error("context of {ctx} tokens is full ({have} held, {adding} more requested)")]
    ContextFull {
        ctx: usize,
        have: usize,
        adding: usize,
    },
    #[error("session payload: {0}")]
    Payload(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Invalid(String),
    /// A device backend failed (driver error, out of device memory, …).
    #[error("{0}")]
    Backend(String),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
