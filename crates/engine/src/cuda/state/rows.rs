//! The native multi-row step on the GPU (docs/architecture.md, "Multi-row steps and
//! rollback"): `R` ≤ 16 tokens at consecutive positions in one pass over the weights,
//! captured as one CUDA graph per `R`, with an undo record on the device.
//!
//! The step runs the layer code with `n = R` on a scratch of its own. Batches of at most
//! [`super::layers::SMALL_BATCH`] tokens take the matvec kernels, and the plain Q8_0
//! products read each weight block once for all the rows (`matvec_q8_0_q8_t*`), so a
//! step costs little more than one token while the routed experts dominate less.
//!
//! The undo record is O(R + frontiers), never a copy of the cache:
//! * before the layers, `rows_undo` saves each layer's ring slots of the R positions and
//!   its compressor frontiers (window state and scores, main and indexer);
//! * during the step, each compressor's kv/gate inputs go to a per-layer journal
//!   instead of the shared scratch.
//!
//! Keeping `a < R` rows restores the ring slots of rows `a..R` and the frontiers, then
//! replays the compressors over rows `0..a` from the journal — no projection, attention
//! or FFN runs again. Compressed and indexer rows past the kept positions need no undo:
//! their counts follow the position, and the next tokens rewrite them.

use std::collections::HashMap;

use ds4_cuda::{DeviceBuf, SpecRing, TokenGraph};

use super::layers::KvView;
use super::{head_rows, DeviceState, Work};
use crate::backend::MAX_ROWS;
use crate::cuda::weights::CudaWeights;
use crate::error::Result;
use crate::ops::linear::Numerics;

/// A session's multi-row step machinery, allocated on its first step.
pub(super) struct RowStep {
    work: Work,
    /// The head's collapsed rows `[MAX_ROWS][n_embd]` and the logits `[MAX_ROWS][vocab]`.
    hx: DeviceBuf<f32>,
    logits: DeviceBuf<f32>,
    /// The last kept row's logits of a step whose rows were picked on the device (a
    /// greedy cycle), copied by its commit: the session's logits, fetched when read.
    kept: DeviceBuf<f32>,
    /// Per layer, the compressors' inputs of the step's rows (`[MAX_ROWS][4·dim]`).
    _journal: Vec<DeviceBuf<f32>>,
    journal_ptrs: Vec<(u64, u64)>,
    /// The `rows_undo` items (five i64 each) and the buffers they save into.
    items: DeviceBuf<i64>,
    n_items: usize,
    _saved: Vec<DeviceBuf<f32>>,
    /// One graph per row count (index R), for one numerics; and the same ending with
    /// the rows' picks (a greedy cycle's verify, state/spec.rs).
    graphs: Vec<Option<TokenGraph>>,
    pick_graphs: Vec<Option<TokenGraph>>,
    graph_numerics: Option<Numerics>,
    /// The rewinds of rejected rows, one graph per (fast numerics, kept, rows): their
    /// ~60 launches (the undo and a compressor replay a compressed layer) ran eagerly
    /// at ~3× their ~150 µs of kernels, every rejected MTP cycle.
    undo_graphs: HashMap<(bool, usize, usize), TokenGraph>,
    /// The step awaiting `commit_rows`.
    pending: Option<Pending>,
    /// Where the last token's final HC state was before the step (for a commit of 0).
    hc_before: Option<u64>,
}

impl RowStep {
    pub(super) fn new(st: &DeviceState, w: &CudaWeights) -> Result<RowStep> {
        let g = &*w.gpu;
        let c = &w.config;
        let work = Work::new(g, c, st.ctx, MAX_ROWS, st.att_stride)?;
        let hx = g.zeros::<f32>(MAX_ROWS * c.n_embd)?;
        let logits = g.zeros::<f32>(MAX_ROWS * c.vocab)?;
        let kept = g.zeros::<f32>(c.vocab)?;
        let mut journal = Vec::new();
        let mut journal_ptrs = Vec::with_capacity(c.n_layer);
        let (main_w, index_w) = (4 * c.head_dim, 4 * c.idx_head_dim);
        for (il, l) in st.layers.iter().enumerate() {
            if !w.range.contains(&il) {
                // Another GPU's layer (a split model): nothing to journal or undo here.
                journal_ptrs.push((0, 0));
                continue;
            }
            let mut one = |has: bool, width: usize| -> Result<u64> {
                if !has {
                    return Ok(0);
                }
                let b = g.zeros::<f32>(MAX_ROWS * width)?;
                let p = g.ptr(&b);
                journal.push(b);
                Ok(p)
            };
            let main = one(l.comp.is_some(), main_w)?;
            let index = one(l.index.is_some(), index_w)?;
            journal_ptrs.push((main, index));
        }
        let mut saved = Vec::new();
        let mut items: Vec<i64> = Vec::new();
        let hd = c.head_dim;
        for l in (st.layers.iter().enumerate())
            .filter(|(il, _)| w.range.contains(il))
            .map(|(_, l)| l)
        {
            let ring_save = g.zeros::<f32>(MAX_ROWS * hd)?;
            items.extend([
                g.ptr(&l.ring) as i64,
                g.ptr(&ring_save) as i64,
                0,
                st.raw_cap as i64,
                hd as i64,
            ]);
            saved.push(ring_save);
            for b in [&l.skv, &l.ssc, &l.iskv, &l.issc].into_iter().flatten() {
                let copy = g.zeros::<f32>(b.len())?;
                items.extend([g.ptr(b) as i64, g.ptr(&copy) as i64, b.len() as i64, 0, 0]);
                saved.push(copy);
            }
        }
        let n_items = items.len() / 5;
        Ok(RowStep {
            work,
            hx,
            logits,
            kept,
            _journal: journal,
            journal_ptrs,
            items: g.upload(&items)?,
            n_items,
            _saved: saved,
            graphs: (0..=MAX_ROWS).map(|_| None).collect(),
            pick_graphs: (0..=MAX_ROWS).map(|_| None).collect(),
            graph_numerics: None,
            undo_graphs: HashMap::new(),
            pending: None,
            hc_before: None,
        })
    }
}

impl RowStep {
    /// Drops the captured graphs (a steering change: they hold the old launches).
    pub(super) fn forget_graphs(&mut self) {
        self.graphs.iter_mut().for_each(|g| *g = None);
        self.pick_graphs.iter_mut().for_each(|g| *g = None);
        self.undo_graphs.clear();
    }

    /// The captured graph of an `n`-row step (`picked`: ending with the rows' picks).
    fn graph(&mut self, n: usize, picked: bool) -> &mut Option<TokenGraph> {
        if picked {
            &mut self.pick_graphs[n]
        } else {
            &mut self.graphs[n]
        }
    }

    /// The device address of the step's records (`{position, token}` per row).
    pub(super) fn records(&self, w: &CudaWeights) -> u64 {
        w.gpu.ptr(&self.work.s.step)
    }

    /// Writes the records of `tokens` at positions `n0..` (a greedy cycle writes them
    /// before its drafts, whose picks fill in the drafted tokens).
    pub(super) fn write_records(
        &mut self,
        w: &CudaWeights,
        n0: usize,
        tokens: &[u32],
    ) -> Result<()> {
        self.work.s.write_steps(&w.gpu, n0, tokens)
    }

    /// The row the last commit of a picked step kept.
    pub(super) fn kept_logits(&self, w: &CudaWeights) -> Result<Vec<f32>> {
        Ok(w.gpu.download_f32(&self.kept, w.config.vocab)?)
    }

    /// The device address of row `r`'s final HC state in the step's scratch.
    fn hc_row(&self, w: &CudaWeights, r: usize) -> u64 {
        let c = &w.config;
        w.gpu.ptr(&self.work.s.h) + (r * c.n_hc * c.n_embd * 4) as u64
    }
}

impl DeviceState {
    /// Runs `tokens` (1..=[`MAX_ROWS`]) at positions `n_tokens..` as one multi-row
    /// step and returns every row's logits (`[rows][vocab]`); the step stays pending
    /// until [`DeviceState::commit_rows`] (or a later forward accepts it). On a device
    /// error the state is put back as it was (as far as the device still runs).
    pub fn step_rows(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        self.step_rows_stage(w, numerics, tokens, None, true)
    }

    /// The verify step of a greedy cycle (state/spec.rs): `n` rows whose records are
    /// already in the step buffer ([`RowStep::write_records`], the drafts' picks), with
    /// every row's argmax into `ring`'s row slots and nothing downloaded. Pending
    /// afterwards as after [`DeviceState::step_rows`].
    pub(super) fn step_rows_picks(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        n: usize,
        ring: &SpecRing,
    ) -> Result<()> {
        self.step_rows_with(w, numerics, Rows::Picks(n, ring), None, true)
            .map(|_| ())
    }

    /// [`DeviceState::step_rows`] as one stage of a split model (`cuda/split.rs`): the
    /// rows start from the previous stage's streams `h_in` (`[n][n_hc·n_embd]`) when
    /// given, and without `head` the step returns its rows' final streams instead of
    /// logits, for the next stage.
    pub fn step_rows_stage(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        tokens: &[u32],
        h_in: Option<&[f32]>,
        head: bool,
    ) -> Result<Vec<f32>> {
        self.step_rows_with(w, numerics, Rows::Tokens(tokens), h_in, head)
    }

    fn step_rows_with(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        rows: Rows<'_>,
        h_in: Option<&[f32]>,
        head: bool,
    ) -> Result<Vec<f32>> {
        let n = rows.n();
        debug_assert!((1..=MAX_ROWS).contains(&n));
        if self.rows.is_none() {
            self.rows = Some(RowStep::new(self, w)?);
        }
        let mut rs = self.rows.take().expect("allocated above");
        rs.pending = None;
        let result = self.run_rows(w, numerics, &mut rs, rows, h_in, head);
        if result.is_err() {
            // Back to the state before the step (the undo record was saved first).
            let g = w.gpu.launcher(self.plan);
            let step = g.ptr(&rs.work.s.step);
            let _ = g.rows_undo(g.ptr(&rs.items), rs.n_items, step, (0, n), true);
        } else {
            self.n_tokens += n;
            rs.pending = Some(Pending {
                rows: n,
                picked: matches!(rows, Rows::Picks(..)),
            });
            // The MTP draft's `HcSource::Last`: the last row's final HC state.
            rs.hc_before = self.last_hc;
            self.set_last_hc(Some(rs.hc_row(w, n - 1)));
        }
        self.rows = Some(rs);
        result
    }

    fn run_rows(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        rs: &mut RowStep,
        rows: Rows<'_>,
        h_in: Option<&[f32]>,
        head: bool,
    ) -> Result<Vec<f32>> {
        let n = rows.n();
        let g = &w.gpu.launcher(self.plan);
        let ring = match rows {
            Rows::Tokens(tokens) => {
                rs.work.s.write_steps(&w.gpu, self.n_tokens, tokens)?;
                None
            }
            Rows::Picks(_, ring) => Some(ring),
        };
        if let Some(h) = h_in {
            rs.work.s.set_streams(&w.gpu, h)?;
        }
        if self.use_graphs {
            if rs.graph_numerics != Some(numerics) {
                rs.forget_graphs();
                rs.graph_numerics = Some(numerics);
            }
            let picked = ring.is_some();
            if rs.graph(n, picked).is_none() {
                let graph = g.capture(|| self.enqueue_rows(w, numerics, rs, n, head, ring))?;
                *rs.graph(n, picked) = Some(graph);
            }
            rs.graph(n, picked)
                .as_ref()
                .expect("captured above")
                .launch()?;
        } else {
            self.enqueue_rows(w, numerics, rs, n, head, ring)?;
        }
        if ring.is_some() {
            return Ok(Vec::new());
        }
        if head {
            Ok(w.gpu.download_f32(&rs.logits, n * w.config.vocab)?)
        } else {
            rs.work.s.streams(&w.gpu, &w.config, n)
        }
    }

    /// Every launch of an `n`-row step (the step buffer holds the positions/tokens):
    /// the undo record, the layers (compressor inputs into the journal), the head of
    /// every row (unless a later stage of a split runs it: `head` false). A stage is
    /// always or never the last, so one graph per row count serves it.
    fn enqueue_rows(
        &self,
        w: &CudaWeights,
        numerics: Numerics,
        rs: &mut RowStep,
        n: usize,
        head: bool,
        picks: Option<&SpecRing>,
    ) -> Result<()> {
        let g = &w.gpu.launcher(self.plan);
        let step = g.ptr(&rs.work.s.step);
        g.rows_undo(g.ptr(&rs.items), rs.n_items, step, (0, n), false)?;
        let kv = KvView {
            journal: Some(&rs.journal_ptrs),
            ..self.kv()
        };
        kv.enqueue(w, numerics, &mut rs.work, n)?;
        if !head {
            return Ok(());
        }
        // The head of each row: the stream collapse per row, then one product of the
        // output matrix over every row (one pass over its weights).
        head_rows(g, w, numerics, &mut rs.work, (&rs.hx, &rs.logits), n)?;
        if let Some(ring) = picks {
            g.rows_pick(g.ptr(&rs.logits), w.config.vocab, n, ring)?;
        }
        Ok(())
    }

    /// Keeps the first `accepted` rows of the pending step (see the module doc); the
    /// caller checked `accepted` against [`DeviceState::pending_rows`].
    pub fn commit_rows(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        accepted: usize,
    ) -> Result<()> {
        let Some(mut rs) = self.rows.take() else {
            return Ok(());
        };
        let picked = rs.pending.is_some_and(|p| p.picked);
        let mut result = self.rewind_rows(w, numerics, &mut rs, accepted);
        if result.is_ok() && picked && accepted > 0 {
            // The session's logits: row accepted - 1, kept on the device.
            let v = w.config.vocab;
            let row = rs.logits.slice((accepted - 1) * v..accepted * v);
            result = (w.gpu.stream().memcpy_dtod(&row, &mut rs.kept))
                .map_err(|e| ds4_cuda::CudaError::from(e).into());
        }
        // On a device error the bookkeeping keeps every row; the caller reports it.
        rs.pending = None;
        self.rows = Some(rs);
        result
    }

    fn rewind_rows(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        rs: &mut RowStep,
        accepted: usize,
    ) -> Result<()> {
        let Some(Pending { rows: n, .. }) = rs.pending else {
            return Ok(());
        };
        if accepted >= n {
            return Ok(());
        }
        let g = &w.gpu.launcher(self.plan);
        let step = g.ptr(&rs.work.s.step);
        // The same launches for every rewind of `accepted` of `n` rows (positions come
        // from the step buffer), so a graph per pair serves them all.
        let undo = |rs: &RowStep| -> Result<()> {
            g.rows_undo(g.ptr(&rs.items), rs.n_items, step, (accepted, n), true)?;
            if accepted > 0 {
                let kv = KvView {
                    journal: Some(&rs.journal_ptrs),
                    ..self.kv()
                };
                kv.replay_compressors(w, numerics, &rs.work.s, accepted)?;
            }
            Ok(())
        };
        if self.use_graphs {
            let key = (numerics == Numerics::Fast, accepted, n);
            if !rs.undo_graphs.contains_key(&key) {
                let graph = g.capture(|| undo(rs))?;
                rs.undo_graphs.insert(key, graph);
            }
            rs.undo_graphs[&key].launch()?;
        } else {
            undo(rs)?;
        }
        self.n_tokens -= n - accepted;
        let last = if accepted > 0 {
            Some(rs.hc_row(w, accepted - 1))
        } else {
            // The state from before the step, unless it was a row of this scratch
            // (a previous step), which the step rewrote.
            let rows = rs.hc_row(w, 0)..rs.hc_row(w, MAX_ROWS);
            rs.hc_before.filter(|p| !rows.contains(p))
        };
        self.set_last_hc(last);
        Ok(())
    }

    /// Drops a pending step's record (every row kept).
    pub fn accept_rows(&mut self) {
        if let Some(rs) = self.rows.as_mut() {
            rs.pending = None;
        }
    }

    /// Rows of the pending step (0: none).
    pub fn pending_rows(&self) -> usize {
        self.rows
            .as_ref()
            .and_then(|r| r.pending)
            .map_or(0, |p| p.rows)
    }
}

/// A step awaiting `commit_rows`: its rows, and whether they were picked on the device
/// (the commit then keeps its last kept row's logits there).
#[derive(Clone, Copy)]
struct Pending {
    rows: usize,
    picked: bool,
}

/// A step's rows: tokens from the host, or `n` rows whose records a greedy cycle
/// already wrote, picked on the device into a ring.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Tokens(&'a [u32]),
    Picks(usize, &'a SpecRing),
}

impl Rows<'_> {
    fn n(&self) -> usize {
        match self {
            Rows::Tokens(t) => t.len(),
            Rows::Picks(n, _) => *n,
        }
    }
}
