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
    let tok = Tokenizer::from_gguf_vocab(tokens, merges, types)?;
    check_ids(gguf, &tok)?;
    Ok(tok)
}

/// #18 item 11: a BOS/EOS id at or past the model's vocabulary would index past the
/// embedding table on the first token; the metadata ids and the ids found by string
/// must both lie inside `deepseek4.vocab_size` (and the token list).
fn check_ids(gguf: &GgufFile, tok: &Tokenizer) -> Result<()> {
    let vocab = gguf
        .get("deepseek4.vocab_size")
        .and_then(|v| v.as_i64())
        .and_then(|v| usize::try_from(v).ok())
        .map_or(tok.vocab_size(), |v| v.min(tok.vocab_size()));
    let mut ids = Vec::new();
    for key in ["bos", "eos"] {
        let key = format!("tokenizer.ggml.{key}_token_id");
        if let Some(v) = gguf.get(&key) {
            let id = v.as_i64().ok_or_else(|| {
                EngineError::Invalid(format!("metadata key {key:?} must be an integer"))
            })?;
            ids.push((key, id));
        }
    }
    if let Ok(s) = tok.special_ids() {
        ids.push(("the BOS token".into(), s.bos as i64));
        ids.push(("the EOS token".into(), s.eos as i64));
    }
    match ids
        .into_iter()
        .find(|(_, id)| !(0..vocab as i64).contains(id))
    {
        Some((what, id)) => Err(EngineError::Invalid(format!(
            "{what} is id {id}, outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}
