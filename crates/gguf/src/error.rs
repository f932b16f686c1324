use std::path::PathBuf;

/// Everything that can be wrong with a GGUF file. Messages name the offending key,
/// tensor or offset so that a user can tell a truncated download from a wrong file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file (magic {0:#010x}, expected 0x46554747 \"GGUF\")")]
    BadMagic(u32),
    #[error("unsupported GGUF version {0}: only version 3 is supported")]
    BadVersion(u32),
    #[error("file truncated while reading {what} at offset {offset}: needs {needed} bytes, file has {len}")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("implausible {what} count {count} for a file of {len} bytes")]
    AbsurdCount {
        what: &'static str,
        count: u64,
        len: u64,
    },
    #[error("metadata {key:?}: unknown value type {type_id}")]
    UnknownValueType { key: String, type_id: u32 },
    #[error("metadata {key:?}: arrays nested deeper than {limit} levels")]
    TooDeep { key: String, limit: usize },
    #[error("metadata {key:?}: {msg}")]
    BadMetadata { key: String, msg: String },
    #[error("invalid UTF-8 in {what} at offset {offset}")]
    InvalidUtf8 { what: &'static str, offset: u64 },
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("tensor {name:?}: unknown tensor type id {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },
    #[error("tensor {name:?}: {msg}")]
    BadTensor { name: String, msg: String },
    #[error("tensors {first:?} and {second:?} overlap in the data section")]
    Overlap { first: String, second: String },
}

/// Errors of the quantisation kernels (wrong buffer sizes or unsupported types).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("type {0} cannot be dequantized by this engine")]
    Unsupported(crate::GgmlType),
    #[error("{ty}: {elems} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        ty: crate::GgmlType,
        elems: usize,
        block: usize,
    },
    #[error("{ty}: buffer of {got} bytes, expected {expected}")]
    SizeMismatch {
        ty: crate::GgmlType,
        got: usize,
        expected: usize,
    },
}
