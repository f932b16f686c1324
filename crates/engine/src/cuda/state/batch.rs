//! The batched decode step over several sessions (issue #21; docs/architecture.md §2,
//! "batched decode"): one token for each of `B` ≤ [`MAX_ROWS`] sessions in one pass over
//! the weights, each row at its own position against its own KV state.
//!
//! The step is the multi-row step's layer code (`KvView::enqueue` with `n = B`: the dense
//! and expert products read each weight once for every row) with one difference: the
//! launches that touch KV state — the ring write (`kv_finish`), the compressors, the
//! indexer scores and the attention — take a **KV table** instead of one session's
//! addresses. Row `t` of a layer's table holds the addresses of row `t`'s session's
//! ring, compressor frontiers, compressed and index rows, and its ring capacity
//! (`ds4_cuda::kvt`); every other launch (projections, norms, hyper-connections,
//! routing, experts, head) is per token already.
//!
//! The table lives in device memory and the captured graph (one per `B`) reads it, so
//! the graph serves any set of sessions: a step only rewrites the table when its
//! sessions changed (and the step records: each row's position and token).
//!
//! Every row commits (no undo record: a batched step is a decode step, not a
//! speculative one). After the step each session's decode scratch gets its row's final
//! hyper-connection streams, so a later MTP draft (`HcSource::Last`) reads its own.

use ds4_cuda::{kvt, CudaError, DecodePlan, DeviceBuf, TokenGraph};

use super::layers::KvView;
use super::{head_rows, DeviceState, Work};
use crate::backend::MAX_ROWS;
use crate::cuda::weights::CudaWeights;
use crate::error::{EngineError, Result};
use crate::ops::linear::Numerics;

/// The buffers and graphs of batched steps, shared by every session of one weight
/// upload (they hold no session's data between steps). Allocated on the first step.
pub(crate) struct BatchStep {
    /// The sessions' shape it was built for: context and attention rows per token.
    ctx: usize,
    att_stride: usize,
    work: Work,
    /// The head's collapsed rows `[MAX_ROWS][n_embd]` and the logits `[MAX_ROWS][vocab]`.
    hx: DeviceBuf<f32>,
    logits: DeviceBuf<f32>,
    /// The KV tables `[n_layer][MAX_ROWS][kvt::STRIDE]` and the host copy of what they
    /// hold (rewritten only when the step's sessions change).
    table: DeviceBuf<i64>,
    table_host: Vec<i64>,
    /// One graph per row count (index B), for one numerics and plan.
    graphs: Vec<Option<TokenGraph>>,
    graph_key: Option<(Numerics, DecodePlan)>,
}

impl BatchStep {
    fn new(w: &CudaWeights, ctx: usize, att_stride: usize) -> Result<BatchStep> {
        let g = &*w.gpu;
        let c = &w.config;
        let n = c.n_layer * MAX_ROWS * kvt::STRIDE;
        Ok(BatchStep {
            ctx,
            att_stride,
            work: Work::new(g, c, ctx, MAX_ROWS, att_stride)?,
            hx: g.zeros::<f32>(MAX_ROWS * c.n_embd)?,
            logits: g.zeros::<f32>(MAX_ROWS * c.vocab)?,
            table: g.zeros::<i64>(n)?,
            table_host: vec![0; n],
            graphs: (0..=MAX_ROWS).map(|_| None).collect(),
            graph_key: None,
        })
    }
}

/// Why `states` cannot share one batched step (then the caller decodes them one by
/// one), or `None` when they can.
pub(crate) fn unbatchable(w: &CudaWeights, states: &[&DeviceState]) -> Option<String> {
    let first = states.first()?;
    if !(2..=MAX_ROWS).contains(&states.len()) {
        return Some(format!("{} rows (2..={MAX_ROWS} batch)", states.len()));
    }
    if w.range != (0..w.config.n_layer) {
        return Some("a model split over GPUs".into());
    }
    for s in states {
        if s.ctx != first.ctx || s.att_stride != first.att_stride || s.plan != first.plan {
            return Some("sessions of different contexts or decode plans".into());
        }
        if s.steer.is_some() {
            return Some("a steered session".into());
        }
        if s.n_tokens >= s.ctx {
            return Some("a full context".into());
        }
        if s.pending_rows() > 0 {
            return Some("a pending multi-row step".into());
        }
    }
    None
}

impl DeviceState {
    /// This session's row of layer `il`'s KV table (`ds4_cuda::kvt`).
    fn kv_table_row(&self, w: &CudaWeights, il: usize) -> [i64; kvt::STRIDE] {
        let g = &w.gpu;
        let l = &self.layers[il];
        let p = |b: &Option<DeviceBuf<f32>>| b.as_ref().map_or(0, |b| g.ptr(b) as i64);
        let mut row = [0i64; kvt::STRIDE];
        row[kvt::RING] = g.ptr(&l.ring) as i64;
        row[kvt::SKV] = p(&l.skv);
        row[kvt::SSC] = p(&l.ssc);
        row[kvt::COMP] = p(&l.comp);
        row[kvt::ISKV] = p(&l.iskv);
        row[kvt::ISSC] = p(&l.issc);
        row[kvt::INDEX] = p(&l.index);
        row[kvt::RAW_CAP] = self.raw_cap as i64;
        row
    }
}

/// One decode token for each of `states` (`tokens[i]` at `states[i]`'s next position)
/// in one pass over the weights; returns each row's logits (`[vocab]`). The caller
/// checked [`unbatchable`], the tokens and the room. On a device error no state
/// advances (their KV may hold the step's rows past their positions, which later
/// tokens overwrite).
pub(crate) fn decode_batch(
    w: &CudaWeights,
    numerics: Numerics,
    states: &mut [&mut DeviceState],
    tokens: &[u32],
) -> Result<Vec<Vec<f32>>> {
    let b = states.len();
    if tokens.len() != b {
        return Err(EngineError::Invalid(format!(
            "a batched step of {b} sessions got {} tokens",
            tokens.len()
        )));
    }
    {
        let view: Vec<&DeviceState> = states.iter().map(|s| &**s).collect();
        if let Some(why) = unbatchable(w, &view) {
            return Err(EngineError::Invalid(format!("cannot batch: {why}")));
        }
    }
    let mut slot = w.batch_step();
    let (ctx, att_stride) = (states[0].ctx, states[0].att_stride);
    if !matches!(&*slot, Some(bs) if bs.ctx == ctx && bs.att_stride == att_stride) {
        *slot = None; // free the old buffers first
        *slot = Some(BatchStep::new(w, ctx, att_stride)?);
    }
    let bs = slot.as_mut().expect("allocated above");
    let g = &w.gpu;
    let c = &w.config;

    // The KV tables: rewritten when the sessions (or their order) changed.
    let mut table = vec![0i64; bs.table_host.len()];
    for il in 0..c.n_layer {
        for (r, s) in states.iter().enumerate() {
            let at = (il * MAX_ROWS + r) * kvt::STRIDE;
            table[at..at + kvt::STRIDE].copy_from_slice(&s.kv_table_row(w, il));
        }
    }
    if table != bs.table_host {
        g.stream()
            .memcpy_htod(&table, &mut bs.table)
            .map_err(CudaError::from)?;
        bs.table_host = table;
    }
    let rows = states
        .iter()
        .map(|s| s.n_tokens)
        .zip(tokens.iter().copied());
    bs.work.s.write_rows(g, rows)?;

    let plan = states[0].plan;
    let kv = KvView {
        journal: None,
        steer: None,
        kvt: g.ptr(&bs.table),
        ..states[0].kv()
    };
    let l = &g.launcher(plan);
    if states[0].use_graphs {
        if bs.graph_key != Some((numerics, plan)) {
            bs.graphs.iter_mut().for_each(|g| *g = None);
            bs.graph_key = Some((numerics, plan));
        }
        if bs.graphs[b].is_none() {
            bs.graphs[b] = Some(l.capture(|| enqueue(w, numerics, &kv, bs, b))?);
        }
        bs.graphs[b].as_ref().expect("captured above").launch()?;
    } else {
        enqueue(w, numerics, &kv, bs, b)?;
    }
    let all = g.download_f32(&bs.logits, b * c.vocab)?;

    // Each session's decode scratch takes its row's final streams (`HcSource::Last`).
    let row = c.n_hc * c.n_embd;
    for (r, s) in states.iter_mut().enumerate() {
        let src = bs.work.s.h.slice(r * row..(r + 1) * row);
        let mut dst = s.s.s.h.slice_mut(0..row);
        g.stream()
            .memcpy_dtod(&src, &mut dst)
            .map_err(CudaError::from)?;
        let h = g.ptr(&s.s.s.h);
        s.set_last_hc(Some(h));
        s.n_tokens += 1;
    }
    Ok(all.chunks(c.vocab).map(<[f32]>::to_vec).collect())
}

/// Every launch of a `b`-row batched step: the layers over the KV tables, then the head
/// of every row.
fn enqueue(
    w: &CudaWeights,
    numerics: Numerics,
    kv: &KvView,
    bs: &mut BatchStep,
    b: usize,
) -> Result<()> {
    let g = &w.gpu.launcher(kv.plan);
    kv.enqueue(w, numerics, &mut bs.work, b)?;
    head_rows(g, w, numerics, &mut bs.work, (&bs.hx, &bs.logits), b)
}
