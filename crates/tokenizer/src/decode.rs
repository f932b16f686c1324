//! Decoding ids to text, in one go or as a stream.

use crate::Tokenizer;

impl Tokenizer {
    /// Decodes `ids` like Hugging Face `decode(ids, skip_special_tokens)`: the bytes of all
    /// tokens are joined and decoded as UTF-8, each maximal invalid subsequence becoming
    /// one U+FFFD. Unknown ids are skipped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let bytes = self.decode_to_bytes(ids, skip_special);
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// The raw bytes `decode` would interpret as UTF-8.
    pub fn decode_to_bytes(&self, ids: &[u32], skip_special: bool) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            bytes.extend_from_slice(self.token_bytes(id));
        }
        bytes
    }

    /// A streaming decoder for this tokenizer.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder {
            tok: self,
            skip_special,
            pending: Vec::new(),
        }
    }
}

/// Turns ids into text piece by piece. A multi-byte character split across tokens is held
/// until it is complete, so every returned piece is whole UTF-8; invalid bytes are
/// replaced exactly where a one-shot `decode` would replace them. The concatenation of all
/// pieces plus `finish()` equals `decode` of all the ids.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Adds one id; returns the text that became final (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        if self.skip_special && self.tok.is_special(id) {
            return String::new();
        }
        let bytes = self.tok.token_bytes(id);
        self.push_bytes(bytes)
    }

    /// Adds raw bytes; returns the text that became final.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix is valid UTF-8 by the error's own report.
                    out.push_str(&String::from_utf8_lossy(
                        &self.pending[start..start + valid],
                    ));
                    start += valid;
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            start += n;
                        }
                        // An incomplete sequence at the end: wait for more bytes.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Bytes held back because they may start a multi-byte character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: held bytes that never completed become U+FFFD.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}
