//! The tokenizer of a DS4 GGUF, from its `tokenizer.ggml.*` metadata.

use anyhow::{bail, Result};
use ds4_gguf::GgufFile;
use ds4_tokenizer::Tokenizer;

pub fn from_gguf(gguf: &GgufFile) -> Result<Tokenizer> {
    let strings = |key: &str| -> Result<Vec<String>> {
        match gguf.get(key).and_then(|v| v.as_str_array()) {
            Some(v) => Ok(v.into_iter().map(str::to_string).collect()),
            None => bail!("the model has no string array {key}; is this a DS4 GGUF?"),
        }
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
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
