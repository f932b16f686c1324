//! Prompts with marked plain-text ranges: the defence against control-token injection.
//!
//! A rendered chat prompt mixes the template's own markup (`<｜User｜>`, `</think>`, DSML
//! tags: these must become control tokens) with text a client supplied (message content,
//! reasoning, tool results, schemas: its bytes may spell a control token but must never
//! become one). [`MarkedText`] is the prompt text plus the byte ranges of client text;
//! [`Tokenizer::encode_marked`](crate::Tokenizer::encode_marked) matches added tokens only
//! outside those ranges. BPE pre-tokenization still runs over the whole stretch of text
//! between two control tokens, across range boundaries, so a prompt whose client text
//! spells no control token encodes to exactly the ids of `Tokenizer::encode`.

use std::ops::Range;

/// Prompt text plus the sorted, disjoint, non-adjacent byte ranges of plain (client)
/// text. Everything outside the ranges is trusted template text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MarkedText {
    text: String,
    plain: Vec<Range<usize>>,
}

impl MarkedText {
    pub fn new() -> MarkedText {
        MarkedText::default()
    }

    /// Trusted text: added-token strings in it become their tokens.
    pub fn trusted(text: &str) -> MarkedText {
        MarkedText {
            text: text.to_string(),
            plain: Vec::new(),
        }
    }

    /// Builds from parts; the ranges are normalized (sorted, merged, clipped to the text
    /// and to character boundaries outward).
    pub fn from_parts(text: String, plain: Vec<Range<usize>>) -> MarkedText {
        let mut m = MarkedText {
            text,
            plain: Vec::new(),
        };
        let mut plain = plain;
        plain.sort_by_key(|r| r.start);
        for r in plain {
            let mut start = r.start.min(m.text.len());
            let mut end = r.end.min(m.text.len());
            while !m.text.is_char_boundary(start) {
                start -= 1;
            }
            while !m.text.is_char_boundary(end) {
                end += 1;
            }
            m.add_range(start..end);
        }
        m
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn plain_ranges(&self) -> &[Range<usize>] {
        &self.plain
    }

    pub fn len(&self) -> usize {
        self.text.len()
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    pub fn into_parts(self) -> (String, Vec<Range<usize>>) {
        (self.text, self.plain)
    }

    /// Appends trusted template text.
    pub fn push_str(&mut self, s: &str) {
        self.text.push_str(s);
    }

    /// Appends client text, encoded with no added-token matching.
    pub fn push_plain(&mut self, s: &str) {
        let start = self.text.len();
        self.text.push_str(s);
        self.add_range(start..self.text.len());
    }

    /// Appends another marked text, keeping its marks.
    pub fn append(&mut self, other: &MarkedText) {
        let base = self.text.len();
        self.text.push_str(&other.text);
        for r in &other.plain {
            self.add_range(base + r.start..base + r.end);
        }
    }

    /// Cuts the text to `len` bytes (a character boundary), clipping the marks.
    pub fn truncate(&mut self, len: usize) {
        self.text.truncate(len);
        self.plain = clip_ranges_to(&self.plain, len);
    }

    /// Removes `suffix` if the text ends with it; false otherwise.
    pub fn strip_suffix(&mut self, suffix: &str) -> bool {
        if !self.text.ends_with(suffix) {
            return false;
        }
        self.truncate(self.text.len() - suffix.len());
        true
    }

    fn add_range(&mut self, r: Range<usize>) {
        if r.is_empty() {
            return;
        }
        match self.plain.last_mut() {
            Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
            _ => self.plain.push(r),
        }
    }

    /// The marks of `self.text()[from..]`, relative to `from`.
    pub fn ranges_from(&self, from: usize) -> Vec<Range<usize>> {
        clip_ranges(&self.plain, from)
    }

    /// Whether `self.text()[..prefix.len()]` is `prefix` byte for byte with exactly
    /// `prefix`'s marks: the same text rendered from the same kind of parts.
    pub fn starts_with_marked(&self, prefix: &MarkedText) -> bool {
        self.text.as_bytes().starts_with(prefix.text.as_bytes())
            && clip_ranges_to(&self.plain, prefix.len()) == prefix.plain
    }
}

/// `plain` restricted to `from..` and shifted to start at 0.
pub fn clip_ranges(plain: &[Range<usize>], from: usize) -> Vec<Range<usize>> {
    plain
        .iter()
        .filter(|r| r.end > from)
        .map(|r| r.start.max(from) - from..r.end - from)
        .collect()
}

/// `plain` restricted to `..end`.
pub fn clip_ranges_to(plain: &[Range<usize>], end: usize) -> Vec<Range<usize>> {
    plain
        .iter()
        .filter(|r| r.start < end)
        .map(|r| r.start..r.end.min(end))
        .collect()
}

#[cfg(test)]
// Single ranges are the natural spelling of one marked span.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_clip() {
        let mut m = MarkedText::trusted("<a>");
        m.push_plain("xy");
        m.push_plain("z");
        m.push_str("<b>");
        m.push_plain("");
        m.push_plain("w");
        assert_eq!(m.text(), "<a>xyz<b>w");
        assert_eq!(m.plain_ranges(), &[3..6, 9..10]);
        assert_eq!(m.ranges_from(4), vec![0..2, 5..6]);
        assert_eq!(m.ranges_from(6), vec![3..4]);
        let mut n = MarkedText::trusted("p");
        n.append(&m);
        assert_eq!(n.plain_ranges(), &[4..7, 10..11]);
        let prefix = MarkedText::from_parts("<a>xy".into(), vec![3..5]);
        assert!(m.starts_with_marked(&prefix));
        assert!(!m.starts_with_marked(&MarkedText::trusted("<a>xy")));
        let mut t = m.clone();
        assert!(t.strip_suffix("<b>w"));
        assert_eq!((t.text(), t.plain_ranges()), ("<a>xyz", &[3..6][..]));
        assert!(!t.strip_suffix("q"));
        t.truncate(4);
        assert_eq!(t.plain_ranges(), &[3..4]);
        let odd = MarkedText::from_parts("a｜b".into(), vec![2..3, 0..1]);
        // 2..3 widens to the whole `｜` (1..4) and then touches 0..1.
        assert_eq!(odd.plain_ranges(), &[0..4]);
    }
}
