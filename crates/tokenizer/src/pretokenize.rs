//! The official pre-tokenizer, hand-coded.
//!
//! `tokenizer.json` chains three `Split` steps (all `Isolated`) before `ByteLevel`:
//!
//! 1. `\p{N}{1,3}`
//! 2. `[一-龥぀-ゟ゠-ヿ]+`
//! 3. `[!-/:-@\[-`{-~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//!
//! Each step runs on every piece the previous one produced, so a regex never sees across a
//! piece boundary (a lookahead at the end of a piece sees the end of the string). Matches
//! and the unmatched gaps between them both become pieces.
//!
//! Rather than run a backtracking regex engine, the third pattern is evaluated by hand: at
//! each position the first alternative that can match decides the match, which is what
//! Oniguruma's ordered alternation does. The character classes come from
//! `unicode_tables.rs`, generated from the same Oniguruma build that produced the
//! reference ids, so the Unicode version matches too.

use std::sync::OnceLock;

use crate::unicode_tables::CLASS_RANGES;

/// Character class as seen by the pre-tokenizer regexes.
///
/// Letters and marks are merged (`[\p{L}\p{M}]+` is the only place either appears besides
/// the optional prefix, where a mark behaves the same as inside the run); punctuation and
/// symbols are merged likewise (`[\p{P}\p{S}]` always appear together).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(crate) enum Class {
    Other = 0,
    LetterMark = 1,
    Number = 2,
    PunctSymbol = 3,
    Space = 4,
}

impl Class {
    fn from_u8(v: u8) -> Class {
        match v {
            1 => Class::LetterMark,
            2 => Class::Number,
            3 => Class::PunctSymbol,
            4 => Class::Space,
            _ => Class::Other,
        }
    }
}

/// Two-level lookup table: 4,352 blocks of 256 code points, identical blocks shared.
struct ClassTable {
    block_of: Vec<u16>,
    blocks: Vec<[u8; 256]>,
}

fn table() -> &'static ClassTable {
    static TABLE: OnceLock<ClassTable> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut flat = vec![0u8; 0x110000];
        for (k, &(start, class)) in CLASS_RANGES.iter().enumerate() {
            let end = CLASS_RANGES.get(k + 1).map_or(0x110000, |r| r.0);
            flat[start as usize..end as usize].fill(class);
        }
        let mut blocks: Vec<[u8; 256]> = Vec::new();
        let mut index: std::collections::HashMap<[u8; 256], u16> = Default::default();
        let mut block_of = Vec::with_capacity(0x1100);
        for chunk in flat.chunks_exact(256) {
            let mut b = [0u8; 256];
            b.copy_from_slice(chunk);
            let id = *index.entry(b).or_insert_with(|| {
                blocks.push(b);
                (blocks.len() - 1) as u16
            });
            block_of.push(id);
        }
        ClassTable { block_of, blocks }
    })
}

/// Classes of the ASCII characters, the common case, without touching the table.
const ASCII_CLASS: [Class; 128] = {
    let mut t = [Class::Other; 128];
    let mut i = 0;
    while i < 128 {
        let b = i as u8;
        t[i] = if b.is_ascii_alphabetic() {
            Class::LetterMark
        } else if b.is_ascii_digit() {
            Class::Number
        } else if b.is_ascii_punctuation() {
            Class::PunctSymbol
        } else if matches!(b, 9..=13 | 32) {
            Class::Space
        } else {
            Class::Other
        };
        i += 1;
    }
    t
};

#[inline]
pub(crate) fn class_of(c: char) -> Class {
    let cp = c as u32;
    if cp < 128 {
        return ASCII_CLASS[cp as usize];
    }
    let t = table();
    // Every code point is below 0x110000, so both indexes are in range.
    let block = t.block_of[(cp >> 8) as usize] as usize;
    Class::from_u8(t.blocks[block][(cp & 0xFF) as usize])
}

#[inline]
fn is_cjk(c: char) -> bool {
    matches!(c as u32, 0x4E00..=0x9FA5 | 0x3040..=0x309F | 0x30A0..=0x30FF)
}

#[inline]
fn char_at(s: &str, i: usize) -> Option<char> {
    s.get(i..).and_then(|t| t.chars().next())
}

/// Splits `text` into pre-tokens, calling `emit` for each one in order.
pub(crate) fn split(text: &str, mut emit: impl FnMut(&str)) {
    // Step 1: runs of numbers, cut every 3 characters.
    let mut seg = 0;
    let mut it = text.char_indices().peekable();
    while let Some((i, c)) = it.next() {
        if class_of(c) != Class::Number {
            continue;
        }
        if seg < i {
            split_cjk(&text[seg..i], &mut emit);
        }
        let mut end = i + c.len_utf8();
        let mut n = 1;
        while n < 3 {
            match it.peek() {
                Some(&(j, d)) if class_of(d) == Class::Number => {
                    end = j + d.len_utf8();
                    n += 1;
                    it.next();
                }
                _ => break,
            }
        }
        // A number-only piece matches nothing in steps 2 and 3: it stays whole.
        emit(&text[i..end]);
        seg = end;
    }
    if seg < text.len() {
        split_cjk(&text[seg..], &mut emit);
    }
}

/// Step 2: CJK runs are isolated from the rest.
fn split_cjk(piece: &str, emit: &mut impl FnMut(&str)) {
    let mut seg = 0;
    let mut run_start: Option<usize> = None;
    for (i, c) in piece.char_indices() {
        match (is_cjk(c), run_start) {
            (true, None) => {
                if seg < i {
                    split_main(&piece[seg..i], emit);
                }
                run_start = Some(i);
            }
            (false, Some(s)) => {
                split_main(&piece[s..i], emit);
                run_start = None;
                seg = i;
            }
            _ => {}
        }
    }
    match run_start {
        Some(s) => split_main(&piece[s..], emit),
        None if seg < piece.len() => split_main(&piece[seg..], emit),
        None => {}
    }
}

/// Step 3 over one piece: matches and the gaps between them.
fn split_main(p: &str, emit: &mut impl FnMut(&str)) {
    let n = p.len();
    let mut i = 0;
    let mut gap = 0;
    while let Some(c) = char_at(p, i) {
        match match_main(p, i, c) {
            Some(end) => {
                if gap < i {
                    emit(&p[gap..i]);
                }
                emit(&p[i..end]);
                i = end;
                gap = end;
            }
            None => i += c.len_utf8(),
        }
    }
    if gap < n {
        emit(&p[gap..n]);
    }
}

/// End of the leftmost match starting exactly at `i`, if any alternative matches there.
#[inline]
fn match_main(p: &str, i: usize, c: char) -> Option<usize> {
    let cl = c.len_utf8();
    let class = class_of(c);
    let next = char_at(p, i + cl);
    let next_class = next.map(class_of);

    // `[!-/:-@\[-`{-~][A-Za-z]+`
    if c.is_ascii_punctuation() && next.is_some_and(|d| d.is_ascii_alphabetic()) {
        let rest = &p.as_bytes()[i + 1..];
        let run = rest.iter().take_while(|b| b.is_ascii_alphabetic()).count();
        return Some(i + 1 + run);
    }
    // `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`
    if class == Class::LetterMark {
        return Some(letter_run_end(p, i));
    }
    if c != '\r'
        && c != '\n'
        && class != Class::PunctSymbol
        && next_class == Some(Class::LetterMark)
    {
        return Some(letter_run_end(p, i + cl));
    }
    // ` ?[\p{P}\p{S}]+[\r\n]*`
    if c == ' ' && next_class == Some(Class::PunctSymbol) {
        return Some(newline_run_end(p, punct_run_end(p, i + 1)));
    }
    if class == Class::PunctSymbol {
        return Some(newline_run_end(p, punct_run_end(p, i)));
    }
    if class == Class::Space {
        return Some(space_match_end(p, i));
    }
    None
}

fn letter_run_end(p: &str, from: usize) -> usize {
    run_end(p, from, |c| class_of(c) == Class::LetterMark)
}

fn punct_run_end(p: &str, from: usize) -> usize {
    run_end(p, from, |c| class_of(c) == Class::PunctSymbol)
}

fn newline_run_end(p: &str, from: usize) -> usize {
    let rest = &p.as_bytes()[from..];
    from + rest
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count()
}

#[inline]
fn run_end(p: &str, from: usize, pred: impl Fn(char) -> bool) -> usize {
    let rest = &p[from..];
    match rest.char_indices().find(|&(_, c)| !pred(c)) {
        Some((k, _)) => from + k,
        None => p.len(),
    }
}

/// `\s*[\r\n]+|\s+(?!\S)|\s+` at a white-space character.
fn space_match_end(p: &str, i: usize) -> usize {
    let mut end = i;
    let mut last_start = i;
    let mut count = 0usize;
    let mut after_newline = None;
    for (k, c) in p[i..].char_indices() {
        if class_of(c) != Class::Space {
            break;
        }
        last_start = i + k;
        end = i + k + c.len_utf8();
        count += 1;
        if c == '\r' || c == '\n' {
            after_newline = Some(end);
        }
    }
    if let Some(e) = after_newline {
        // `\s*` backtracks to the last newline of the run; `[\r\n]+` takes just it.
        return e;
    }
    if end == p.len() || count < 2 {
        // Either the lookahead sees the end of the piece, or the last alternative `\s+`.
        return end;
    }
    // `\s+(?!\S)` gives back the last white-space character.
    last_start
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(s: &str) -> Vec<String> {
        let mut v = Vec::new();
        split(s, |p| v.push(p.to_string()));
        v
    }

    #[test]
    fn basic_splits() {
        assert_eq!(pieces("Hello, world!"), ["Hello", ",", " world", "!"]);
        assert_eq!(pieces("  two  spaces"), [" ", " two", " ", " spaces"]);
        assert_eq!(pieces("12345"), ["123", "45"]);
        assert_eq!(pieces("a\n\n b"), ["a", "\n\n", " b"]);
        assert_eq!(pieces("x  "), ["x", "  "]);
        assert_eq!(pieces("ア゠イ"), ["ア", "゠", "イ"]);
        assert_eq!(pieces("'s"), ["'s"]);
        assert_eq!(pieces(">;\n"), [">;\n"]);
        assert_eq!(pieces("\u{0}\u{1}"), ["\u{0}\u{1}"]);
    }

    #[test]
    fn ascii_fast_path_agrees_with_table() {
        let t = table();
        for b in 0u32..128 {
            let slow = Class::from_u8(t.blocks[t.block_of[0] as usize][b as usize]);
            assert_eq!(class_of(char::from_u32(b).unwrap()), slow, "{b:#x}");
        }
    }

    #[test]
    fn classes() {
        assert_eq!(class_of('a'), Class::LetterMark);
        assert_eq!(class_of('\u{301}'), Class::LetterMark);
        assert_eq!(class_of('٣'), Class::Number);
        assert_eq!(class_of('€'), Class::PunctSymbol);
        assert_eq!(class_of('\u{3000}'), Class::Space);
        assert_eq!(class_of('\u{180E}'), Class::Other);
        assert_eq!(class_of('\u{10FFFF}'), Class::Other);
    }
}
