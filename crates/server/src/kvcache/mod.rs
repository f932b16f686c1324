//! KV reuse: the disk cache of session checkpoints (§4.4). Live reuse (§4.1) lives in
//! the worker, which owns the session.

pub mod disk;
pub mod format;

pub use disk::{DiskCache, SaveReason};
pub use format::{Header, HEADER_LEN};
