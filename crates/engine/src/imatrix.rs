//! Importance-matrix (imatrix) collection over the routed experts, and the legacy
//! llama.cpp `.dat` file it is written to (issue 24, part 3).
//!
//! What is collected follows the reference (`ds4.c`, "Imatrix Collection"): for each
//! layer and routed expert, the mean over the (token, expert) routes of the squared
//! inputs of that expert's matrices — the FFN-normalised row `x` for `ffn_gate_exps`
//! and `ffn_up_exps` (one vector serves both), the route-weighted SwiGLU row `mid` for
//! `ffn_down_exps`. The forward pass hands each layer's batch to a [`MoeObserver`]
//! ([`crate::Session::prefill_observed`]); it does not change the math.
//!
//! File layout (little-endian): `i32 n_entries`; per entry `i32 name_len`, the name,
//! `i32 ncall`, `i32 nval`, `f32[nval]`; then `i32 last_call`, `i32 len` and the
//! dataset file name. As in the reference, each routed tensor is one entry of
//! `n_expert × n_cols` values (expert-major: expert e's columns at `e·n_cols..`),
//! `ncall` is 1 and the values are already means (an expert never routed gets 1.0 in
//! every column), `last_call` counts the (layer, batch) observations.

use std::io::{self, Read, Write};

use crate::config::Config;

/// One layer's routed-expert inputs for a batch of tokens, as the forward pass holds
/// them right before the expert products.
pub struct MoeActivations<'a> {
    /// Layer index.
    pub layer: usize,
    /// Tokens in the batch.
    pub n_tokens: usize,
    /// The FFN-normalised input rows, `[n_tokens][n_embd]`: the gate/up input.
    pub x: &'a [f32],
    /// The selected experts of each token, `[n_tokens][n_expert_used]`.
    pub experts: &'a [u32],
    /// The route-weighted SwiGLU rows, `[n_tokens][n_expert_used][n_ff_exp]`, in the
    /// order of `experts`: the down projection's input.
    pub mid: &'a [f32],
}

/// Receives every layer's [`MoeActivations`] of an observed forward pass.
pub trait MoeObserver: Send {
    fn observe(&mut self, a: &MoeActivations);
}

/// Accumulates the reference's routed-expert statistics (sums of squares and route
/// counts per layer and expert) in f32, as the reference does.
pub struct ImatrixCollector {
    n_layer: usize,
    n_expert: usize,
    n_embd: usize,
    n_ff: usize,
    k: usize,
    /// `[layer][expert][n_embd]`.
    gate_up: Vec<f32>,
    /// `[layer][expert][n_ff]`.
    down: Vec<f32>,
    /// Routes per `[layer][expert]` (gate/up and down see the same routes).
    counts: Vec<u32>,
    /// (layer, batch) observations: the file's `last_call`.
    calls: u32,
    routes: u64,
}

impl ImatrixCollector {
    pub fn new(cfg: &Config) -> ImatrixCollector {
        let (l, x) = (cfg.n_layer, cfg.n_expert);
        ImatrixCollector {
            n_layer: l,
            n_expert: x,
            n_embd: cfg.n_embd,
            n_ff: cfg.n_ff_exp,
            k: cfg.n_expert_used,
            gate_up: vec![0.0; l * x * cfg.n_embd],
            down: vec![0.0; l * x * cfg.n_ff_exp],
            counts: vec![0; l * x],
            calls: 0,
            routes: 0,
        }
    }

    /// (token, expert) routes seen, over all layers.
    pub fn routes(&self) -> u64 {
        self.routes
    }

    /// The `.dat` contents: three entries per layer (gate, up, down), `dataset` as the
    /// trailer's file name.
    pub fn to_imatrix(&self, dataset: &str) -> Imatrix {
        let mut entries = Vec::with_capacity(self.n_layer * 3);
        for il in 0..self.n_layer {
            let counts = &self.counts[il * self.n_expert..(il + 1) * self.n_expert];
            let gu = self.means(&self.gate_up, il, self.n_embd, counts);
            let down = self.means(&self.down, il, self.n_ff, counts);
            for (kind, values) in [("gate", gu.clone()), ("up", gu), ("down", down)] {
                entries.push(ImatrixEntry {
                    name: format!("blk.{il}.ffn_{kind}_exps.weight"),
                    ncall: 1,
                    values,
                });
            }
        }
        Imatrix {
            entries,
            last_call: self.calls as i32,
            dataset: dataset.to_string(),
        }
    }

    fn means(&self, sums: &[f32], il: usize, cols: usize, counts: &[u32]) -> Vec<f32> {
        let base = il * self.n_expert * cols;
        let mut out = Vec::with_capacity(self.n_expert * cols);
        for (ex, &c) in counts.iter().enumerate() {
            let s = &sums[base + ex * cols..base + (ex + 1) * cols];
            if c == 0 {
                out.extend(std::iter::repeat_n(1.0f32, cols));
            } else {
                let inv = 1.0 / c as f32;
                out.extend(s.iter().map(|v| v * inv));
            }
        }
        out
    }
}

impl MoeObserver for ImatrixCollector {
    fn observe(&mut self, a: &MoeActivations) {
        let (e, ff, k) = (self.n_embd, self.n_ff, self.k);
        assert_eq!(a.x.len(), a.n_tokens * e, "imatrix: x rows");
        assert_eq!(a.experts.len(), a.n_tokens * k, "imatrix: expert ids");
        assert_eq!(a.mid.len(), a.n_tokens * k * ff, "imatrix: mid rows");
        let mut sq = vec![0.0f32; e];
        for t in 0..a.n_tokens {
            for (s, &v) in sq.iter_mut().zip(&a.x[t * e..(t + 1) * e]) {
                *s = v * v;
            }
            for j in 0..k {
                let ex = a.experts[t * k + j] as usize;
                if ex >= self.n_expert {
                    continue;
                }
                let slot = a.layer * self.n_expert + ex;
                for (g, &s) in self.gate_up[slot * e..(slot + 1) * e].iter_mut().zip(&sq) {
                    *g += s;
                }
                let m = &a.mid[(t * k + j) * ff..(t * k + j + 1) * ff];
                for (d, &v) in self.down[slot * ff..(slot + 1) * ff].iter_mut().zip(m) {
                    *d += v * v;
                }
                self.counts[slot] += 1;
                self.routes += 1;
            }
        }
        self.calls += 1;
    }
}

/// One tensor's importance vector.
#[derive(Clone, Debug, PartialEq)]
pub struct ImatrixEntry {
    pub name: String,
    pub ncall: i32,
    pub values: Vec<f32>,
}

/// A legacy llama.cpp `.dat` imatrix (module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Imatrix {
    pub entries: Vec<ImatrixEntry>,
    pub last_call: i32,
    /// The dataset file name of the trailer.
    pub dataset: String,
}

/// Names and value counts above these are refused as corrupt, not allocated.
const MAX_NAME: usize = 4096;
const MAX_VALUES: usize = 1 << 28;

impl Imatrix {
    pub fn get(&self, name: &str) -> Option<&ImatrixEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let i32_of = |n: usize, what: &str| {
            i32::try_from(n)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{what} {n}")))
        };
        w.write_all(&i32_of(self.entries.len(), "entries")?.to_le_bytes())?;
        for e in &self.entries {
            w.write_all(&i32_of(e.name.len(), "name length")?.to_le_bytes())?;
            w.write_all(e.name.as_bytes())?;
            w.write_all(&e.ncall.to_le_bytes())?;
            w.write_all(&i32_of(e.values.len(), "values")?.to_le_bytes())?;
            let mut buf = Vec::with_capacity(e.values.len() * 4);
            for v in &e.values {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            w.write_all(&buf)?;
        }
        w.write_all(&self.last_call.to_le_bytes())?;
        w.write_all(&i32_of(self.dataset.len(), "dataset name length")?.to_le_bytes())?;
        w.write_all(self.dataset.as_bytes())
    }

    /// Reads a `.dat` file. The trailer (`last_call` and the dataset name) is optional,
    /// as in llama.cpp's reader (old files end after the entries); anything after it
    /// is an error.
    pub fn read_from(r: &mut impl Read) -> io::Result<Imatrix> {
        let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
        let n = read_len(r, "entry count", usize::MAX)?;
        let mut entries = Vec::new();
        for i in 0..n {
            let len = read_len(r, "name length", MAX_NAME)?;
            let mut name = vec![0u8; len];
            r.read_exact(&mut name)?;
            let name =
                String::from_utf8(name).map_err(|_| bad(format!("entry {i}: name not UTF-8")))?;
            let ncall = read_i32(r)?;
            let nval = read_len(r, "value count", MAX_VALUES)?;
            let mut raw = vec![0u8; nval * 4];
            r.read_exact(&mut raw)
                .map_err(|e| bad(format!("entry {i} ({name}): {e}")))?;
            let values = raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            entries.push(ImatrixEntry {
                name,
                ncall,
                values,
            });
        }
        let mut rest = Vec::new();
        r.read_to_end(&mut rest)?;
        if rest.is_empty() {
            return Ok(Imatrix {
                entries,
                last_call: 0,
                dataset: String::new(),
            });
        }
        let mut cur = rest.as_slice();
        let last_call = read_i32(&mut cur)?;
        let len = read_len(&mut cur, "dataset name length", MAX_NAME)?;
        if cur.len() != len {
            return Err(bad(format!(
                "trailer: dataset name of {len} bytes, {} present",
                cur.len()
            )));
        }
        let dataset =
            String::from_utf8(cur.to_vec()).map_err(|_| bad("dataset name not UTF-8".into()))?;
        Ok(Imatrix {
            entries,
            last_call,
            dataset,
        })
    }
}

fn read_i32(r: &mut impl Read) -> io::Result<i32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(i32::from_le_bytes(b))
}

fn read_len(r: &mut impl Read, what: &str, max: usize) -> io::Result<usize> {
    let v = read_i32(r)?;
    match usize::try_from(v) {
        Ok(n) if n <= max => Ok(n),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{what} {v} out of range"),
        )),
    }
}

/// The line that starts each prompt of a reference imatrix dataset
/// (`gguf-tools/imatrix/dataset/rendered_prompts.txt`); the rest of the line is a label.
pub const PROMPT_MARKER: &str = "===== DS4_IMATRIX_PROMPT";

/// Splits a dataset into its prompts as the reference does: each prompt is the text
/// after a marker line up to the next marker, trimmed; text before the first marker
/// is ignored; a file without markers is one prompt; empty prompts are skipped.
/// Prompts are rendered chats (special markers are tokens).
pub fn split_dataset(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut cursor = 0;
    let mut first = true;
    while cursor < text.len() {
        let mut start = cursor;
        match text[cursor..].find(PROMPT_MARKER) {
            Some(m) => match text[cursor + m..].find('\n') {
                Some(nl) => start = cursor + m + nl + 1,
                None => break,
            },
            None if !first => break,
            None => {}
        }
        first = false;
        let next = text[start..].find(PROMPT_MARKER).map(|i| start + i);
        let p = text[start..next.unwrap_or(text.len())].trim();
        if !p.is_empty() {
            out.push(p);
        }
        match next {
            Some(n) => cursor = n,
            None => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_follows_the_reference() {
        let t = "preamble\n===== DS4_IMATRIX_PROMPT 1 =====\n a \n\n===== DS4_IMATRIX_PROMPT 2\n\n===== DS4_IMATRIX_PROMPT 3\nb\nc\n";
        assert_eq!(split_dataset(t), vec!["a", "b\nc"]);
        assert_eq!(
            split_dataset("  just one\nprompt \n"),
            vec!["just one\nprompt"]
        );
        assert!(split_dataset(" \n\t").is_empty());
        // A marker with no line end has no prompt.
        assert!(split_dataset("===== DS4_IMATRIX_PROMPT").is_empty());
    }

    #[test]
    fn dat_round_trips_and_rejects_corruption() {
        let m = Imatrix {
            entries: vec![
                ImatrixEntry {
                    name: "blk.0.ffn_gate_exps.weight".into(),
                    ncall: 1,
                    values: vec![0.5, 1.0, f32::MIN_POSITIVE, 3.25],
                },
                ImatrixEntry {
                    name: "x".into(),
                    ncall: 7,
                    values: vec![],
                },
            ],
            last_call: 42,
            dataset: "data/prompts.txt".into(),
        };
        let mut buf = Vec::new();
        m.write_to(&mut buf).unwrap();
        // 4 + (4+26+4+4+16) + (4+1+4+4) + 4 + 4 + 16
        assert_eq!(buf.len(), 4 + 54 + 13 + 8 + 16);
        assert_eq!(&buf[..4], &2i32.to_le_bytes());
        assert_eq!(Imatrix::read_from(&mut buf.as_slice()).unwrap(), m);
        // Without the trailer (old files).
        let short = &buf[..4 + 54 + 13];
        let r = Imatrix::read_from(&mut &short[..]).unwrap();
        assert_eq!((r.entries, r.last_call), (m.entries.clone(), 0));
        // Truncated values, a negative length, trailing garbage.
        assert!(Imatrix::read_from(&mut &buf[..40]).is_err());
        let mut neg = buf.clone();
        neg[4..8].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(Imatrix::read_from(&mut neg.as_slice()).is_err());
        let mut extra = buf.clone();
        extra.push(0);
        assert!(Imatrix::read_from(&mut extra.as_slice()).is_err());
    }

    #[test]
    fn collector_means_and_unrouted_experts() {
        let cfg = Config::tiny(1);
        let (e, ff, k) = (cfg.n_embd, cfg.n_ff_exp, cfg.n_expert_used);
        let mut c = ImatrixCollector::new(&cfg);
        let x: Vec<f32> = (0..2 * e).map(|i| i as f32 * 0.01).collect();
        // Both tokens route to experts 0..k; token 1 also differs in its mid.
        let experts: Vec<u32> = (0..2).flat_map(|_| 0..k as u32).collect();
        let mid: Vec<f32> = (0..2 * k * ff).map(|i| (i % 7) as f32).collect();
        c.observe(&MoeActivations {
            layer: 0,
            n_tokens: 2,
            x: &x,
            experts: &experts,
            mid: &mid,
        });
        let m = c.to_imatrix("d");
        assert_eq!(m.entries.len(), 3);
        assert_eq!(m.last_call, 1);
        let gate = &m.entries[0];
        assert_eq!(gate.values, m.entries[1].values);
        assert_eq!(gate.values.len(), cfg.n_expert * e);
        for col in 0..e {
            let want = (x[col] * x[col] + x[e + col] * x[e + col]) / 2.0;
            assert!((gate.values[col] - want).abs() <= 1e-6 * want.max(1.0));
        }
        let down = &m.entries[2];
        let j = 1;
        for col in 0..ff {
            let a = mid[j * ff + col];
            let b = mid[(k + j) * ff + col];
            assert_eq!(down.values[j * ff + col], (a * a + b * b) / 2.0);
        }
        // Experts never routed: 1.0.
        assert!(gate.values[k * e..].iter().all(|&v| v == 1.0));
        assert!(down.values[k * ff..].iter().all(|&v| v == 1.0));
        assert_eq!(c.routes(), 2 * k as u64);
    }
}
