//! The legacy llama.cpp importance-matrix file (`.dat`), as `ds4 --imatrix-out` and
//! llama.cpp's `llama-imatrix` write it:
//!
//! ```text
//! i32 n_entries
//! n_entries × { i32 name_len, name bytes, i32 ncall, i32 nval, f32 values[nval] }
//! i32 last_call, i32 dataset_name_len, dataset_name bytes      (optional trailer)
//! ```
//!
//! Values are sums of squared activations over `ncall` calls; the importance of a
//! column is `value / ncall`. For the routed experts an entry is named after the GGUF
//! stack (`blk.L.ffn_gate_exps.weight`) and holds `n_expert` consecutive per-expert
//! vectors of the input width; per-expert entries (`NAME.expert.E`) are accepted too.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

/// One entry as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub name: String,
    pub ncall: i32,
    pub values: Vec<f32>,
}

/// A whole file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Imatrix {
    pub entries: Vec<Entry>,
    /// The trailer: the chunk count and the dataset name (absent in old files).
    pub last_call: Option<i32>,
    pub dataset: Option<String>,
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn i32(&mut self, what: &str) -> Result<i32> {
        ensure!(self.0.len() >= 4, "imatrix: file ends inside {what}");
        let v = i32::from_le_bytes([self.0[0], self.0[1], self.0[2], self.0[3]]);
        self.0 = &self.0[4..];
        Ok(v)
    }
    fn bytes(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        ensure!(self.0.len() >= n, "imatrix: file ends inside {what}");
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
}

impl Imatrix {
    pub fn read(path: &Path) -> Result<Imatrix> {
        let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        Imatrix::parse(&b).with_context(|| format!("{}", path.display()))
    }

    pub fn parse(b: &[u8]) -> Result<Imatrix> {
        let mut r = Reader(b);
        let n = r.i32("the entry count")?;
        ensure!(n >= 0, "imatrix: negative entry count {n}");
        let mut entries = Vec::with_capacity(n as usize);
        for i in 0..n {
            let len = r.i32("a name length")?;
            ensure!(
                (1..=4096).contains(&len),
                "imatrix: entry {i}: name length {len}"
            );
            let name = String::from_utf8(r.bytes(len as usize, "a name")?.to_vec())
                .context("imatrix: a name is not UTF-8")?;
            let ncall = r.i32("a call count")?;
            let nval = r.i32("a value count")?;
            ensure!(nval > 0, "imatrix: {name}: {nval} values");
            let raw = r.bytes(4 * nval as usize, "values")?;
            let values: Vec<f32> = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                bail!("imatrix: {name}: non-finite value {v}");
            }
            entries.push(Entry {
                name,
                ncall,
                values,
            });
        }
        let (mut last_call, mut dataset) = (None, None);
        if !r.0.is_empty() {
            last_call = Some(r.i32("the last call")?);
            let len = r.i32("the dataset name length")?;
            ensure!(len >= 0, "imatrix: dataset name length {len}");
            let s = r.bytes(len as usize, "the dataset name")?;
            dataset = Some(String::from_utf8_lossy(s).into_owned());
        }
        ensure!(
            r.0.is_empty(),
            "imatrix: {} stray bytes at the end",
            r.0.len()
        );
        Ok(Imatrix {
            entries,
            last_call,
            dataset,
        })
    }

    /// The file bytes (what `read` parses).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&(self.entries.len() as i32).to_le_bytes());
        for e in &self.entries {
            b.extend_from_slice(&(e.name.len() as i32).to_le_bytes());
            b.extend_from_slice(e.name.as_bytes());
            b.extend_from_slice(&e.ncall.to_le_bytes());
            b.extend_from_slice(&(e.values.len() as i32).to_le_bytes());
            for v in &e.values {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        if let Some(c) = self.last_call {
            b.extend_from_slice(&c.to_le_bytes());
            let d = self.dataset.as_deref().unwrap_or("");
            b.extend_from_slice(&(d.len() as i32).to_le_bytes());
            b.extend_from_slice(d.as_bytes());
        }
        b
    }

    /// The lookup used by the quantiser.
    pub fn index(&self) -> Importance {
        let by_name = self
            .entries
            .iter()
            .map(|e| {
                let n = e.ncall.max(1) as f32;
                let v = if e.ncall > 0 {
                    e.values.iter().map(|x| x / n).collect()
                } else {
                    e.values.clone()
                };
                (e.name.clone(), v)
            })
            .collect();
        Importance { by_name }
    }
}

/// Per-column importances by entry name (values already divided by their call count).
pub struct Importance {
    by_name: HashMap<String, Vec<f32>>,
}

impl Importance {
    /// Expert `e`'s importance for the stack `gguf` (or the checkpoint name `hf`) with
    /// input width `cols` out of `n_expert`: a per-expert entry, or slice `e` of a
    /// packed one. The gate and up stacks read the same input (the FFN norm's output),
    /// so either one's entry serves the other when only one was collected. A size that
    /// fits neither is an error; a missing entry is `None`.
    pub fn expert(
        &self,
        gguf: &str,
        hf: &str,
        e: usize,
        cols: usize,
        n_expert: usize,
    ) -> Result<Option<&[f32]>> {
        if let Some(v) = self.expert_exact(gguf, hf, e, cols, n_expert)? {
            return Ok(Some(v));
        }
        let twin = if gguf.contains("ffn_gate_exps") {
            (
                gguf.replace("ffn_gate_exps", "ffn_up_exps"),
                hf.replace(".w1.", ".w3."),
            )
        } else if gguf.contains("ffn_up_exps") {
            (
                gguf.replace("ffn_up_exps", "ffn_gate_exps"),
                hf.replace(".w3.", ".w1."),
            )
        } else {
            return Ok(None);
        };
        self.expert_exact(&twin.0, &twin.1, e, cols, n_expert)
    }

    fn expert_exact(
        &self,
        gguf: &str,
        hf: &str,
        e: usize,
        cols: usize,
        n_expert: usize,
    ) -> Result<Option<&[f32]>> {
        for name in [gguf, hf] {
            for key in [format!("{name}.expert.{e}"), format!("{name}.expert_{e}")] {
                if let Some(v) = self.by_name.get(&key) {
                    ensure!(
                        v.len() == cols,
                        "imatrix {key}: {} values, expected {cols}",
                        v.len()
                    );
                    return Ok(Some(v));
                }
            }
        }
        for name in [gguf, hf] {
            if let Some(v) = self.by_name.get(name) {
                if v.len() == cols {
                    return Ok(Some(v));
                }
                ensure!(
                    v.len() == cols * n_expert,
                    "imatrix {name}: {} values, expected {cols} or {}",
                    v.len(),
                    cols * n_expert
                );
                return Ok(Some(&v[e * cols..(e + 1) * cols]));
            }
        }
        Ok(None)
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Imatrix {
        Imatrix {
            entries: vec![
                Entry {
                    name: "blk.3.ffn_gate_exps.weight".into(),
                    ncall: 4,
                    values: (0..8).map(|i| i as f32).collect(),
                },
                Entry {
                    name: "blk.3.ffn_down_exps.weight.expert.1".into(),
                    ncall: 0,
                    values: vec![1.0, 2.0],
                },
            ],
            last_call: Some(17),
            dataset: Some("rendered_prompts.txt".into()),
        }
    }

    #[test]
    fn the_legacy_layout_byte_by_byte() {
        let b = sample().to_bytes();
        // n_entries, then name_len + name of the first entry.
        assert_eq!(&b[0..4], &2i32.to_le_bytes());
        assert_eq!(&b[4..8], &26i32.to_le_bytes());
        assert_eq!(&b[8..34], b"blk.3.ffn_gate_exps.weight");
        assert_eq!(&b[34..38], &4i32.to_le_bytes()); // ncall
        assert_eq!(&b[38..42], &8i32.to_le_bytes()); // nval
        assert_eq!(&b[42..46], &0f32.to_le_bytes());
        let tail = &b[b.len() - 28..];
        assert_eq!(&tail[0..4], &17i32.to_le_bytes());
        assert_eq!(&tail[4..8], &20i32.to_le_bytes());
        assert_eq!(&tail[8..], b"rendered_prompts.txt");
        assert_eq!(Imatrix::parse(&b).unwrap(), sample());
        // Without the trailer (old files) it still reads.
        let mut old = sample();
        old.last_call = None;
        old.dataset = None;
        assert_eq!(Imatrix::parse(&old.to_bytes()).unwrap(), old);
    }

    #[test]
    fn lookup_divides_by_calls_and_slices_packed_entries() {
        let im = sample().index();
        let g = "blk.3.ffn_gate_exps.weight";
        // 8 values = 2 experts × 4 columns, divided by ncall 4.
        let v = im.expert(g, "x", 1, 4, 2).unwrap().unwrap();
        assert_eq!(v, &[1.0, 1.25, 1.5, 1.75]);
        assert!(im.expert(g, "x", 0, 3, 2).is_err());
        let d = "blk.3.ffn_down_exps.weight";
        assert_eq!(im.expert(d, "x", 1, 2, 2).unwrap().unwrap(), &[1.0, 2.0]);
        assert!(im.expert(d, "x", 0, 2, 2).unwrap().is_none());
        // Up has no entry of its own: gate's (the same input) serves it.
        let u = "blk.3.ffn_up_exps.weight";
        assert_eq!(
            im.expert(u, "x", 1, 4, 2).unwrap().unwrap(),
            &[1.0, 1.25, 1.5, 1.75]
        );
        assert!(im
            .expert("blk.4.ffn_up_exps.weight", "x", 1, 4, 2)
            .unwrap()
            .is_none());
    }

    #[test]
    fn damaged_files_are_refused() {
        let b = sample().to_bytes();
        assert!(Imatrix::parse(&b[..40]).is_err());
        let mut bad = sample();
        bad.entries[0].values[2] = f32::NAN;
        assert!(Imatrix::parse(&bad.to_bytes()).is_err());
        let mut extra = b.clone();
        extra.push(0);
        assert!(Imatrix::parse(&extra).is_err());
    }
}
