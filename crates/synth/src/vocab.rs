//! Tokenizer metadata (`tokenizer.ggml.*`) for GGUF files: converted from an HF
//! `tokenizer.json` as the published DS4 files carry it, or a small built-in
//! byte-level vocabulary for synthetic models.

use anyhow::{bail, Context, Result};
use ds4_gguf::{Value, ValueType};

/// ggml token types.
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_USER_DEFINED: i32 = 4;

/// The chat markers every DS4 vocabulary must have (looked up by string).
pub const CHAT_MARKERS: [&str; 5] = [
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
];
pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const PAD: &str = "<｜▁pad▁｜>";

/// A vocabulary ready to be written as GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct Vocab {
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos: u32,
    pub eos: u32,
}

impl Vocab {
    /// The `tokenizer.ggml.*` keys in the order the published files use.
    pub fn metadata(&self) -> Vec<(String, Value)> {
        let k = |s: &str| format!("tokenizer.ggml.{s}");
        vec![
            (k("model"), Value::String("gpt2".into())),
            (k("pre"), Value::String("joyai-llm".into())),
            (k("tokens"), Value::string_array(&self.tokens)),
            (k("token_type"), Value::i32_array(&self.token_types)),
            (k("merges"), Value::string_array(&self.merges)),
            (k("bos_token_id"), Value::U32(self.bos)),
            (k("eos_token_id"), Value::U32(self.eos)),
            (k("padding_token_id"), Value::U32(self.eos)),
            (k("add_bos_token"), Value::Bool(false)),
            (k("add_eos_token"), Value::Bool(false)),
        ]
    }

    /// Converts an HF `tokenizer.json` (byte-level BPE): the base vocabulary, the
    /// merges (either `"a b"` strings or `["a", "b"]` pairs) and the added tokens
    /// (`special` → control, otherwise user-defined).
    pub fn from_tokenizer_json(text: &str) -> Result<Vocab> {
        let j: serde_json::Value =
            serde_json::from_str(text).context("tokenizer.json is not valid JSON")?;
        let model = &j["model"];
        if model["type"].as_str() != Some("BPE") {
            bail!("tokenizer.json: model.type must be \"BPE\"");
        }
        let vocab = model["vocab"]
            .as_object()
            .context("tokenizer.json: model.vocab missing")?;
        let added = j["added_tokens"].as_array().cloned().unwrap_or_default();
        let mut n = 0usize;
        for id in vocab.values().chain(added.iter().map(|a| &a["id"])) {
            let id = id
                .as_u64()
                .context("tokenizer.json: token id is not an integer")?
                as usize;
            n = n.max(id + 1);
        }
        if n > 10_000_000 {
            bail!("tokenizer.json: implausible vocabulary size {n}");
        }
        let mut tokens: Vec<Option<String>> = vec![None; n];
        let mut types = vec![TOKEN_NORMAL; n];
        for (tok, id) in vocab {
            tokens[id.as_u64().unwrap_or_default() as usize] = Some(tok.clone());
        }
        for a in &added {
            let id = a["id"].as_u64().unwrap_or_default() as usize;
            let content = a["content"]
                .as_str()
                .context("tokenizer.json: added token without content")?;
            tokens[id] = Some(content.to_string());
            types[id] = if a["special"].as_bool() == Some(true) {
                TOKEN_CONTROL
            } else {
                TOKEN_USER_DEFINED
            };
        }
        let tokens: Vec<String> = tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| t.with_context(|| format!("tokenizer.json: no token has id {i}")))
            .collect::<Result<_>>()?;
        let merges = model["merges"]
            .as_array()
            .context("tokenizer.json: model.merges missing")?
            .iter()
            .map(|m| match m {
                serde_json::Value::String(s) => Ok(s.clone()),
                serde_json::Value::Array(p) if p.len() == 2 => Ok(format!(
                    "{} {}",
                    p[0].as_str().unwrap_or_default(),
                    p[1].as_str().unwrap_or_default()
                )),
                _ => bail!("tokenizer.json: malformed merge {m}"),
            })
            .collect::<Result<_>>()?;
        let find = |s: &str| {
            tokens
                .iter()
                .position(|t| t == s)
                .map(|i| i as u32)
                .with_context(|| format!("tokenizer.json has no {s} token"))
        };
        Ok(Vocab {
            bos: find(BOS)?,
            eos: find(EOS)?,
            tokens,
            token_types: types,
            merges,
        })
    }

    /// A byte-level vocabulary of exactly `size` ids with no merges: BOS, EOS, pad,
    /// the 256 byte symbols, the chat markers, then `<｜place▁holder▁no▁N｜>` control
    /// tokens. Every text tokenizes (one token per byte), and every marker exists.
    pub fn builtin(size: usize) -> Result<Vocab> {
        let mut tokens: Vec<String> = vec![BOS.into(), EOS.into(), PAD.into()];
        let mut types = vec![TOKEN_CONTROL; 3];
        for b in byte_symbols() {
            tokens.push(b.to_string());
            types.push(TOKEN_NORMAL);
        }
        for m in CHAT_MARKERS {
            tokens.push(m.to_string());
            types.push(TOKEN_USER_DEFINED);
        }
        if size < tokens.len() {
            bail!(
                "a vocabulary needs at least {} tokens, the model has {size}",
                tokens.len()
            );
        }
        let mut i = 0;
        while tokens.len() < size {
            tokens.push(format!("<｜place▁holder▁no▁{i}｜>"));
            types.push(TOKEN_CONTROL);
            i += 1;
        }
        Ok(Vocab {
            tokens,
            token_types: types,
            merges: Vec::new(),
            bos: 0,
            eos: 1,
        })
    }
}

/// The GPT-2 byte-to-symbol map in vocabulary order: printable bytes map to
/// themselves (`!`..`~`, `¡`..`¬`, `®`..`ÿ`), the other 68 to U+0100.. in byte order.
pub fn byte_symbols() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut out: Vec<char> = (0..256u32)
        .filter(|&b| printable(b))
        .filter_map(char::from_u32)
        .collect();
    let mut next = 256u32;
    for b in 0..256u32 {
        if !printable(b) {
            out.push(char::from_u32(next).expect("U+0100..U+0143 are chars"));
            next += 1;
        }
    }
    out
}

/// Reads the vocabulary size of `tokenizer.ggml.tokens` without copying it.
pub fn gguf_vocab_len(v: &Value) -> Option<usize> {
    match v {
        Value::Array(ValueType::String, items) => Some(items.len()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_vocab_has_markers_and_bytes() {
        let v = Vocab::builtin(512).unwrap();
        assert_eq!(v.tokens.len(), 512);
        assert_eq!(v.tokens[3], "!");
        assert_eq!(v.tokens[3 + 255], "\u{143}");
        assert!(CHAT_MARKERS.iter().all(|m| v.tokens.iter().any(|t| t == m)));
        assert!(Vocab::builtin(10).is_err());
    }

    #[test]
    fn tiny_tokenizer_json_matches_the_tiny_gguf_vocab() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny");
        let v = Vocab::from_tokenizer_json(
            &std::fs::read_to_string(dir.join("tokenizer.json")).unwrap(),
        )
        .unwrap();
        let g = ds4_gguf::GgufFile::open(dir.join("tiny-q2.gguf")).unwrap();
        let key = |k: &str| g.get(k).unwrap_or_else(|| panic!("{k} missing"));
        assert_eq!(
            v.tokens,
            key("tokenizer.ggml.tokens").as_str_array().unwrap()
        );
        assert_eq!(
            v.merges,
            key("tokenizer.ggml.merges").as_str_array().unwrap()
        );
        let (_, types) = key("tokenizer.ggml.token_type").as_array().unwrap();
        let types: Vec<i32> = types.iter().map(|t| t.as_i64().unwrap() as i32).collect();
        assert_eq!(v.token_types, types);
    }
}
