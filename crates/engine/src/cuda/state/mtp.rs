//! The MTP draft block on the device (architecture.md §7; the CPU version and its math:
//! [`crate::mtp::Mtp::draft`]): the block's raw KV ring, the chained HC state, the undo
//! record of `mtp_mark`/`mtp_keep`, and one draft run on the decode scratch.
//!
//! The block's ring counts rows as the reference's `mtp_n_raw` and the CPU's
//! [`crate::mtp::MtpState`] do: a draft attends to the rows pushed before it (at most a
//! window), whatever their positions — after a prompt the ring is empty, and a cycle
//! whose drafts were all accepted leaves a gap (its last token was never drafted from).
//! The attention kernels read the rows of positions `pos - n + 1 ..= pos` at ring slot
//! `p % cap`, so the ring is kept *anchored* at the newest row: the i-th newest sits at
//! slot `(last - i) % cap`. A draft at `pos ≠ last + 1` first rotates the ring by
//! `pos - 1 - last` slots (a device copy, only on a gap), then runs with the kernel's
//! window set to the row count: exactly the rows the CPU attends. Keys carry their own
//! RoPE (applied when stored), so moving a row does not change it.

use ds4_cuda::{CudaError, DeviceBuf, Gpu, QuantAct, SpecRing};

use super::layers::KvView;
use super::products::mv;
use super::{head_logits, DeviceState, LayerState};
use crate::backend::{HcSource, MAX_ROWS};
use crate::config::Config;
use crate::cuda::weights::{CudaMtpWeights, CudaWeights};
use crate::error::{EngineError, Result};
use crate::ops::linear::Numerics;

/// Drafts recorded between `mtp_mark` and `mtp_keep`: a cycle drafts at most one
/// multi-row step's rows.
const MAX_UNDO: usize = MAX_ROWS;

/// A device operation on the ring that the bookkeeping asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RingOp {
    /// Every slot i moves to slot (i + k) % cap.
    Rotate(usize),
    /// Copy ring slot `slot` into undo row `undo`.
    Save { slot: usize, undo: usize },
    /// Copy undo row `undo` back into ring slot `slot`.
    Restore { undo: usize, slot: usize },
}

/// What one draft after a mark changed: enough to take it back.
#[derive(Clone, Copy, Debug)]
struct Undo {
    /// The rotation applied before the row was written (0: none).
    rotate: usize,
    /// The slot the row overwrote (saved in undo row i for the i-th draft).
    slot: usize,
    count: usize,
    last: Option<usize>,
}

/// The ring's host-side bookkeeping: row count, anchor and undo record. Pure, so the
/// unit tests below run it against a model of the CPU ring without a GPU.
#[derive(Clone, Debug)]
struct RingBook {
    cap: usize,
    /// Rows held (at most `cap`).
    count: usize,
    /// The position of the newest row (its slot is `last % cap`).
    last: Option<usize>,
    /// The drafts since `mtp_mark`, when marked.
    mark: Option<Vec<Undo>>,
}

impl RingBook {
    fn new(cap: usize) -> RingBook {
        RingBook {
            cap: cap.max(1),
            count: 0,
            last: None,
            mark: None,
        }
    }

    fn reset(&mut self) {
        *self = RingBook::new(self.cap);
    }

    fn mark(&mut self) {
        self.mark = Some(Vec::new());
    }

    /// A draft at `pos`: the ring operations to run before the block writes slot
    /// `pos % cap`, and the rows its attention then reads (the new one included).
    fn draft(&mut self, pos: usize) -> Result<(Vec<RingOp>, usize), String> {
        if self.count > pos {
            return Err(format!(
                "MTP draft at position {pos} after {} ring rows: draft positions must grow \
                 (rewind with mtp_keep)",
                self.count
            ));
        }
        if self.mark.as_ref().is_some_and(|m| m.len() >= MAX_UNDO) {
            return Err(format!(
                "more than {MAX_UNDO} MTP drafts after mtp_mark (one cycle drafts at most \
                 {MAX_UNDO}); call mtp_keep first"
            ));
        }
        let cap = self.cap;
        let rotate = match self.last {
            // Anchor the newest row at pos - 1 (mod cap), so the new row lands next to it.
            Some(last) if self.count > 0 => ((pos + cap - 1) % cap + cap - last % cap) % cap,
            _ => 0,
        };
        let slot = pos % cap;
        let mut ops = Vec::new();
        if rotate != 0 {
            ops.push(RingOp::Rotate(rotate));
        }
        if let Some(m) = &mut self.mark {
            ops.push(RingOp::Save {
                slot,
                undo: m.len(),
            });
            m.push(Undo {
                rotate,
                slot,
                count: self.count,
                last: self.last,
            });
        }
        self.count = (self.count + 1).min(cap);
        self.last = Some(pos);
        Ok((ops, self.count))
    }

    /// Keeps the first `n` drafts since the mark and takes back the rest (newest first);
    /// ends the mark. Without a mark nothing changes.
    fn keep(&mut self, n: usize) -> Vec<RingOp> {
        let Some(drafts) = self.mark.take() else {
            return Vec::new();
        };
        let mut ops = Vec::new();
        if n >= drafts.len() {
            return ops;
        }
        for (i, d) in drafts.iter().enumerate().skip(n).rev() {
            ops.push(RingOp::Restore {
                undo: i,
                slot: d.slot,
            });
            if d.rotate != 0 {
                ops.push(RingOp::Rotate(self.cap - d.rotate));
            }
        }
        self.count = drafts[n].count;
        self.last = drafts[n].last;
        ops
    }
}

/// The block's device state of one session.
pub(super) struct MtpDev {
    book: RingBook,
    /// The ratio-0 layer state: the raw ring only, `cap` = the window.
    layer: LayerState,
    /// The ring's copy during a rotation.
    spare: DeviceBuf<f32>,
    /// Rows saved by the drafts since the mark.
    undo: DeviceBuf<f32>,
    /// The main model's final HC state the last `HcSource::Last` draft read (the
    /// decode scratch that held it is the block's scratch too).
    main_hc: DeviceBuf<f32>,
    /// The previous draft's output HC state (`HcSource::Chain`).
    chain: DeviceBuf<f32>,
    has_chain: bool,
    /// The token's embedding, then its norm; the projected embedding.
    emb: DeviceBuf<f32>,
    emb_n: DeviceBuf<f32>,
    e_proj: DeviceBuf<f32>,
    /// The normed incoming streams.
    g_n: DeviceBuf<f32>,
    /// Q8_0 activations of the projections (fast numerics), n_hc rows.
    q: QuantAct,
    /// The rows the next draft attends (the ring count), as the device value its
    /// attention reads (`KvView::window_at`): written before each draft, so that one
    /// captured draft serves every count while the ring grows after a prompt.
    rows_at: DeviceBuf<i32>,
    /// Captured drafts by (chained source, fast numerics, ending with a device pick);
    /// their addresses are this state's and its session's decode scratch (and the
    /// session's verify records and pick ring, which never move).
    graphs: std::collections::HashMap<(bool, bool, bool), ds4_cuda::TokenGraph>,
}

impl MtpDev {
    fn new(g: &Gpu, c: &Config) -> Result<MtpDev> {
        let (e, nhc, hd) = (c.n_embd, c.n_hc, c.head_dim);
        let cap = c.window.max(1);
        let z = |n: usize| g.zeros::<f32>(n.max(1));
        Ok(MtpDev {
            book: RingBook::new(cap),
            layer: LayerState::ring_only(z(cap * hd)?),
            spare: z(cap * hd)?,
            undo: z(MAX_UNDO * hd)?,
            main_hc: z(nhc * e)?,
            chain: z(nhc * e)?,
            has_chain: false,
            emb: z(e)?,
            emb_n: z(e)?,
            e_proj: z(e)?,
            g_n: z(nhc * e)?,
            q: g.alloc_quant_act(nhc, e)?,
            rows_at: g.zeros::<i32>(1)?,
            graphs: Default::default(),
        })
    }

    /// Runs the ring operations `ops` (rows of `hd` values).
    fn apply(&mut self, g: &Gpu, hd: usize, ops: &[RingOp]) -> Result<(), CudaError> {
        let cap = self.book.cap;
        let s = g.stream();
        let row = |i: usize| i * hd..(i + 1) * hd;
        for &op in ops {
            match op {
                RingOp::Rotate(k) => {
                    g.copy(&self.layer.ring, &mut self.spare)?;
                    let ring = &mut self.layer.ring;
                    let split = (cap - k) * hd;
                    s.memcpy_dtod(
                        &self.spare.slice(0..split),
                        &mut ring.slice_mut(k * hd..cap * hd),
                    )?;
                    s.memcpy_dtod(
                        &self.spare.slice(split..cap * hd),
                        &mut ring.slice_mut(0..k * hd),
                    )?;
                }
                RingOp::Save { slot, undo } => s.memcpy_dtod(
                    &self.layer.ring.slice(row(slot)),
                    &mut self.undo.slice_mut(row(undo)),
                )?,
                RingOp::Restore { undo, slot } => s.memcpy_dtod(
                    &self.undo.slice(row(undo)),
                    &mut self.layer.ring.slice_mut(row(slot)),
                )?,
            }
        }
        Ok(())
    }

    /// An independent copy (ring, undo record and chained state).
    fn duplicate(&self, g: &Gpu, c: &Config) -> Result<MtpDev> {
        let mut d = MtpDev::new(g, c)?;
        g.copy(&self.layer.ring, &mut d.layer.ring)?;
        g.copy(&self.undo, &mut d.undo)?;
        g.copy(&self.main_hc, &mut d.main_hc)?;
        g.copy(&self.chain, &mut d.chain)?;
        d.book = self.book.clone();
        d.has_chain = self.has_chain;
        Ok(d)
    }
}

impl DeviceState {
    /// Where the final HC state of the session's last token is (`HcSource::Last`): a
    /// device address of `n_hc·n_embd` f32 that stays valid until the next
    /// state-changing call, or `None` (after reset/import: a draft from it is an
    /// error). `decode` and `prefill` set it; a multi-row step sets its kept last row.
    // The native multi-row step's commit calls it; decode and prefill set the field.
    #[allow(dead_code)]
    pub fn set_last_hc(&mut self, hc: Option<u64>) {
        self.last_hc = hc;
    }

    /// The block's ring as the device holds it, with its row count and newest
    /// position (gpu-selftest's diagnosis of a failed keep check).
    pub(crate) fn mtp_ring_debug(
        &self,
        w: &CudaWeights,
    ) -> Option<(Vec<f32>, usize, Option<usize>)> {
        let m = self.mtp.as_ref()?;
        let ring = w.gpu.download(&m.layer.ring).ok()?;
        Some((ring, m.book.count, m.book.last))
    }

    /// Makes host values `hc` (`n_hc·n_embd`) the last token's HC state, in the decode
    /// scratch (which the next forward rewrites): gpu-selftest feeds the CPU session's
    /// state to both blocks, so that their comparison measures the block alone.
    pub(crate) fn set_last_hc_host(&mut self, w: &CudaWeights, hc: &[f32]) -> Result<()> {
        let c = &w.config;
        if hc.len() != c.n_hc * c.n_embd {
            return Err(EngineError::Invalid(format!(
                "an HC state of {} values, expected {}",
                hc.len(),
                c.n_hc * c.n_embd
            )));
        }
        let mut view = self.s.s.h.slice_mut(0..hc.len());
        w.gpu
            .stream()
            .memcpy_htod(hc, &mut view)
            .map_err(CudaError::from)?;
        self.last_hc = Some(w.gpu.ptr(&self.s.s.h));
        Ok(())
    }

    /// Empties the block's ring and forgets the HC states (reset, import).
    pub fn mtp_clear(&mut self) {
        self.last_hc = None;
        self.mtp_mark_pending = false;
        if let Some(m) = &mut self.mtp {
            m.book.reset();
            m.has_chain = false;
        }
    }

    /// See [`crate::backend::Backend::mtp_mark`].
    pub fn mtp_mark(&mut self) {
        match &mut self.mtp {
            Some(m) => m.book.mark(),
            // The block's state is allocated by its first draft (it needs the weights).
            None => self.mtp_mark_pending = true,
        }
    }

    /// See [`crate::backend::Backend::mtp_keep`]. On a device error the ring is
    /// emptied (it regrows), never left half rewound.
    pub fn mtp_keep(&mut self, w: &CudaWeights, n: usize) -> Result<()> {
        self.mtp_mark_pending = false;
        let Some(m) = &mut self.mtp else {
            return Ok(());
        };
        let ops = m.book.keep(n);
        if let Err(e) = m.apply(&w.gpu, w.config.head_dim, &ops) {
            m.book.reset();
            return Err(e.into());
        }
        Ok(())
    }

    /// Copies the block's state into `d` (a duplicate of this state).
    pub(super) fn mtp_duplicate_into(&self, w: &CudaWeights, d: &mut DeviceState) -> Result<()> {
        d.mtp = match &self.mtp {
            Some(m) => Some(m.duplicate(&w.gpu, &w.config)?),
            None => None,
        };
        d.mtp_mark_pending = self.mtp_mark_pending;
        // The last token's HC state goes with the copy (where the copy's own decode
        // leaves it): a session copy drafts from it like the original.
        d.last_hc = match self.last_hc {
            Some(hc) => {
                let c = &w.config;
                let l = w.gpu.launcher(self.plan);
                let at = w.gpu.ptr(&d.s.s.h);
                l.mtp_add_rows(at, hc, 0, c.n_hc, c.n_embd)?;
                Some(at)
            }
            None => None,
        };
        Ok(())
    }

    /// One MTP draft (the module doc, [`crate::mtp::Mtp::draft`]): `token` at `pos`
    /// from the HC state `src`, on the decode scratch; pushes the block's raw row and
    /// returns the draft logits.
    pub fn mtp_draft(
        &mut self,
        w: &CudaWeights,
        mw: &CudaMtpWeights,
        numerics: Numerics,
        (token, src, pos): (u32, HcSource, usize),
    ) -> Result<Vec<f32>> {
        self.mtp_draft_launch(w, mw, numerics, (Some(token), src, pos), None)?;
        w.gpu
            .download_f32(&self.s.s.logits, usize::MAX)
            .map_err(|e| {
                self.mtp_lost();
                e.into()
            })
    }

    /// Queues one MTP draft ([`DeviceState::mtp_draft`] without the download).
    /// `token`: the host's token at `pos`, or `None` when the previous draft's pick
    /// left `{pos, token}` in the decode step buffer (a chained draft of a greedy
    /// cycle). `pick`: the verify step's records and the cycle's ring — the draft then
    /// ends with `draft_pick`, which writes the drafted token there (state/spec.rs).
    pub(super) fn mtp_draft_launch(
        &mut self,
        w: &CudaWeights,
        mw: &CudaMtpWeights,
        numerics: Numerics,
        (token, src, pos): (Option<u32>, HcSource, usize),
        pick: Option<(u64, &SpecRing)>,
    ) -> Result<()> {
        if pos >= i32::MAX as usize {
            return Err(EngineError::Invalid(format!("MTP draft position {pos}")));
        }
        let g = &*w.gpu;
        let c = &w.config;
        if self.mtp.is_none() {
            let mut m = MtpDev::new(g, c)?;
            if std::mem::take(&mut self.mtp_mark_pending) {
                m.book.mark();
            }
            self.mtp = Some(m);
        }
        let m = self.mtp.as_mut().expect("allocated above");
        let l = g.launcher(self.plan);
        let p = |b: &DeviceBuf<f32>| g.ptr(b);
        let (e, nhc, hd) = (c.n_embd, c.n_hc, c.head_dim);
        let g_in = match src {
            HcSource::Last => {
                let Some(hc) = self.last_hc else {
                    return Err(EngineError::Invalid(
                        "MTP draft from the last token's HC state: the session has run no \
                         token since its reset or import (forward one first)"
                            .into(),
                    ));
                };
                // The decode scratch that may hold it is about to be rewritten.
                if hc != p(&m.main_hc) {
                    l.mtp_add_rows(p(&m.main_hc), hc, 0, nhc, e)?;
                    self.last_hc = Some(p(&m.main_hc));
                }
                p(&m.main_hc)
            }
            HcSource::Chain if m.has_chain => p(&m.chain),
            HcSource::Chain => {
                return Err(EngineError::Invalid(
                    "chained MTP draft without a previous draft".into(),
                ))
            }
        };
        let (ops, rows) = m.book.draft(pos).map_err(EngineError::Invalid)?;
        let run = (|| -> Result<()> {
            if let Some(t) = token {
                g.write(&mut self.s.s.step, &[pos as i32, t as i32])?;
            }
            // The ring's moves first (the input chain below does not read the ring), and
            // the count of rows the draft attends.
            m.apply(g, hd, &ops)?;
            g.write(&mut m.rows_at, &[rows as i32])?;
            let draft = Draft {
                numerics,
                g_in,
                ctx: self.ctx,
                plan: self.plan,
                pick,
            };
            // A captured graph per (HC source, numerics, pick): the draft's ~40 launches
            // ran eagerly at ~0.55 ms for ~0.39 ms of kernels (H200, with the verify
            // graph's launch behind them the GPU waited ~80 µs a cycle). The ring's row
            // count is a device value (`rows_at`), so the same graph serves a ring that
            // still grows after a prompt (a graph per count cost more to capture than it
            // saved: 9.32 -> 9.61 ms a draft-1 cycle, session 14).
            if self.use_graphs {
                let key = (
                    matches!(src, HcSource::Chain),
                    numerics == Numerics::Fast,
                    pick.is_some(),
                );
                if !m.graphs.contains_key(&key) {
                    let graph = l.capture(|| draft.enqueue(w, mw, m, &mut self.s))?;
                    m.graphs.insert(key, graph);
                }
                m.graphs[&key].launch()?;
            } else {
                draft.enqueue(w, mw, m, &mut self.s)?;
            }
            Ok(())
        })();
        match run {
            Ok(()) => {
                m.has_chain = true;
                Ok(())
            }
            Err(err) => {
                self.mtp_lost();
                Err(err)
            }
        }
    }

    /// A half-run draft leaves the ring unknown: start it again.
    pub(super) fn mtp_lost(&mut self) {
        if let Some(m) = self.mtp.as_mut() {
            m.book.reset();
            m.has_chain = false;
        }
    }
}

/// One draft's launches after the ring's moves: the block's input from the token (the
/// step buffer) and `g_in`, the block as a ratio-0 layer over its ring attending the
/// rows `MtpDev::rows_at` counts, the chained state, the head. The same on every call
/// with the same fields, so it can be captured (`DeviceState::mtp_draft`).
struct Draft<'a> {
    numerics: Numerics,
    g_in: u64,
    ctx: usize,
    plan: ds4_cuda::DecodePlan,
    /// The verify step's records and the cycle's ring: end with `draft_pick`.
    pick: Option<(u64, &'a SpecRing)>,
}

impl Draft<'_> {
    fn enqueue(
        &self,
        w: &CudaWeights,
        mw: &CudaMtpWeights,
        m: &mut MtpDev,
        work: &mut super::Work,
    ) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        let l = g.launcher(self.plan);
        let p = |b: &DeviceBuf<f32>| g.ptr(b);
        let (e, nhc) = (c.n_embd, c.n_hc);
        let (eps, f32t) = (c.rms_eps, ds4_cuda::WT_F32);
        let fast = self.numerics == Numerics::Fast;
        let s = &work.s;
        // Hin_s = e_proj·rmsnorm(emb, enorm) + h_proj·rmsnorm(G_s, hnorm).
        let emb = &w.token_embd;
        l.embed(1, g.ptr(&s.step), emb.buf.ptr(g), emb.ty, e, 1, p(&m.emb))?;
        l.rmsnorm(p(&m.emb), p(&mw.enorm), f32t, e, 1, eps, p(&m.emb_n))?;
        let e_proj = p(&m.e_proj);
        mv(
            &l,
            &mw.e_proj,
            p(&m.emb_n),
            &mut m.q,
            false,
            e_proj,
            1,
            fast,
        )?;
        l.rmsnorm(self.g_in, p(&mw.hnorm), f32t, e, nhc, eps, p(&m.g_n))?;
        mv(
            &l,
            &mw.h_proj,
            p(&m.g_n),
            &mut m.q,
            false,
            p(&s.h),
            nhc,
            fast,
        )?;
        l.mtp_add_rows(p(&s.h), p(&s.h), e_proj, nhc, e)?;
        let kv = KvView {
            layers: &[],
            window: m.book.cap,
            raw_cap: m.book.cap,
            ctx: self.ctx,
            plan: self.plan,
            journal: None,
            steer: None,
            kvt: 0,
            window_at: g.ptr(&m.rows_at),
            end: self.ctx,
            emit_pos: None,
        };
        let layer = (mw.il, &mw.layer, &m.layer, mw.rope(g, c.rope_dim));
        let px = kv.pass(w, self.numerics, layer, s, 1);
        kv.layer(&px, &mut work.q8, None)?;
        g.copy(&work.s.h, &mut m.chain)?;
        let h = p(&work.s.h);
        head_logits(&l, w, self.numerics, work, h, mw.head())?;
        if let Some((records, ring)) = self.pick {
            let (logits, step) = (p(&work.s.logits), g.ptr(&work.s.step));
            l.draft_pick(logits, c.vocab, step, records, ring)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ring on the host: `cap` slots of one value (the row's id), driven by the
    /// bookkeeping's operations as the device runs them.
    struct HostRing {
        book: RingBook,
        slots: Vec<i64>,
        undo: Vec<i64>,
    }

    impl HostRing {
        fn new(cap: usize) -> HostRing {
            HostRing {
                book: RingBook::new(cap),
                slots: vec![-1; cap],
                undo: vec![-1; MAX_UNDO],
            }
        }

        fn apply(&mut self, ops: &[RingOp]) {
            let cap = self.slots.len();
            for &op in ops {
                match op {
                    RingOp::Rotate(k) => {
                        let old = self.slots.clone();
                        for (i, v) in old.into_iter().enumerate() {
                            self.slots[(i + k) % cap] = v;
                        }
                    }
                    RingOp::Save { slot, undo } => self.undo[undo] = self.slots[slot],
                    RingOp::Restore { undo, slot } => self.slots[slot] = self.undo[undo],
                }
            }
        }

        /// A draft at `pos` writing row `id` (as kv_finish does: slot pos % cap); returns
        /// the rows the attention kernel reads, oldest first (positions pos - n + 1 ..= pos).
        fn draft(&mut self, pos: usize, id: i64) -> Vec<i64> {
            let (ops, n) = self.book.draft(pos).unwrap();
            self.apply(&ops);
            let cap = self.slots.len();
            self.slots[pos % cap] = id;
            (0..n)
                .map(|r| self.slots[(pos + 1 - n + r) % cap])
                .collect()
        }

        fn keep(&mut self, n: usize) {
            let ops = self.book.keep(n);
            self.apply(&ops);
        }
    }

    /// The CPU block's ring: the last `cap` rows pushed, attended oldest first.
    struct CpuRing {
        cap: usize,
        rows: Vec<i64>,
    }

    impl CpuRing {
        fn push(&mut self, id: i64) -> Vec<i64> {
            self.rows.push(id);
            if self.rows.len() > self.cap {
                self.rows.remove(0);
            }
            self.rows.clone()
        }
    }

    #[test]
    fn contiguous_drafts_read_the_last_window_rows() {
        let mut dev = HostRing::new(4);
        let mut cpu = CpuRing {
            cap: 4,
            rows: Vec::new(),
        };
        for (i, pos) in (7..20).enumerate() {
            assert_eq!(dev.draft(pos, i as i64), cpu.push(i as i64), "pos {pos}");
        }
    }

    #[test]
    fn gaps_rotate_the_ring_so_the_rows_stay_the_pushed_ones() {
        let mut dev = HostRing::new(5);
        let mut cpu = CpuRing {
            cap: 5,
            rows: Vec::new(),
        };
        // After a prompt (first draft far from 0), and gaps of every size mod cap.
        let positions = [
            40, 41, 43, 44, 45, 50, 51, 57, 58, 59, 60, 61, 62, 64, 70, 71,
        ];
        for (i, &pos) in positions.iter().enumerate() {
            assert_eq!(dev.draft(pos, i as i64), cpu.push(i as i64), "pos {pos}");
        }
    }

    #[test]
    fn keep_rewinds_the_rejected_drafts_like_a_fresh_run() {
        // Each cycle: mark, draft k rows from position n (after a gap or not), keep j,
        // the next cycle at n + j + 1; against replaying only the kept rows.
        let cycles: &[(usize, usize, usize)] = &[
            // (gap before the cycle, drafts, kept)
            (3, 3, 1),
            (0, 2, 2),
            (1, 4, 0),
            (0, 1, 1),
            (2, 6, 3),
            (0, 5, 5),
            (4, 3, 0),
            (0, 2, 1),
        ];
        for cap in [1, 3, 4, 16] {
            let mut dev = HostRing::new(cap);
            let mut cpu = CpuRing {
                cap,
                rows: Vec::new(),
            };
            let (mut pos, mut id) = (10usize, 0i64);
            for &(gap, k, keep) in cycles {
                pos += gap;
                dev.book.mark();
                let before = cpu.rows.clone();
                for i in 0..k {
                    let mut trial = CpuRing {
                        cap,
                        rows: cpu.rows.clone(),
                    };
                    let want = trial.push(id + i as i64);
                    assert_eq!(dev.draft(pos + i, id + i as i64), want, "cap {cap}");
                    cpu.rows = trial.rows;
                }
                dev.keep(keep);
                cpu.rows = before;
                for i in 0..keep.min(k) {
                    cpu.push(id + i as i64);
                }
                id += k as i64;
                pos += keep + 1;
                // The next draft reads exactly the kept rows plus itself.
                let mut probe = HostRing {
                    book: dev.book.clone(),
                    slots: dev.slots.clone(),
                    undo: dev.undo.clone(),
                };
                let mut want = CpuRing {
                    cap,
                    rows: cpu.rows.clone(),
                };
                assert_eq!(probe.draft(pos, -7), want.push(-7), "cap {cap} at {pos}");
            }
        }
    }

    #[test]
    fn keep_without_mark_or_of_every_draft_changes_nothing() {
        let mut dev = HostRing::new(4);
        dev.draft(5, 1);
        assert!(dev.book.keep(0).is_empty());
        dev.book.mark();
        dev.draft(6, 2);
        dev.draft(7, 3);
        assert!(dev.book.keep(2).is_empty());
        assert_eq!((dev.book.count, dev.book.last), (3, Some(7)));
        // The mark ended with the keep: a later keep is a no-op.
        assert!(dev.book.keep(0).is_empty());
    }

    #[test]
    fn drafts_past_the_undo_record_or_going_back_are_refused() {
        let mut book = RingBook::new(128);
        book.mark();
        for pos in 0..MAX_UNDO {
            book.draft(100 + pos).unwrap();
        }
        let err = book.draft(200).unwrap_err();
        assert!(err.contains("mtp_keep"), "{err}");
        let mut book = RingBook::new(8);
        book.draft(0).unwrap();
        book.draft(1).unwrap();
        let err = book.draft(1).unwrap_err();
        assert!(err.contains("must grow"), "{err}");
        // After a reset the ring is empty: any position is fine again.
        book.reset();
        book.draft(0).unwrap();
    }
}
