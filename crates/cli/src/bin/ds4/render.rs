//! Chat prompt tokens (server.md §1.4, "CLI") and the streaming answer printer.

use std::io::Write;

use ds4_tokenizer::chat::REASONING_EFFORT_MAX;
use ds4_tokenizer::markers::BOS;
use ds4_tokenizer::{SpecialIds, Tokenizer};

use crate::args::Think;

/// BOS, [Think Max paragraph], system text: the head of every transcript.
pub fn head_tokens(tok: &Tokenizer, sp: &SpecialIds, system: &str, think: Think) -> Vec<u32> {
    let mut v = vec![sp.bos];
    if think == Think::Max {
        v.extend(tok.encode_plain(REASONING_EFFORT_MAX));
    }
    if !system.is_empty() {
        v.extend(tok.encode_plain(system));
    }
    v
}

/// `<｜User｜>` text `<｜Assistant｜>` and `<think>` or `</think>`: one user turn and
/// the assistant prefix. The text is tokenized as plain text (markers in it are not
/// special), as the reference does.
pub fn turn_tokens(tok: &Tokenizer, sp: &SpecialIds, text: &str, think: Think) -> Vec<u32> {
    let mut v = vec![sp.user];
    v.extend(tok.encode_plain(text));
    v.push(sp.assistant);
    v.push(if think.enabled() {
        sp.think_start
    } else {
        sp.think_end
    });
    v
}

/// The one-shot prompt. A prompt that starts with the BOS string is a rendered chat
/// and is tokenized verbatim (markers become their special tokens).
pub fn prompt_tokens(
    tok: &Tokenizer,
    sp: &SpecialIds,
    system: &str,
    prompt: &str,
    think: Think,
) -> Vec<u32> {
    if prompt.starts_with(BOS) {
        return tok.encode(prompt);
    }
    let mut v = head_tokens(tok, sp, system, think);
    v.extend(turn_tokens(tok, sp, prompt, think));
    v
}

const THINK_OPEN: &[u8] = b"<think>";
const THINK_CLOSE: &[u8] = b"</think>";
const GREY: &str = "\x1b[90m";
const RESET: &str = "\x1b[0m";

/// Writes generated text: strips `<think>`/`</think>`, shows reasoning in grey on a
/// terminal and ends it with a newline. Works on raw token bytes; a tag split across
/// tokens is held back until it is decided.
pub struct TokenPrinter<W: Write> {
    out: W,
    format_thinking: bool,
    in_think: bool,
    color: bool,
    color_open: bool,
    last_newline: bool,
    pending: Vec<u8>,
}

impl<W: Write> TokenPrinter<W> {
    /// `thinking`: the prompt ended with `<think>`, so the output starts as reasoning.
    pub fn new(out: W, thinking: bool, color: bool) -> Self {
        TokenPrinter {
            out,
            format_thinking: thinking,
            in_think: thinking,
            color,
            color_open: false,
            last_newline: true,
            pending: Vec::new(),
        }
    }

    pub fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if !self.format_thinking {
            if let Some(&b) = bytes.last() {
                self.out.write_all(bytes)?;
                self.last_newline = b == b'\n';
            }
            return self.out.flush();
        }
        self.process(bytes, false)?;
        self.out.flush()
    }

    fn process(&mut self, bytes: &[u8], finish: bool) -> std::io::Result<()> {
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(bytes);
        let mut i = 0;
        let mut plain = Vec::with_capacity(buf.len());
        while i < buf.len() {
            let rest = &buf[i..];
            if rest.starts_with(THINK_OPEN) {
                self.flush_plain(&mut plain)?;
                self.in_think = true;
                i += THINK_OPEN.len();
                continue;
            }
            if rest.starts_with(THINK_CLOSE) {
                self.flush_plain(&mut plain)?;
                self.in_think = false;
                self.reset_color()?;
                if !self.last_newline {
                    self.out.write_all(b"\n")?;
                    self.last_newline = true;
                }
                i += THINK_CLOSE.len();
                continue;
            }
            if !finish
                && rest[0] == b'<'
                && (THINK_OPEN.starts_with(rest) || THINK_CLOSE.starts_with(rest))
            {
                self.pending = rest.to_vec();
                break;
            }
            plain.push(rest[0]);
            i += 1;
        }
        self.flush_plain(&mut plain)
    }

    fn flush_plain(&mut self, plain: &mut Vec<u8>) -> std::io::Result<()> {
        if plain.is_empty() {
            return Ok(());
        }
        if self.in_think && self.color && !self.color_open {
            self.out.write_all(GREY.as_bytes())?;
            self.color_open = true;
        }
        self.out.write_all(plain)?;
        self.last_newline = plain.last() == Some(&b'\n');
        plain.clear();
        Ok(())
    }

    fn reset_color(&mut self) -> std::io::Result<()> {
        if self.color_open {
            self.out.write_all(RESET.as_bytes())?;
            self.color_open = false;
        }
        Ok(())
    }

    /// Ends the answer: writes held bytes, resets the colour, ends the line.
    pub fn finish(&mut self) -> std::io::Result<()> {
        if self.format_thinking {
            self.process(&[], true)?;
        }
        self.reset_color()?;
        if !self.last_newline {
            self.out.write_all(b"\n")?;
            self.last_newline = true;
        }
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(thinking: bool, color: bool, pieces: &[&str]) -> String {
        let mut p = TokenPrinter::new(Vec::new(), thinking, color);
        for s in pieces {
            p.write(s.as_bytes()).unwrap();
        }
        p.finish().unwrap();
        String::from_utf8(p.out).unwrap()
    }

    #[test]
    fn strips_think_tags_split_across_tokens() {
        assert_eq!(
            run(true, false, &["I reason", "</th", "ink>", "Answer"]),
            "I reason\nAnswer\n"
        );
        assert_eq!(run(false, false, &["a<b", "c"]), "a<bc\n");
        assert_eq!(run(true, false, &["x<", "y"]), "x<y\n");
        assert_eq!(
            run(true, true, &["r\n", "</think>", "A"]),
            "\x1b[90mr\n\x1b[0mA\n"
        );
    }
}
