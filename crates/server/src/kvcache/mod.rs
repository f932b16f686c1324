//! KV reuse: the disk cache of session checkpoints (§4.4). Live reuse (§4.1) lives in
//! the worker, which owns the session.

pub mod disk;

pub use disk::{DiskCache, Header, SaveReason, HEADER_LEN};
