//! Reading a vocabulary from `tokenizer.json` or from GGUF metadata arrays.

use serde_json::Value;

use crate::error::TokenizerError;

/// An added token: matched as a whole string in the input before pre-tokenization.
#[derive(Clone, Debug)]
pub(crate) struct AddedSpec {
    pub id: u32,
    pub content: String,
    /// Dropped by `decode(.., skip_special = true)`.
    pub special: bool,
    /// Matched in the second pass (after the non-normalized tokens), as the reference does.
    pub normalized: bool,
}

/// Everything needed to build a tokenizer, independent of the source format.
pub(crate) struct VocabSpec {
    /// Token string of each id (None for ids that have no token).
    pub tokens: Vec<Option<String>>,
    pub merges: Vec<(String, String)>,
    pub added: Vec<AddedSpec>,
}

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

fn format_err(msg: impl Into<String>) -> TokenizerError {
    TokenizerError::Format(msg.into())
}

fn split_merge(s: &str) -> Result<(String, String), TokenizerError> {
    match s.split_once(' ') {
        Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => {
            Ok((a.to_string(), b.to_string()))
        }
        _ => Err(TokenizerError::BadMerge(s.to_string())),
    }
}

/// The pre-tokenizer this crate implements, as written in the official `tokenizer.json`.
const EXPECTED_SPLITS: [&str; 3] = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

/// Refuses a file whose pre-tokenizer, normalizer or model differ from the official ones:
/// the splitter is hand-coded for exactly that configuration.
fn check_pipeline(root: &Value) -> Result<(), TokenizerError> {
    let unsupported = |what: &str| Err(TokenizerError::Unsupported(what.to_string()));
    match root.get("normalizer") {
        None | Some(Value::Null) => {}
        Some(n) => {
            let empty_seq = n.get("type").and_then(Value::as_str) == Some("Sequence")
                && n.get("normalizers")
                    .and_then(Value::as_array)
                    .is_some_and(|a| a.is_empty());
            if !empty_seq {
                return unsupported("normalizer other than an empty sequence");
            }
        }
    }
    let pre = root
        .get("pre_tokenizer")
        .ok_or_else(|| format_err("no pre_tokenizer"))?;
    let steps = pre
        .get("pretokenizers")
        .and_then(Value::as_array)
        .ok_or_else(|| TokenizerError::Unsupported("pre_tokenizer is not a sequence".into()))?;
    if steps.len() != 4 {
        return unsupported("pre_tokenizer sequence is not 3 splits + ByteLevel");
    }
    for (step, pattern) in steps.iter().zip(EXPECTED_SPLITS) {
        let ok = step.get("type").and_then(Value::as_str) == Some("Split")
            && step.pointer("/pattern/Regex").and_then(Value::as_str) == Some(pattern)
            && step.get("behavior").and_then(Value::as_str) == Some("Isolated")
            && step.get("invert").and_then(Value::as_bool) != Some(true);
        if !ok {
            return unsupported("pre_tokenizer split differs from the DeepSeek V4 one");
        }
    }
    let bl = &steps[3];
    if bl.get("type").and_then(Value::as_str) != Some("ByteLevel")
        || bl.get("add_prefix_space").and_then(Value::as_bool) == Some(true)
        || bl.get("use_regex").and_then(Value::as_bool) == Some(true)
    {
        return unsupported("last pre_tokenizer step is not ByteLevel without prefix space/regex");
    }
    let model = root.get("model").ok_or_else(|| format_err("no model"))?;
    if model
        .get("type")
        .and_then(Value::as_str)
        .is_some_and(|t| t != "BPE")
    {
        return unsupported("model is not BPE");
    }
    if model.get("ignore_merges").and_then(Value::as_bool) == Some(true) {
        return unsupported("ignore_merges");
    }
    if model.get("dropout").is_some_and(|d| !d.is_null()) {
        return unsupported("BPE dropout");
    }
    for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if model
            .get(key)
            .is_some_and(|v| !v.is_null() && v.as_str() != Some(""))
        {
            return unsupported(key);
        }
    }
    Ok(())
}

pub(crate) fn from_tokenizer_json(bytes: &[u8]) -> Result<VocabSpec, TokenizerError> {
    let root: Value = serde_json::from_slice(bytes)?;
    check_pipeline(&root)?;
    let model = root.get("model").ok_or_else(|| format_err("no model"))?;
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| format_err("model.vocab is not an object"))?;
    let mut tokens: Vec<Option<String>> = Vec::new();
    let put = |tokens: &mut Vec<Option<String>>, id: u64, s: &str| -> Result<(), TokenizerError> {
        let id = usize::try_from(id)
            .ok()
            .filter(|&i| i < (1 << 24))
            .ok_or_else(|| format_err(format!("token id {id} out of range")))?;
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some(s.to_string());
        Ok(())
    };
    for (s, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| format_err(format!("vocab id of {s:?} is not an integer")))?;
        put(&mut tokens, id, s)?;
    }
    let mut merges = Vec::new();
    for m in model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or_else(|| format_err("model.merges is not an array"))?
    {
        match m {
            Value::String(s) => merges.push(split_merge(s)?),
            Value::Array(pair) if pair.len() == 2 => match (&pair[0], &pair[1]) {
                (Value::String(a), Value::String(b)) => merges.push((a.clone(), b.clone())),
                _ => return Err(format_err("merge pair is not two strings")),
            },
            _ => return Err(format_err("merge is neither a string nor a pair")),
        }
    }
    let mut added = Vec::new();
    if let Some(list) = root.get("added_tokens").and_then(Value::as_array) {
        for t in list {
            let id = t
                .get("id")
                .and_then(Value::as_u64)
                .ok_or_else(|| format_err("added token without id"))?;
            let content = t
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| format_err("added token without content"))?;
            let flag = |k: &str| t.get(k).and_then(Value::as_bool).unwrap_or(false);
            if flag("single_word") || flag("lstrip") || flag("rstrip") {
                return Err(TokenizerError::Unsupported(format!(
                    "added token {content:?} uses single_word/lstrip/rstrip"
                )));
            }
            put(&mut tokens, id, content)?;
            added.push(AddedSpec {
                id: id as u32,
                content: content.to_string(),
                special: flag("special"),
                normalized: t.get("normalized").and_then(Value::as_bool).unwrap_or(true),
            });
        }
    }
    Ok(VocabSpec {
        tokens,
        merges,
        added,
    })
}

/// Strings of the added tokens that are not control tokens, used when a GGUF file has no
/// token types: everything else that cannot come out of the byte-level BPE is treated as
/// a control token.
const KNOWN_NON_SPECIAL_ASCII: [&str; 5] = ["<think>", "</think>", "<|EOT|>", "<dsml:", "</dsml:"];

pub(crate) fn from_gguf(
    tokens: Vec<String>,
    merges: Vec<String>,
    token_types: Option<Vec<i32>>,
) -> Result<VocabSpec, TokenizerError> {
    if let Some(types) = &token_types {
        if types.len() != tokens.len() {
            return Err(TokenizerError::TokenTypeCount {
                tokens: tokens.len(),
                types: types.len(),
            });
        }
    }
    let alphabet = crate::bpe::char_to_byte_table();
    let in_alphabet = |s: &str| {
        s.chars()
            .all(|c| (c as usize) < alphabet.len() && alphabet[c as usize].is_some())
    };
    let mut added = Vec::new();
    for (id, s) in tokens.iter().enumerate() {
        let (is_added, special) = match &token_types {
            Some(types) => match types[id] {
                token_type::CONTROL => (true, true),
                token_type::USER_DEFINED => (true, false),
                _ => (false, false),
            },
            None => {
                if KNOWN_NON_SPECIAL_ASCII.contains(&s.as_str()) {
                    (true, false)
                } else if !in_alphabet(s) {
                    // `｜DSML｜` and the chat markers are kept on decode; the rest is control.
                    let keep = ["<｜User｜>", "<｜Assistant｜>", "｜DSML｜"].contains(&s.as_str())
                        || !s.contains("▁") && s.contains('｜');
                    (true, !keep)
                } else {
                    (false, false)
                }
            }
        };
        if is_added && !s.is_empty() {
            added.push(AddedSpec {
                id: id as u32,
                content: s.clone(),
                special,
                // GGUF does not record it; user-defined tokens are the normalized ones in
                // the official file (the order of the two passes never matters there).
                normalized: !special,
            });
        }
    }
    let merges = merges
        .iter()
        .map(|m| split_merge(m))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(VocabSpec {
        tokens: tokens.into_iter().map(Some).collect(),
        merges,
        added,
    })
}
