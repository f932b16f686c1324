//! The CPU side of a multi-row step (docs/architecture.md, "Multi-row steps and
//! rollback"): the undo record that lets a step of `R` rows keep any prefix `a`.
//!
//! The record is O(R + frontier), never a copy of the cache: per layer the ring
//! position and the `min(R, window)` ring slots the step overwrites, the compressed
//! and index row counts, and the compressor frontiers as they were (only the R slots
//! the step writes, unless it closes a window); plus the step's
//! journal (the raw rows it pushed and the compressor inputs of every row). Keeping
//! `a` rows rewinds all of that and replays rows `0..a` through the ring and the
//! frontiers only — no projection, attention or FFN runs again. Compressed and index
//! rows that accepted rows closed stay (they are what one-token decode computes, the
//! chunk being bit-identical to it); the rest are truncated.

use crate::kv::{Frontier, KvCache, LayerCache, RawMark};
use crate::model::ModelInner;
use crate::ops::compressor;

/// What the forward pass records for one layer of a step.
#[derive(Clone, Debug, Default)]
pub(crate) struct LayerJournal {
    /// The stored raw rows, `[R][head_dim]`, in push order.
    pub raw: Vec<f32>,
    /// The KV compressor's inputs `(kv, gate)`, each `[R][lanes·dim]`.
    pub comp: Option<(Vec<f32>, Vec<f32>)>,
    /// The indexer compressor's inputs, likewise.
    pub index: Option<(Vec<f32>, Vec<f32>)>,
}

/// One layer's state before the step.
#[derive(Clone, Debug)]
struct LayerMark {
    raw: RawMark,
    n_comp: usize,
    n_index: usize,
    comp_state: Option<FrontierMark>,
    index_state: Option<FrontierMark>,
}

/// A compressor frontier before the step.
#[derive(Clone, Debug)]
enum FrontierMark {
    /// The step closes a window: the close pools, then clears or shifts every slot.
    Whole(Frontier),
    /// No close: the step writes only slots `first..first + R` (positions `p0..p0+R`
    /// of one window), whose old contents these are — O(R), as on most steps of a
    /// ratio-128 layer.
    Slots {
        first: usize,
        kv: Vec<f32>,
        score: Vec<f32>,
    },
}

impl FrontierMark {
    fn new(st: &Frontier, ratio: usize, p0: usize, rows: usize) -> FrontierMark {
        if closed(ratio, p0, p0 + rows) > 0 {
            return FrontierMark::Whole(st.clone());
        }
        // `compressor::step`'s slot: the current window is the second lane of an
        // overlapping (two-lane) compressor.
        let lanes = st.rows / ratio;
        let first = (lanes - 1) * ratio + p0 % ratio;
        let span = first * st.width..(first + rows) * st.width;
        FrontierMark::Slots {
            first,
            kv: st.kv[span.clone()].to_vec(),
            score: st.score[span].to_vec(),
        }
    }

    fn restore(&self, st: &mut Frontier) {
        match self {
            FrontierMark::Whole(f) => st.clone_from(f),
            FrontierMark::Slots { first, kv, score } => {
                let at = first * st.width;
                st.kv[at..at + kv.len()].copy_from_slice(kv);
                st.score[at..at + score.len()].copy_from_slice(score);
            }
        }
    }
}

/// A pending step's undo record.
#[derive(Clone, Debug)]
pub(crate) struct Undo {
    /// Positions held before the step.
    n_before: usize,
    rows: usize,
    marks: Vec<LayerMark>,
    pub journal: Vec<LayerJournal>,
}

impl Undo {
    /// Marks `cache` before a step of `rows` tokens.
    pub fn mark(cache: &KvCache, rows: usize) -> Undo {
        Undo {
            n_before: cache.n_tokens,
            rows,
            marks: cache
                .layers
                .iter()
                .map(|l| {
                    let p0 = cache.n_tokens;
                    let mark = |f: &Option<Frontier>| {
                        f.as_ref().map(|f| FrontierMark::new(f, l.ratio, p0, rows))
                    };
                    LayerMark {
                        raw: l.raw_mark(rows),
                        n_comp: l.n_comp(),
                        n_index: l.n_index(),
                        comp_state: mark(&l.comp_state),
                        index_state: mark(&l.index_state),
                    }
                })
                .collect(),
            journal: Vec::with_capacity(cache.layers.len()),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Brings `cache` (which ran the whole step) to the state after the first
    /// `accepted` rows only.
    pub fn keep(&self, m: &ModelInner, cache: &mut KvCache, accepted: usize) {
        assert!(accepted <= self.rows, "{accepted} of {} rows", self.rows);
        assert_eq!(cache.n_tokens, self.n_before + self.rows, "the step ran");
        if accepted == self.rows {
            return;
        }
        let p0 = self.n_before;
        for (il, ((l, mk), j)) in cache
            .layers
            .iter_mut()
            .zip(&self.marks)
            .zip(&self.journal)
            .enumerate()
        {
            let lw = &m.weights.layers[il];
            keep_layer(l, mk, j, p0, accepted, |index| {
                let c = if index {
                    &lw.indexer.as_ref().expect("indexer layer").compressor
                } else {
                    lw.compressor.as_ref().expect("compressed layer")
                };
                c.pool()
            });
        }
        cache.n_tokens = p0 + accepted;
    }
}

/// Windows of `ratio` closed by positions `p0..p1` (position `p` closes one when
/// `(p + 1) % ratio == 0`).
fn closed(ratio: usize, p0: usize, p1: usize) -> usize {
    p1 / ratio - p0 / ratio
}

fn keep_layer<'w>(
    l: &mut LayerCache,
    mk: &LayerMark,
    j: &LayerJournal,
    p0: usize,
    accepted: usize,
    pool: impl Fn(bool) -> compressor::Pool<'w>,
) {
    let hd = l.head_dim;
    l.raw_rewind(&mk.raw);
    for row in j.raw.chunks_exact(hd).take(accepted) {
        l.push_raw(row);
    }
    if l.ratio == 0 {
        return;
    }
    l.truncate_comp(mk.n_comp + closed(l.ratio, p0, p0 + accepted));
    replay(
        &mut l.comp_state,
        &mk.comp_state,
        &j.comp,
        pool(false),
        p0,
        accepted,
    );
    if l.index_state.is_some() {
        l.truncate_index(mk.n_index + closed(l.ratio, p0, p0 + accepted));
        replay(
            &mut l.index_state,
            &mk.index_state,
            &j.index,
            pool(true),
            p0,
            accepted,
        );
    }
}

/// Restores a frontier and feeds it the accepted rows' inputs again: the same slot
/// writes, window closes and ratio-4 lane shifts as the step made (the pooled rows
/// are dropped: the step already appended them).
fn replay(
    st: &mut Option<Frontier>,
    before: &Option<FrontierMark>,
    inputs: &Option<(Vec<f32>, Vec<f32>)>,
    pool: compressor::Pool<'_>,
    p0: usize,
    accepted: usize,
) {
    let (Some(st), Some(before), Some((kv, score))) = (st.as_mut(), before, inputs) else {
        panic!("a compressed layer has a frontier and journaled inputs");
    };
    before.restore(st);
    let w = pool.lanes * pool.dim;
    for t in 0..accepted {
        let _ = compressor::step(
            st,
            pool,
            &kv[t * w..(t + 1) * w],
            &score[t * w..(t + 1) * w],
            p0 + t,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::closed;

    #[test]
    fn closed_counts_window_ends() {
        assert_eq!(closed(4, 0, 3), 0);
        assert_eq!(closed(4, 0, 4), 1);
        assert_eq!(closed(4, 3, 4), 1);
        assert_eq!(closed(4, 4, 8), 1);
        assert_eq!(closed(4, 2, 11), 2);
        assert_eq!(closed(128, 120, 136), 1);
        assert_eq!(closed(128, 128, 136), 0);
    }
}
