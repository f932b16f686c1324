//! DeepSeek V4 Flash inference engine.
pub mod config;
pub mod layout;
