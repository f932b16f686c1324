//! The ds4 server: OpenAI- and Anthropic-compatible HTTP API over the ds4 engine, with
//! live KV reuse and a disk KV cache (docs/server.md).
//!
//! Layout: [`http`] routes requests to the [`api`] modules, which parse and render them
//! into jobs for the single engine [`worker`]; the worker streams [`job::GenEvent`]s back,
//! which [`sse`] formatters or the non-streaming bodies turn into each API's shape.

pub mod api;
pub mod bindings;
pub mod config;
pub mod engine;
pub mod error;
pub mod gen;
pub mod http;
pub mod job;
pub mod kvcache;
pub mod lock;
pub mod metrics;
pub mod render;
pub mod server;
pub mod sse;
pub mod toolmem;
pub mod web;
pub mod worker;

pub use config::{Args, ServerConfig};
pub use engine::{EngineBackend, FakeEngine, RealEngine};
pub use error::{ApiError, ServerError};
pub use server::{serve, Startup, TestServer};
pub use worker::Shared;
