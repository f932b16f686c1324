//! Matching added tokens inside text, leftmost-longest.

const NONE: u32 = u32::MAX;

#[derive(Default)]
struct Node {
    edges: Vec<(u8, u32)>,
    token: u32,
}

/// A byte trie of token strings.
pub(crate) struct Trie {
    nodes: Vec<Node>,
    first: [bool; 256],
}

impl Trie {
    pub(crate) fn new<'a>(tokens: impl IntoIterator<Item = (&'a str, u32)>) -> Trie {
        let mut t = Trie {
            nodes: vec![Node {
                edges: Vec::new(),
                token: NONE,
            }],
            first: [false; 256],
        };
        for (s, id) in tokens {
            if s.is_empty() {
                continue;
            }
            t.first[s.as_bytes()[0] as usize] = true;
            let mut n = 0usize;
            for &b in s.as_bytes() {
                n = match t.nodes[n].edges.iter().find(|e| e.0 == b) {
                    Some(&(_, k)) => k as usize,
                    None => {
                        t.nodes.push(Node {
                            edges: Vec::new(),
                            token: NONE,
                        });
                        let k = t.nodes.len() - 1;
                        t.nodes[n].edges.push((b, k as u32));
                        k
                    }
                };
            }
            // A duplicate string keeps the later id, like a map built from the list.
            t.nodes[n].token = id;
        }
        t
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }

    /// Longest token starting at byte `i`: (end, id).
    #[inline]
    fn longest_at(&self, b: &[u8], i: usize) -> Option<(usize, u32)> {
        let mut n = 0usize;
        let mut best = None;
        for (k, &byte) in b[i..].iter().enumerate() {
            match self.nodes[n].edges.iter().find(|e| e.0 == byte) {
                Some(&(_, next)) => n = next as usize,
                None => break,
            }
            if self.nodes[n].token != NONE {
                best = Some((i + k + 1, self.nodes[n].token));
            }
        }
        best
    }

    /// Splits `text` into plain spans and tokens, in order.
    ///
    /// Scanning positions left to right and taking the longest token at the first position
    /// where any matches is exactly leftmost-longest. Token strings are valid UTF-8 and start
    /// with a lead byte, so matches always fall on character boundaries.
    pub(crate) fn split<'a>(
        &self,
        text: &'a str,
        mut on_text: impl FnMut(&'a str),
        mut on_token: impl FnMut(u32),
    ) {
        let mut start = 0;
        for (i, end, id) in self.spans(text.as_bytes()) {
            if start < i {
                on_text(&text[start..i]);
            }
            on_token(id);
            start = end;
        }
        if start < text.len() {
            on_text(&text[start..]);
        }
    }

    /// The leftmost-longest matches in `b` as (start, end, id) byte spans, in order.
    fn spans<'s>(&'s self, b: &'s [u8]) -> impl Iterator<Item = (usize, usize, u32)> + 's {
        let mut i = 0;
        std::iter::from_fn(move || {
            while i < b.len() {
                if self.first[b[i] as usize] {
                    if let Some((end, id)) = self.longest_at(b, i) {
                        let at = i;
                        i = end;
                        return Some((at, end, id));
                    }
                }
                i += 1;
            }
            None
        })
    }

    /// The tokens `split` would emit for `text`, as (start, end, id) byte spans offset by
    /// `base`, appended to `out`.
    pub(crate) fn matches(&self, text: &str, base: usize, out: &mut Vec<(usize, usize, u32)>) {
        out.extend(
            self.spans(text.as_bytes())
                .map(|(i, end, id)| (base + i, base + end, id)),
        );
    }
}
