//! The tokenizer: added-token matching, pre-tokenization and BPE.

use std::collections::HashMap;
use std::ops::Range;

use crate::added::Trie;
use crate::bpe::{char_to_byte_table, Bpe};
use crate::error::TokenizerError;
use crate::vocab::{self, VocabSpec};
use crate::{pretokenize, SpecialIds};

/// DeepSeek V4 byte-level BPE tokenizer, identical in output to Hugging Face `tokenizers`
/// with the official `tokenizer.json` (`encode(text, add_special_tokens=False)`).
pub struct Tokenizer {
    tokens: Vec<Option<String>>,
    token_to_id: HashMap<String, u32>,
    /// Per id: skipped by `decode(.., skip_special = true)`.
    special: Vec<bool>,
    /// Per id: is an added token (matched as a whole in text, never produced by BPE).
    added: Vec<bool>,
    /// First pass: added tokens matched on the raw input.
    trie_raw: Trie,
    /// Second pass: added tokens flagged `normalized` (the normalizer is empty, so only
    /// the pass order can differ from a single pass).
    trie_normalized: Trie,
    bpe: Bpe,
    /// Bytes each id decodes to, concatenated; `decode_offsets[id]..decode_offsets[id + 1]`.
    decode_bytes: Vec<u8>,
    decode_offsets: Vec<u32>,
    specials: Result<SpecialIds, &'static str>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("added_tokens", &self.added.iter().filter(|&&a| a).count())
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer from the bytes of a Hugging Face `tokenizer.json`.
    pub fn from_tokenizer_json(bytes: &[u8]) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::build(vocab::from_tokenizer_json(bytes)?)
    }

    /// Builds the tokenizer from GGUF metadata: `tokenizer.ggml.tokens`,
    /// `tokenizer.ggml.merges` and, if present, `tokenizer.ggml.token_type`.
    ///
    /// Token types 3 (control) and 4 (user-defined) are the added tokens; control tokens
    /// are the special ones (skipped on decode). Without types, added tokens are guessed
    /// from their strings (see `vocab::from_gguf`), which is right for the official
    /// vocabulary's chat markers but not guaranteed for every added token.
    pub fn from_gguf_vocab(
        tokens: Vec<String>,
        merges: Vec<String>,
        token_types: Option<Vec<i32>>,
    ) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::build(vocab::from_gguf(tokens, merges, token_types)?)
    }

    fn build(spec: VocabSpec) -> Result<Tokenizer, TokenizerError> {
        let VocabSpec {
            tokens,
            merges,
            added: added_specs,
        } = spec;
        let n = tokens.len();
        let mut token_to_id = HashMap::with_capacity(n);
        for (id, t) in tokens.iter().enumerate() {
            if let Some(t) = t {
                token_to_id.entry(t.clone()).or_insert(id as u32);
            }
        }
        let mut special = vec![false; n];
        let mut added = vec![false; n];
        for a in &added_specs {
            special[a.id as usize] = a.special;
            added[a.id as usize] = true;
            // Added tokens win over a base-vocabulary entry with the same string.
            token_to_id.insert(a.content.clone(), a.id);
        }
        let trie_raw = Trie::new(
            added_specs
                .iter()
                .filter(|a| !a.normalized)
                .map(|a| (a.content.as_str(), a.id)),
        );
        let trie_normalized = Trie::new(
            added_specs
                .iter()
                .filter(|a| a.normalized)
                .map(|a| (a.content.as_str(), a.id)),
        );
        let bpe = Bpe::new(&token_to_id, &merges)?;

        let inv = char_to_byte_table();
        let mut decode_bytes = Vec::new();
        let mut decode_offsets = Vec::with_capacity(n + 1);
        decode_offsets.push(0u32);
        for t in &tokens {
            if let Some(t) = t {
                // A token whose characters are all in the byte alphabet is those bytes;
                // any other (`｜`, `▁`, …) is its own UTF-8, as the ByteLevel decoder does.
                let mapped: Option<Vec<u8>> = t
                    .chars()
                    .map(|c| inv.get(c as usize).copied().flatten())
                    .collect();
                match mapped {
                    Some(b) => decode_bytes.extend_from_slice(&b),
                    None => decode_bytes.extend_from_slice(t.as_bytes()),
                }
            }
            decode_offsets.push(decode_bytes.len() as u32);
        }
        let mut tok = Tokenizer {
            tokens,
            token_to_id,
            special,
            added,
            trie_raw,
            trie_normalized,
            bpe,
            decode_bytes,
            decode_offsets,
            specials: Err(""),
        };
        tok.specials = SpecialIds::lookup(&tok);
        Ok(tok)
    }

    /// Number of ids (base vocabulary plus added tokens).
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.token_to_id.get(token).copied()
    }

    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).and_then(|t| t.as_deref())
    }

    /// Whether `decode(.., skip_special = true)` drops this id.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Whether this id is an added token (matched in text as a whole string).
    pub fn is_added(&self, id: u32) -> bool {
        self.added.get(id as usize).copied().unwrap_or(false)
    }

    /// The chat special ids, looked up by string. Fails if a required marker is missing.
    pub fn special_ids(&self) -> Result<&SpecialIds, TokenizerError> {
        self.specials
            .as_ref()
            .map_err(|&name| TokenizerError::MissingSpecial(name))
    }

    /// Encodes `text` with added tokens recognised anywhere in it, like Hugging Face
    /// `encode(text, add_special_tokens=False)`. No BOS/EOS is added.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, &mut out);
        out
    }

    /// `encode`, appending to `out`.
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        self.bpe.with_session(|sess| {
            let state = std::cell::RefCell::new((sess, out));
            let plain = |s: &str| {
                let mut st = state.borrow_mut();
                let (sess, out) = &mut *st;
                pretokenize::split(s, |piece| sess.encode_piece(piece.as_bytes(), out));
            };
            let token = |id: u32| state.borrow_mut().1.push(id);
            if self.trie_normalized.is_empty() {
                self.trie_raw.split(text, plain, token);
            } else {
                self.trie_raw
                    .split(text, |s| self.trie_normalized.split(s, plain, token), token);
            }
        })
    }

    /// Encodes a rendered prompt whose byte ranges `plain` (sorted, disjoint, on character
    /// boundaries) hold client text: added tokens are matched only in the text outside
    /// them, each trusted stretch on its own (a token string cut by a range does not
    /// match). Everything between two matched tokens is pre-tokenized as one piece of
    /// text, across range boundaries, so with no token string inside the ranges the ids
    /// are exactly `encode(text)`'s. See [`crate::MarkedText`].
    pub fn encode_marked(&self, text: &str, plain: &[Range<usize>]) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_marked_into(text, plain, &mut out);
        out
    }

    /// `encode_marked`, appending to `out`.
    pub fn encode_marked_into(&self, text: &str, plain: &[Range<usize>], out: &mut Vec<u32>) {
        if plain.is_empty() {
            return self.encode_into(text, out);
        }
        // Token spans in every trusted stretch, with the same two passes as `encode_into`.
        let mut found = Vec::new();
        let mut raw = Vec::new();
        let mut pos = 0;
        for r in plain
            .iter()
            .chain(std::iter::once(&(text.len()..text.len())))
        {
            let (start, end) = (r.start.min(text.len()), r.end.min(text.len()));
            if start > pos {
                raw.clear();
                self.trie_raw.matches(&text[pos..start], pos, &mut raw);
                let mut gap = pos;
                for &(a, b, id) in &raw {
                    self.trie_normalized.matches(&text[gap..a], gap, &mut found);
                    found.push((a, b, id));
                    gap = b;
                }
                self.trie_normalized
                    .matches(&text[gap..start], gap, &mut found);
            }
            pos = pos.max(end);
        }
        self.bpe.with_session(|sess| {
            let mut plain_text = |s: &str, out: &mut Vec<u32>| {
                pretokenize::split(s, |piece| sess.encode_piece(piece.as_bytes(), out));
            };
            let mut at = 0;
            for &(a, b, id) in &found {
                if at < a {
                    plain_text(&text[at..a], out);
                }
                out.push(id);
                at = b;
            }
            if at < text.len() {
                plain_text(&text[at..], out);
            }
        })
    }

    /// `encode_marked` of `text[from..]`, with `plain` given for the whole of `text`.
    pub fn encode_marked_tail(
        &self,
        text: &str,
        plain: &[Range<usize>],
        from: usize,
        out: &mut Vec<u32>,
    ) {
        let ranges = crate::marked::clip_ranges(plain, from);
        self.encode_marked_into(&text[from..], &ranges, out)
    }

    /// Whether the added tokens of `prefix` sit at exactly the byte spans where `full`
    /// has them, over the bytes `prefix` covers (both as concatenated token bytes). Two
    /// tokenizations of the same text can differ in BPE and still share a KV prefix, but
    /// not in where control tokens are: a control token in a cached prefix where a new
    /// prompt has client text (or the other way round) must not be reused.
    pub fn same_added_spans(&self, prefix: &[u32], full: &[u32]) -> bool {
        let n: usize = prefix.iter().map(|&t| self.token_bytes(t).len()).sum();
        let a = self.added_spans(prefix, usize::MAX);
        let b = self.added_spans(full, n);
        a == b && b.last().is_none_or(|&(_, end)| end <= n)
    }

    /// Whether the marks of `text` change nothing: `encode_marked` puts control tokens
    /// exactly where `encode` does (no client text spells one). A text cached under
    /// its bytes alone may then be reused for it.
    pub fn marks_are_inert(&self, text: &str, plain: &[Range<usize>]) -> bool {
        plain.is_empty()
            || self.added_spans(&self.encode_marked(text, plain), usize::MAX)
                == self.added_spans(&self.encode(text), usize::MAX)
    }

    /// Byte spans of the added tokens among `ids` that start before `limit`.
    fn added_spans(&self, ids: &[u32], limit: usize) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        let mut at = 0;
        for &t in ids {
            if at >= limit {
                break;
            }
            let len = self.token_bytes(t).len();
            if self.is_added(t) {
                v.push((at, at + len));
            }
            at += len;
        }
        v
    }

    /// Encodes `text` as ordinary text: added-token strings are split like any other text.
    pub fn encode_plain(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.bpe.with_session(|sess| {
            pretokenize::split(text, |piece| sess.encode_piece(piece.as_bytes(), &mut out));
        });
        out
    }

    /// Pre-tokenizer output for `text` (no added-token matching), for diagnostics.
    pub fn pre_tokenize(&self, text: &str) -> Vec<String> {
        let mut v = Vec::new();
        pretokenize::split(text, |p| v.push(p.to_string()));
        v
    }

    /// Raw bytes of one id: the byte-level inverse for ordinary tokens, the UTF-8 of the
    /// string for added tokens outside the byte alphabet. Empty for unknown ids.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.decode_offsets.get(i), self.decode_offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.decode_bytes[a as usize..b as usize],
            _ => &[],
        }
    }

    #[cfg(test)]
    pub(crate) fn bpe(&self) -> &Bpe {
        &self.bpe
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn official() -> Tokenizer {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/tokenizer/tokenizer.json"
        );
        Tokenizer::from_tokenizer_json(&std::fs::read(path).unwrap()).unwrap()
    }

    /// The heap used for long pieces must merge in exactly the order of the linear scan.
    #[test]
    fn heap_and_scan_merges_agree() {
        let tok = official();
        let mut pieces: Vec<Vec<u8>> = vec![
            b"a".repeat(200),
            b" ".repeat(300),
            "\n".repeat(150).into_bytes(),
            "東京都庁舎の展望室から富士山が見えます"
                .repeat(8)
                .into_bytes(),
            "Pneumonoultramicroscopicsilicovolcanoconiosis"
                .repeat(3)
                .into_bytes(),
            "ололололо".repeat(20).into_bytes(),
        ];
        let mut x = 0x1234_5678_9abc_def0u64;
        for len in [2, 3, 10, 65, 100, 257] {
            for _ in 0..20 {
                let bytes = (0..len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        b"eatnoisrhld \xc3\xa9\xe6\x9d\xb1"[(x % 17) as usize]
                    })
                    .collect();
                pieces.push(bytes);
            }
        }
        for p in &pieces {
            let (scan, heap) = tok.bpe().merge_both_ways(p);
            assert_eq!(scan, heap, "{:?}", String::from_utf8_lossy(p));
        }
    }

    #[test]
    fn shareable_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }

    #[test]
    fn added_tokens_split_inside_words() {
        let tok = official();
        let ids = tok.encode("über</think>gang");
        assert!(ids.contains(&128822));
        assert_eq!(tok.decode(&ids, false), "über</think>gang");
        assert!(!tok.encode_plain("</think>").contains(&128822));
    }
}
