//! Engine errors. Each keeps what went wrong as a matchable variant (and its source
//! error), and [`EngineError::kind`] sorts them into the few classes a caller acts on
//! differently: a bad model file, a full context, device memory, a missing backend.

use std::path::PathBuf;

use ds4_gguf::{GgmlType, GgufError};

pub use crate::config::ConfigError;

/// What a caller can do about an error, in broad classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The model file cannot be read, or is not a DeepSeek V4 GGUF this engine runs.
    BadFile,
    /// A caller's input is invalid (a token outside the vocabulary, a zero context).
    BadInput,
    /// The session's context has no room for the tokens.
    ContextFull,
    /// A session state or payload does not fit this model or session.
    BadState,
    /// Device memory ran out: retry with a smaller context, or use another backend.
    OutOfMemory,
    /// The requested backend cannot run here (no driver, no device, not built in).
    BackendUnavailable,
    /// Any other device failure (driver error, kernel compilation, lost device).
    Device,
    /// Reading or writing a stream failed.
    Io,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error("cannot open {path}")]
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
    /// A file given as the MTP GGUF is not one (e.g. the main model).
    #[error("not an MTP GGUF: {0}")]
    NotMtp(String),
    /// The file has no `tokenizer.ggml.*` vocabulary.
    #[error("the model has no string array {key}; is this a DS4 GGUF?")]
    NoTokenizer { key: String },
    /// The file's vocabulary does not make a tokenizer.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] ds4_tokenizer::TokenizerError),
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    BadToken { token: u32, vocab: usize },
    #[error("context of {ctx} tokens is full ({have} held, {adding} more requested)")]
    ContextFull {
        ctx: usize,
        have: usize,
        adding: usize,
    },
    /// A session payload or state that does not match the model or the session.
    #[error("session payload: {0}")]
    Payload(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Invalid(String),
    /// Device memory ran out; `source` is the device error.
    #[error("out of {backend} device memory: {source}")]
    OutOfMemory {
        backend: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The requested backend cannot run on this machine or in this build.
    #[error("the {backend} backend is not available: {reason}")]
    Unavailable {
        backend: &'static str,
        reason: String,
    },
    /// A CUDA failure other than running out of memory.
    #[cfg(feature = "cuda")]
    #[error("CUDA: {0}")]
    Device(#[source] ds4_cuda::CudaError),
}

impl EngineError {
    /// A forward pass produced NaN logits (every backend and path says the same).
    pub(crate) fn nan_logits() -> EngineError {
        EngineError::Invalid(
            "the model produced NaN logits: its weights are corrupt (inf or NaN values)".into(),
        )
    }

    pub fn kind(&self) -> ErrorKind {
        use EngineError::*;
        match self {
            Open { .. }
            | Config(_)
            | MissingTensor { .. }
            | TensorDims { .. }
            | TensorType { .. }
            | TensorData { .. }
            | NotMtp(_)
            | NoTokenizer { .. }
            | Tokenizer(_) => ErrorKind::BadFile,
            BadToken { .. } | Invalid(_) => ErrorKind::BadInput,
            ContextFull { .. } => ErrorKind::ContextFull,
            Payload(_) => ErrorKind::BadState,
            Io(_) => ErrorKind::Io,
            OutOfMemory { .. } => ErrorKind::OutOfMemory,
            Unavailable { .. } => ErrorKind::BackendUnavailable,
            #[cfg(feature = "cuda")]
            Device(e) => match e {
                ds4_cuda::CudaError::NoDriver | ds4_cuda::CudaError::NoDevice(..) => {
                    ErrorKind::BackendUnavailable
                }
                _ => ErrorKind::Device,
            },
        }
    }

    /// Whether device memory ran out (shorthand for the [`ErrorKind`] check).
    pub fn is_out_of_memory(&self) -> bool {
        self.kind() == ErrorKind::OutOfMemory
    }
}

#[cfg(feature = "cuda")]
impl From<ds4_cuda::CudaError> for EngineError {
    /// Out-of-memory errors (the weights pre-check and the driver's own) become
    /// [`EngineError::OutOfMemory`]; the rest keep the CUDA error as [`EngineError::Device`].
    fn from(e: ds4_cuda::CudaError) -> Self {
        if e.is_out_of_memory() {
            EngineError::OutOfMemory {
                backend: "cuda",
                source: Box::new(e),
            }
        } else {
            EngineError::Device(e)
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_classify_the_variants() {
        let full = EngineError::ContextFull {
            ctx: 4,
            have: 4,
            adding: 1,
        };
        assert_eq!(full.kind(), ErrorKind::ContextFull);
        assert_eq!(EngineError::Payload("x".into()).kind(), ErrorKind::BadState);
        let missing = EngineError::MissingTensor {
            name: "a".into(),
            expected: "b".into(),
        };
        assert_eq!(missing.kind(), ErrorKind::BadFile);
        let gone = EngineError::Unavailable {
            backend: "cuda",
            reason: "no driver".into(),
        };
        assert_eq!(gone.kind(), ErrorKind::BackendUnavailable);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_out_of_memory_keeps_its_kind_and_source() {
        use ds4_cuda::CudaError;
        let precheck = EngineError::from(CudaError::OutOfMemory {
            name: "GPU".into(),
            need_gib: 81.0,
            free_gib: 79.0,
            total_gib: 80.0,
        });
        assert!(precheck.is_out_of_memory(), "{precheck}");
        let src = std::error::Error::source(&precheck).expect("a source");
        assert!(src.downcast_ref::<CudaError>().is_some());
        let driver = EngineError::from(CudaError::driver_out_of_memory());
        assert_eq!(driver.kind(), ErrorKind::OutOfMemory);
        let other = EngineError::from(CudaError::Invalid("bad launch".into()));
        assert!(matches!(other, EngineError::Device(CudaError::Invalid(_))));
        assert_eq!(other.kind(), ErrorKind::Device);
        let none = EngineError::from(CudaError::NoDriver);
        assert_eq!(none.kind(), ErrorKind::BackendUnavailable);
    }
}
