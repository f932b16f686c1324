//! The tokenizer of a DS4 GGUF, from its `tokenizer.ggml.*` metadata.

use ds4_gguf::GgufFile;
use ds4_tokenizer::Tokenizer;

use crate::error::{EngineError, Result};

pub(crate) fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer> {
    let strings = |key: &str| -> Result<Vec<String>> {
        match gguf.get(key).and_then(|v| v.as_str_array()) {
            Some(v) => Ok(v.into_iter().map(str::to_string).collect()),
            None => Err(EngineError::NoTokenizer { key: key.into() }),
        }
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    // A missing or odd type entry counts as a normal token (type 1), as in llama.cpp.
    let types = gguf
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
        .map(|(_, items)| {
            items
                .iter()
                .map(|v| v.as_i64().and_then(|x| i32::try_from(x).ok()).unwrap_or(1))
                .collect()
        });
    Ok(Tokenizer::from_gguf_vocab(tokens, merges, types)?)
}
