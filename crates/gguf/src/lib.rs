//! GGUF v3 container and quantisation formats.
