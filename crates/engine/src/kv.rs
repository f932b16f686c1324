//! The per-session cache of the CPU backend: raw sliding window, compressed rows,
//! index rows and the compressors' frontier state, per layer. It is also the host
//! form of a session state that every backend exports for payloads and snapshots.

use crate::config::Config;

/// The "empty" score of a frontier slot: finite, like ds4's `NEG_INF`, so that
/// payloads contain no infinities. Pooling treats `≤ −5e29` as masked.
pub const NEG_INF: f32 = -1e30;

/// A compressor's window state: `rows = lanes·ratio` slots of `width = lanes·dim`.
#[derive(Clone, Debug, PartialEq)]
pub struct Frontier {
    pub rows: usize,
    pub width: usize,
    pub kv: Vec<f32>,
    pub score: Vec<f32>,
}

impl Frontier {
    pub fn new(ratio: usize, lanes: usize, dim: usize) -> Frontier {
        let rows = lanes * ratio;
        let width = lanes * dim;
        Frontier {
            rows,
            width,
            kv: vec![0.0; rows * width],
            score: vec![NEG_INF; rows * width],
        }
    }

    /// Empties slots `r0..r1`.
    pub fn clear_rows(&mut self, r0: usize, r1: usize) {
        self.kv[r0 * self.width..r1 * self.width].fill(0.0);
        self.score[r0 * self.width..r1 * self.width].fill(NEG_INF);
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerCache {
    pub ratio: usize,
    pub head_dim: usize,
    pub idx_dim: usize,
    /// Capacity of the raw ring: min(window, ctx).
    pub raw_cap: usize,
    raw: Vec<f32>,
    /// Ring slot of the oldest row.
    raw_start: usize,
    raw_len: usize,
    /// Compressed rows, `[n_comp][head_dim]`.
    pub comp: Vec<f32>,
    pub comp_state: Option<Frontier>,
    /// Index rows (ratio-4 layers), `[n_index][idx_dim]`.
    pub index: Vec<f32>,
    pub index_state: Option<Frontier>,
}

impl LayerCache {
    pub fn new(cfg: &Config, il: usize, ctx: usize) -> LayerCache {
        let ratio = cfg.compress_ratios[il];
        let raw_cap = cfg.window.min(ctx).max(1);
        let lanes = Config::compressor_lanes(ratio);
        LayerCache {
            ratio,
            head_dim: cfg.head_dim,
            idx_dim: cfg.idx_head_dim,
            raw_cap,
            raw: vec![0.0; raw_cap * cfg.head_dim],
            raw_start: 0,
            raw_len: 0,
            comp: Vec::new(),
            comp_state: (ratio != 0).then(|| Frontier::new(ratio, lanes, cfg.head_dim)),
            index: Vec::new(),
            index_state: cfg
                .has_indexer(il)
                .then(|| Frontier::new(ratio, lanes, cfg.idx_head_dim)),
        }
    }

    /// Appends a raw row, dropping the oldest when the ring is full.
    pub fn push_raw(&mut self, row: &[f32]) {
        let hd = self.head_dim;
        let slot = if self.raw_len < self.raw_cap {
            self.raw_len += 1;
            (self.raw_start + self.raw_len - 1) % self.raw_cap
        } else {
            let s = self.raw_start;
            self.raw_start = (self.raw_start + 1) % self.raw_cap;
            s
        };
        self.raw[slot * hd..(slot + 1) * hd].copy_from_slice(row);
    }

    pub fn n_raw(&self) -> usize {
        self.raw_len
    }

    /// Raw row `i` in logical order (0 = oldest).
    pub fn raw_row(&self, i: usize) -> &[f32] {
        let hd = self.head_dim;
        let slot = (self.raw_start + i) % self.raw_cap;
        &self.raw[slot * hd..(slot + 1) * hd]
    }

    pub fn n_comp(&self) -> usize {
        self.comp.len() / self.head_dim
    }

    pub fn comp_row(&self, i: usize) -> &[f32] {
        &self.comp[i * self.head_dim..(i + 1) * self.head_dim]
    }

    pub fn n_index(&self) -> usize {
        self.index.len() / self.idx_dim
    }

    /// Replaces the raw window with `rows` (logical order, oldest first).
    pub fn set_raw(&mut self, rows: &[f32]) {
        let n = rows.len() / self.head_dim;
        assert!(n <= self.raw_cap);
        self.raw.fill(0.0);
        self.raw[..rows.len()].copy_from_slice(rows);
        self.raw_start = 0;
        self.raw_len = n;
    }

    /// The raw window in logical order.
    pub fn raw_rows(&self) -> Vec<f32> {
        (0..self.raw_len)
            .flat_map(|i| self.raw_row(i).iter().copied())
            .collect()
    }

    /// What [`LayerCache::raw_rewind`] needs to undo the next `n` pushes: the ring's
    /// position and the slots those pushes overwrite (push `k` writes slot
    /// `(start + len + k) % cap`, whether the ring is full or not), `min(n, cap)` rows.
    pub fn raw_mark(&self, n: usize) -> RawMark {
        let hd = self.head_dim;
        let first = self.raw_start + self.raw_len;
        let slots = (0..n.min(self.raw_cap))
            .flat_map(|k| {
                let s = (first + k) % self.raw_cap;
                self.raw[s * hd..(s + 1) * hd].iter().copied()
            })
            .collect();
        RawMark {
            start: self.raw_start,
            len: self.raw_len,
            slots,
        }
    }

    /// Puts the ring back where [`LayerCache::raw_mark`] found it: every slot written
    /// since holds its old row again.
    pub fn raw_rewind(&mut self, m: &RawMark) {
        let hd = self.head_dim;
        let first = m.start + m.len;
        for (k, row) in m.slots.chunks_exact(hd).enumerate() {
            let s = (first + k) % self.raw_cap;
            self.raw[s * hd..(s + 1) * hd].copy_from_slice(row);
        }
        self.raw_start = m.start;
        self.raw_len = m.len;
    }

    /// Keeps the first `n` compressed rows.
    pub fn truncate_comp(&mut self, n: usize) {
        self.comp.truncate(n * self.head_dim);
    }

    /// Keeps the first `n` index rows.
    pub fn truncate_index(&mut self, n: usize) {
        self.index.truncate(n * self.idx_dim);
    }
}

/// The raw ring before a multi-row step ([`LayerCache::raw_mark`]): O(rows), not
/// O(window).
#[derive(Clone, Debug)]
pub struct RawMark {
    start: usize,
    len: usize,
    slots: Vec<f32>,
}

/// Everything a session must keep to continue: the cache of every layer and the
/// number of positions it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct KvCache {
    pub ctx: usize,
    pub n_tokens: usize,
    pub layers: Vec<LayerCache>,
}

impl KvCache {
    pub fn new(cfg: &Config, ctx: usize) -> KvCache {
        KvCache {
            ctx,
            n_tokens: 0,
            layers: (0..cfg.n_layer)
                .map(|il| LayerCache::new(cfg, il, ctx))
                .collect(),
        }
    }

    /// Bytes held (rows and frontiers, as f32).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                4 * (l.raw.len()
                    + l.comp.len()
                    + l.index.len()
                    + l.comp_state.as_ref().map_or(0, |f| 2 * f.kv.len())
                    + l.index_state.as_ref().map_or(0, |f| 2 * f.kv.len()))
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_ring_keeps_newest_in_order() {
        let cfg = Config::tiny(1);
        let mut l = LayerCache::new(&cfg, 0, 4096);
        let hd = cfg.head_dim;
        for t in 0..(cfg.window + 5) {
            l.push_raw(&vec![t as f32; hd]);
        }
        assert_eq!(l.n_raw(), cfg.window);
        for i in 0..cfg.window {
            assert_eq!(l.raw_row(i)[0], (i + 5) as f32);
        }
        let rows = l.raw_rows();
        let mut m = LayerCache::new(&cfg, 0, 4096);
        m.set_raw(&rows);
        for i in 0..cfg.window {
            assert_eq!(m.raw_row(i), l.raw_row(i));
        }
    }

    #[test]
    fn raw_rewind_undoes_pushes_across_the_wrap() {
        let cfg = Config::tiny(1);
        let hd = cfg.head_dim;
        // Before the ring fills, exactly full, and wrapped; pushes up to twice the ring.
        for before in [0, 3, cfg.window - 2, cfg.window, cfg.window + 5] {
            for n in [1, 2, 5, cfg.window, cfg.window + 3] {
                let mut l = LayerCache::new(&cfg, 0, 4096);
                for t in 0..before {
                    l.push_raw(&vec![t as f32; hd]);
                }
                let want = l.clone();
                let m = l.raw_mark(n);
                for t in 0..n {
                    l.push_raw(&vec![-1.0 - t as f32; hd]);
                }
                assert_ne!(l, want);
                l.raw_rewind(&m);
                assert_eq!(l, want, "{before} rows, {n} pushes");
            }
        }
    }

    #[test]
    fn small_context_caps_the_ring() {
        let cfg = Config::tiny(1);
        let l = LayerCache::new(&cfg, 0, 5);
        assert_eq!(l.raw_cap, 5);
    }
}
