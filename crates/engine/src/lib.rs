//! DeepSeek V4 Flash inference engine.
