//! Per-session device state (KV rows, compressor frontiers, scratch) and the decode
//! of one token.

use std::collections::HashMap;

use ds4_cuda::{
    CudaError, DecodePlan, DeviceBuf, F16Work, Gpu, Launcher, QuantAct, RoutePlan, TokenGraph,
    Variant,
};

mod batch;
mod layers;
mod mtp;
mod pick;
pub(in crate::cuda) use pick::PickMode;
mod prefill;
mod products;
mod rows;
mod snapshot;
mod spec;
mod steer;

use super::weights::{CudaWeights, HcDev};
use crate::config::Config;
use crate::error::{EngineError, Result};
use crate::ops::linear::Numerics;
pub(crate) use batch::{decode_batch, unbatchable, BatchStep};
use layers::KvView;
use prefill::prefill_work;
pub(crate) use prefill::PrefillWork;
use products::{gemm, hc_params, mv, Gemm, SMALL_BATCH};

/// KV state of one layer on the device. Row counts derive from the position: the raw
/// ring holds position p at slot p % raw_cap; compressed row i summarises tokens
/// [i·r, (i+1)·r).
struct LayerState {
    ring: DeviceBuf<f32>,
    comp: Option<DeviceBuf<f32>>,
    skv: Option<DeviceBuf<f32>>,
    ssc: Option<DeviceBuf<f32>>,
    index: Option<DeviceBuf<f32>>,
    iskv: Option<DeviceBuf<f32>>,
    issc: Option<DeviceBuf<f32>>,
}

impl LayerState {
    /// A layer with a raw ring and no compressors (the MTP block's, or a placeholder
    /// for a layer another GPU runs).
    fn ring_only(ring: DeviceBuf<f32>) -> LayerState {
        LayerState {
            ring,
            comp: None,
            skv: None,
            ssc: None,
            index: None,
            iskv: None,
            issc: None,
        }
    }
}

/// Quantised activations of the fast numerics (ds4's: Q8_0 per 32 values before Q8_0
/// weights, Q8_K per 256 before routed experts), for up to `cap` tokens.
struct QuantBufs {
    /// Inputs of width n_embd (attn/ffn norm outputs, the head input).
    embd: QuantAct,
    qr: QuantAct,
    heads: QuantAct,
    low: QuantAct,
    shared_mid: QuantAct,
    /// Q8_K: the routed experts' input (one row per token, or per (token, expert)
    /// pair when batched) and their weighted `mid` rows.
    exp_in: QuantAct,
    exp_mid: QuantAct,
}

impl QuantBufs {
    fn new(g: &Gpu, c: &Config, cap: usize) -> Result<QuantBufs> {
        let k = c.n_expert_used;
        let ffs = c.n_ff_exp * c.n_expert_shared;
        let e = c.n_embd;
        Ok(QuantBufs {
            embd: g.alloc_quant_act(cap, e)?,
            qr: g.alloc_quant_act(cap, c.q_lora_rank)?,
            heads: g.alloc_quant_act(cap, c.q_dim())?,
            low: g.alloc_quant_act(cap, c.o_groups * c.o_lora_rank)?,
            shared_mid: g.alloc_quant_act(cap, ffs)?,
            exp_in: g.alloc_quant_act(if cap == 1 { 1 } else { cap * k }, e)?,
            exp_mid: g.alloc_quant_act(cap * k, c.n_ff_exp)?,
        })
    }
}

/// Device bytes per token of a batch's `Work` (the `cap`-proportional buffers of
/// `Scratch` and `QuantBufs`), for sizing prefill chunks to the free memory.
fn work_bytes_per_token(c: &Config, ctx: usize) -> usize {
    let (k, ff, e) = (c.n_expert_used, c.n_ff_exp, c.n_embd);
    let ffs = c.n_ff_exp * c.n_expert_shared;
    let (hd, og) = (c.head_dim, c.o_groups * c.o_lora_rank);
    let floats = 2 * c.n_hc * e
        + c.hc_mix()
        + c.n_hc * (c.n_hc + 1)
        + 4 * e
        + 2 * c.q_lora_rank
        // q and heads, which also hold the experts' rep and dn (`Scratch::rep`).
        + 2 * c.q_dim().max(k * e)
        + hd
        + og
        + 4 * hd
        + 4 * c.idx_head_dim
        + c.idx_heads * (c.idx_head_dim + 1)
        + comp_cap(ctx, 4)
        + c.n_expert
        + k
        + 3 * k * ff
        + 3 * ffs;
    let ints = 2 + c.idx_topk + k + c.o_groups;
    // int8 values plus one f32 scale per 32.
    let q8 = e + c.q_lora_rank + c.q_dim() + og + ffs + k * e + k * ff;
    // The fp16 copy of a ring row (`Scratch::ring16`).
    4 * (floats + ints) + q8 + q8 / 8 + 2 * hd
}

/// The [`F16Work`] slots of a prefill chunk of `cap` tokens, `(weights, activations,
/// rows)`, one per launch lane: the main lane's Q8_0 products (q_a, q_b, the grouped
/// output projection with all its groups, out_b), F16 router and routed experts (the
/// down projection's input is a row per (token, expert) pair); side lane 1's kv
/// projection, shared expert and compressor; side lane 2's indexer (its compressor,
/// projection and q_b). An F16 product's fp16 row is twice its input (hi | lo).
fn f16_sizes(c: &Config, cap: usize) -> [(usize, usize, usize); 3] {
    let (e, qd, og) = (c.n_embd, c.q_dim(), c.o_groups * c.o_lora_rank);
    let ffs = c.n_ff_exp * c.n_expert_shared;
    let main_w = (c.q_lora_rank * e)
        .max(qd * c.q_lora_rank)
        .max(c.o_lora_rank * qd)
        .max(e * og);
    let pairs_x = c.n_expert_used * c.n_ff_exp;
    let main_x = e.max(c.q_lora_rank).max(qd).max(og).max(2 * e).max(pairs_x);
    let side_w = (c.head_dim * e).max(ffs * e);
    let side_x = ffs.max(2 * e);
    let index_x = 2 * e.max(c.q_lora_rank);
    [
        (main_w, cap * main_x, cap * c.n_expert_used.max(1)),
        (side_w, cap * side_x, cap),
        (0, cap * index_x, cap),
    ]
}

/// Device memory a prefill chunk's fp16 buffers leave free at least.
const F16_MARGIN: usize = 1 << 30;

/// A prefill chunk's fp16 buffers (`cap` > SMALL_BATCH), allocated last and only where
/// they leave F16_MARGIN free: they speed prefill up by ~15% but are not in the memory
/// plan (`session_bytes`), so on a card whose weights are partly offloaded (the q2 file
/// on one H100) they never push another layer's experts to host memory — that cost
/// decode 8% when they were counted (112.4 → 103.6 tok/s at 2k, NOTES session 20).
fn opt_f16_work(g: &Gpu, c: &Config, cap: usize) -> Result<Option<F16Work>> {
    if cap <= SMALL_BATCH {
        return Ok(None);
    }
    let sizes = f16_sizes(c, cap);
    let free = g.mem_info().map_or(0, |(free, _)| free);
    if free < F16Work::bytes(&sizes) + F16_MARGIN {
        tracing::info!(
            "prefill chunk of {cap}: no room for the fp16 product buffers ({:.2} GiB free)",
            free as f64 / (1u64 << 30) as f64
        );
        return Ok(None);
    }
    Ok(Some(g.alloc_f16_work(&sizes)?))
}

/// Scratch activations of up to `cap` tokens (rows of token t at t × width).
struct Scratch {
    cap: usize,
    /// `cap` (pos, token) pairs.
    step: DeviceBuf<i32>,
    h: DeviceBuf<f32>,
    h2: DeviceBuf<f32>,
    mix: DeviceBuf<f32>,
    hcp: DeviceBuf<f32>,
    /// `hc_gram`'s per-block mix and Gram shares of up to SMALL_BATCH tokens.
    gram: DeviceBuf<f32>,
    /// What `gram` holds: the shares of the mix with weights at the first address,
    /// over the streams at the second (set by a sublayer's end, taken by the next
    /// sublayer's start, which uses them only for those weights and streams).
    gram_for: std::cell::Cell<Option<(u64, u64)>>,
    y: DeviceBuf<f32>,
    n: DeviceBuf<f32>,
    qa: DeviceBuf<f32>,
    qr: DeviceBuf<f32>,
    q: DeviceBuf<f32>,
    kv: DeviceBuf<f32>,
    heads: DeviceBuf<f32>,
    low: DeviceBuf<f32>,
    o: DeviceBuf<f32>,
    ckv: DeviceBuf<f32>,
    icv: DeviceBuf<f32>,
    qi: DeviceBuf<f32>,
    wt: DeviceBuf<f32>,
    iscores: DeviceBuf<f32>,
    iscores_stride: usize,
    sel: DeviceBuf<i32>,
    /// indexer_step's per-token block counters (zero between launches).
    idx_done: DeviceBuf<i32>,
    /// Split-attention partials (decode: the rows split evenly over ATT_SPLITS chunks).
    att_acc: DeviceBuf<f32>,
    att_ml: DeviceBuf<f32>,
    /// Rows a token can attend to at most (window + compressed rows).
    att_stride: usize,
    rlog: DeviceBuf<f32>,
    ids: DeviceBuf<i32>,
    rw: DeviceBuf<f32>,
    g: DeviceBuf<f32>,
    u: DeviceBuf<f32>,
    mid: DeviceBuf<f32>,
    sg: DeviceBuf<f32>,
    su: DeviceBuf<f32>,
    smid: DeviceBuf<f32>,
    sh: DeviceBuf<f32>,
    hx: DeviceBuf<f32>,
    tmp: DeviceBuf<f32>,
    logits: DeviceBuf<f32>,
    /// Matrix ids g = i mod o_groups of the grouped output projection, cap × o_groups.
    group_ids: DeviceBuf<i32>,
    /// A prefill chunk's scratch (cap > SMALL_BATCH): fp16 copies of the layer's raw
    /// ring (window + cap rows) and compressed rows (the most any layer has at `ctx`),
    /// which the tensor-core attention reads (`att_half`).
    ring16: Option<DeviceBuf<u16>>,
    comp16: Option<DeviceBuf<u16>>,
    /// A prefill chunk's fp16 copies of its products' weights and activations
    /// (`q8_f16`, `f16_split`), a slot per launch lane ([`f16_sizes`]), where they fit
    /// ([`opt_f16_work`]).
    f16: Option<F16Work>,
}

/// The scratch of up to `cap` tokens with its quantised activations.
struct Work {
    s: Scratch,
    q8: QuantBufs,
    /// Per-expert pair lists of a batch's routed-expert GEMMs (batches only).
    plan: Option<RoutePlan>,
}

impl Work {
    fn new(g: &Gpu, c: &Config, ctx: usize, cap: usize, att_stride: usize) -> Result<Work> {
        let plan = if cap > 1 && gemm(Gemm::Experts) {
            Some(g.alloc_route_plan(cap * c.n_expert_used, c.n_expert)?)
        } else {
            None
        };
        let mut s = Scratch::new(g, c, ctx, cap, att_stride)?;
        let q8 = QuantBufs::new(g, c, cap)?;
        s.f16 = opt_f16_work(g, c, cap)?;
        Ok(Work { s, q8, plan })
    }
}

impl Scratch {
    /// The routed experts' input repeated per (token, expert) pair (batches that take
    /// the matvecs): in `q`'s buffer, which attention no longer reads once the FFN
    /// starts (the sublayers run in order and every side lane joins before a sublayer
    /// ends). Sharing saves 196 KB a token of prefill buffers at the Flash shape — what
    /// lets a 2,048-token chunk fit beside the q2 weights on an 80 GB card.
    fn rep(&self) -> &DeviceBuf<f32> {
        &self.q
    }

    /// Writes the first rows of the streams `h` (`[n][n_hc·n_embd]`: a split's stage
    /// input, from the previous stage).
    fn set_streams(&mut self, g: &Gpu, rows: &[f32]) -> Result<()> {
        if rows.len() > self.h.len() {
            return Err(EngineError::Invalid(format!(
                "{} stream values for a scratch of {}",
                rows.len(),
                self.h.len()
            )));
        }
        let mut dst = self.h.slice_mut(0..rows.len());
        Ok(g.stream()
            .memcpy_htod(rows, &mut dst)
            .map_err(CudaError::from)?)
    }

    /// The streams of the first `n` rows (a split's stage output).
    fn streams(&self, g: &Gpu, c: &Config, n: usize) -> Result<Vec<f32>> {
        Ok(g.download_f32(&self.h, n * c.n_hc * c.n_embd)?)
    }

    /// The routed experts' down outputs (k rows a token), in `heads`'s buffer (as
    /// [`Scratch::rep`]).
    fn dn(&self) -> &DeviceBuf<f32> {
        &self.heads
    }

    fn new(g: &Gpu, c: &Config, ctx: usize, cap: usize, att_stride: usize) -> Result<Scratch> {
        let k = c.n_expert_used;
        let ff = c.n_ff_exp;
        let ffs = c.n_ff_exp * c.n_expert_shared;
        let e = c.n_embd;
        let icap = comp_cap(ctx, 4);
        let hd = c.head_dim;
        let z = |n: usize| g.zeros::<f32>(n.max(1));
        let half = |n: usize| -> Result<Option<DeviceBuf<u16>>> {
            Ok(if cap > SMALL_BATCH {
                Some(g.zeros::<u16>(n.max(8))?)
            } else {
                None
            })
        };
        let groups: Vec<i32> = (0..cap * c.o_groups)
            .map(|i| (i % c.o_groups) as i32)
            .collect();
        Ok(Scratch {
            cap,
            step: g.zeros::<i32>(2 * cap)?,
            h: z(cap * c.n_hc * e)?,
            h2: z(cap * c.n_hc * e)?,
            mix: z(cap * c.hc_mix())?,
            hcp: z(cap * (c.n_hc + c.n_hc * c.n_hc))?,
            gram: z(ds4_cuda::hc_gram_floats(cap.min(SMALL_BATCH), e))?,
            gram_for: std::cell::Cell::new(None),
            y: z(cap * e)?,
            n: z(cap * e)?,
            qa: z(cap * c.q_lora_rank)?,
            qr: z(cap * c.q_lora_rank)?,
            // q and heads also hold the routed experts' repeated input and down
            // outputs (`Scratch::rep`, `Scratch::dn`): dead after attention, before the FFN.
            q: z(cap * c.q_dim().max(k * e))?,
            kv: z(cap * hd)?,
            heads: z(cap * c.q_dim().max(k * e))?,
            low: z(cap * c.o_groups * c.o_lora_rank)?,
            o: z(cap * e)?,
            ckv: z(cap * 4 * hd)?,
            icv: z(cap * 4 * c.idx_head_dim)?,
            qi: z(cap * c.idx_heads * c.idx_head_dim)?,
            wt: z(cap * c.idx_heads)?,
            iscores: z(cap * icap)?,
            iscores_stride: icap,
            sel: g.zeros::<i32>((cap * c.idx_topk).max(1))?,
            idx_done: g.zeros::<i32>(cap)?,
            // Split attention (decode, multi-row steps, a batch of ≤ SMALL_BATCH
            // tokens): every token's chunk partials.
            att_acc: z(cap.min(SMALL_BATCH) * c.n_head * att_splits(att_stride) * hd)?,
            att_ml: z(cap.min(SMALL_BATCH) * 2 * c.n_head * att_splits(att_stride))?,
            att_stride,
            rlog: z(cap * c.n_expert)?,
            ids: g.zeros::<i32>(cap * k)?,
            rw: z(cap * k)?,
            g: z(cap * k * ff)?,
            u: z(cap * k * ff)?,
            mid: z(cap * k * ff)?,
            sg: z(cap * ffs)?,
            su: z(cap * ffs)?,
            smid: z(cap * ffs)?,
            sh: z(cap * e)?,
            hx: z(e)?,
            tmp: z(e)?,
            logits: z(c.vocab)?,
            group_ids: g.upload(&groups)?,
            ring16: half((c.window.max(1) + cap) * hd)?,
            comp16: half(max_comp_rows(c, ctx) * hd)?,
            f16: None,
        })
    }
}

pub(super) struct DeviceState {
    pub ctx: usize,
    pub n_tokens: usize,
    /// Raw rows attended (the model's sliding window).
    window: usize,
    /// Slots of the raw ring: the window plus one prefill chunk, so a chunk's rows never
    /// overwrite rows its earlier tokens still attend to.
    raw_cap: usize,
    /// Tokens per batched prefill chunk.
    chunk: usize,
    att_stride: usize,
    layers: Vec<LayerState>,
    /// One token (decode, captured in graphs). A prefill chunk runs in the GPU's shared
    /// [`PrefillWork`].
    s: Work,
    /// Captured tokens (keyed by: with the output head, and [`DeviceState::emit_key`]),
    /// replayed per token; all position-dependent counts are read from the device step
    /// buffer.
    graphs: HashMap<(bool, u64), TokenGraph>,
    graph_numerics: Option<Numerics>,
    use_graphs: bool,
    /// The variants this session's launches use.
    plan: DecodePlan,
    /// The multi-row step's scratch, graphs and undo record (allocated on first use).
    rows: Option<rows::RowStep>,
    /// The MTP draft block's state (state/mtp.rs), allocated by the first draft.
    mtp: Option<mtp::MtpDev>,
    /// `mtp_mark` came before the block's first draft allocated its state: the first
    /// draft starts the mark (else the first cycle's rejected drafts stayed in the ring).
    mtp_mark_pending: bool,
    /// The last token's final HC state on the device ([`DeviceState::set_last_hc`]).
    last_hc: Option<u64>,
    /// Directional steering (state/steer.rs; `None`: off).
    steer: Option<steer::SteerDev>,
    /// The device's greedy picks (state/pick.rs), allocated by the first pick.
    picks: Option<pick::Picks>,
    /// A greedy speculative cycle's pick ring (state/spec.rs), allocated by the first.
    spec: Option<spec::SpecDev>,
}

fn comp_cap(ctx: usize, ratio: usize) -> usize {
    ctx / ratio + 2
}

/// The most compressed rows any layer keeps at `ctx`.
fn max_comp_rows(c: &Config, ctx: usize) -> usize {
    c.compress_ratios
        .iter()
        .filter(|&&r| r != 0)
        .map(|&r| comp_cap(ctx, r))
        .max()
        .unwrap_or(0)
}

/// Device bytes per token of the batch buffers that grow with the context (attention
/// scores and indexer scores); chunks are sized so these stay within 1 GiB (one buffer
/// per GPU: 8,192-token chunks up to a 128k context, 1,024 at 1M).
const CHUNK_SCORE_BUDGET: usize = 1 << 30;
/// Tokens per prefill chunk at most. Each chunk streams every routed expert's weights
/// once (a chunk of 512 gives each expert ~12 tokens), so longer chunks amortise the
/// weight decoding: H200 q2 prefill at 2k / 16k 3,179 / 2,552 tok/s with 512,
/// 3,927 / 2,979 with 1,024, 4,378 / 3,219 with 2,048 (bench/RESULTS.md, v10f); at 16k
/// 4,862 with 2,048, 5,012 with 4,096 and 5,128 with 8,192 (NOTES session 18: each
/// expert's ~48 pairs of a 2,048 chunk fill 1.5 of the expert GEMM's 32-pair tiles).
/// The chunk's buffers are one per GPU ([`PrefillWork`]); each session's raw ring holds
/// the window plus a chunk (43 layers × 8,320 rows × 2 KB = 733 MB at 8,192).
const MAX_CHUNK: usize = 8192;
/// A chunk's buffers (~1 MB per token at the Flash shape) take at most this fraction
/// of the device memory free when the session is created.
const CHUNK_MEM_FRACTION: usize = 4;
/// Chunks of a decode token's attention rows (split evenly on the device by the row
/// count at that position): 8 head groups × 32 chunks fill the GPU with blocks of a
/// few rows each. A prefill batch uses one chunk per token: its tokens fill the GPU.
const ATT_SPLITS: usize = 32;
/// Most chunks of a multi-row step's attention (2 to 16 tokens: an MTP verify, a
/// batched step over sessions). Each chunk writes a 512-float partial per head and
/// token for the combine to read (33.5 MB a layer at 8 tokens × 32 chunks), while the
/// tokens already give the GPU its blocks: H200, q2, 8 layers, 2k, 8 sessions 4.8–5.0
/// → 4.5 ms a step and R = 4 3.0–3.1 → 2.8 ms at 16 chunks; 8 and 4 were slower.
pub(crate) const ATT_SPLITS_ROWS: usize = 16;

/// Tokens per prefill chunk: `asked` (or MAX_CHUNK), bounded by the context's score
/// buffers, by `budget` bytes of batch buffers, and to 1..=ctx.
fn prefill_chunk(c: &Config, ctx: usize, budget: usize, asked: Option<usize>) -> usize {
    let scores_per_token = 4 * comp_cap(ctx, 4);
    let mem_chunk = budget / work_bytes_per_token(c, ctx).max(1);
    asked
        .unwrap_or(MAX_CHUNK)
        .min(CHUNK_SCORE_BUDGET / scores_per_token)
        .min(mem_chunk)
        .clamp(1, ctx.max(1))
}

/// Tokens per prefill chunk the memory planner reserves room for when the weights do
/// not fit beside a session (expert offload). A chunk streams every offloaded layer's
/// expert stack over the bus once, so halving it doubles that traffic: on one H100 (q2,
/// 2 layers offloaded, 2k prompt) 1,024 gave 2,840 tok/s (bench/RESULTS.md v23).
pub(crate) const PLAN_CHUNK: usize = 2048;

/// Device bytes of a session's KV at `ctx` with a raw ring of window + `chunk` slots:
/// per layer the ring, compressed and index rows and the compressors' frontiers.
pub(crate) fn kv_bytes(c: &Config, ctx: usize, chunk: usize) -> usize {
    let hd = c.head_dim;
    let frontier = |r: usize, d: usize| {
        let lanes = Config::compressor_lanes(r);
        2 * lanes * r * lanes * d
    };
    let floats: usize = (0..c.n_layer)
        .map(|il| {
            let r = c.compress_ratios[il];
            let mut f = (c.window.max(1) + chunk) * hd;
            if r != 0 {
                f += comp_cap(ctx, r) * hd + frontier(r, hd);
            }
            if c.has_indexer(il) {
                f += comp_cap(ctx, 4) * c.idx_head_dim + frontier(4, c.idx_head_dim);
            }
            f
        })
        .sum();
    4 * floats
}

/// A session's buffers besides its KV and its prefill batch: the decode scratch, the
/// multi-row step's (SMALL_BATCH rows) and logits rows, with a 128 MiB margin for
/// graphs, allocation rounding and the estimate's ~6% shortfall on the batch buffers
/// (1.031 GiB measured for 0.968 estimated at 1,024 tokens on the H100).
pub(crate) fn fixed_session_bytes(c: &Config, ctx: usize) -> usize {
    (1 + SMALL_BATCH) * work_bytes_per_token(c, ctx) + 4 * c.vocab * (SMALL_BATCH + 2) + (128 << 20)
}

/// Device bytes of one more session at `ctx` beside the first: its KV (a raw ring of the
/// window + `chunk`) and decode scratch, not the GPU's shared prefill buffers.
pub(crate) fn pool_session_bytes(c: &Config, ctx: usize, chunk: usize) -> usize {
    kv_bytes(c, ctx, chunk) + fixed_session_bytes(c, ctx)
}

/// Device bytes of one session at `ctx` with prefill chunks of `chunk` tokens, the GPU's
/// prefill buffers included: what the memory planner (placement.rs) reserves beside the
/// weights.
pub(crate) fn session_bytes(c: &Config, ctx: usize, chunk: usize) -> usize {
    // The prefill buffers' fp16 compressed rows (`Scratch::comp16`) grow with the context.
    let comp16 = 2 * c.head_dim * max_comp_rows(c, ctx);
    kv_bytes(c, ctx, chunk)
        + fixed_session_bytes(c, ctx)
        + chunk * work_bytes_per_token(c, ctx)
        + comp16
}

fn att_splits(att_stride: usize) -> usize {
    att_splits_setting().min(att_stride.max(1))
}

/// `DS4_CUDA_ATT_SPLITS=N` (1–128) overrides ATT_SPLITS, for A/B timing of the decode
/// attention's chunking against its combine.
fn att_splits_setting() -> usize {
    static SPLITS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SPLITS.get_or_init(|| parse_att_splits(std::env::var("DS4_CUDA_ATT_SPLITS").ok().as_deref()))
}

fn parse_att_splits(v: Option<&str>) -> usize {
    match v.map(|v| v.trim().parse::<usize>()) {
        None => ATT_SPLITS,
        Some(Ok(n)) if (1..=128).contains(&n) => n,
        Some(_) => {
            tracing::warn!("DS4_CUDA_ATT_SPLITS must be 1 to 128; using {ATT_SPLITS}");
            ATT_SPLITS
        }
    }
}

impl DeviceState {
    pub fn new(w: &CudaWeights, ctx: usize, plan: DecodePlan) -> Result<DeviceState> {
        let g = &w.gpu;
        let c = &w.config;
        let window = c.window.max(1);
        let hd = c.head_dim;
        // Compressed rows one token attends to: the top-k selection on indexer layers,
        // every row on the other compressed layers.
        let max_comp = (0..c.n_layer)
            .map(|il| match c.compress_ratios[il] {
                0 => 0,
                _ if c.has_indexer(il) => c.idx_topk,
                r => comp_cap(ctx, r),
            })
            .max()
            .unwrap_or(0);
        let att_stride = window + max_comp;
        let free = g.mem_info().map_or(usize::MAX, |(free, _)| free);
        let asked = std::env::var("DS4_CUDA_PREFILL_CHUNK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok());
        // Weights placed to leave one session's room (expert offload: the planner
        // reserved this session's KV and a PLAN_CHUNK batch) take that chunk where it
        // fits; otherwise a chunk takes a fraction, leaving room for more sessions.
        let budget = if w.tight {
            let left = free.saturating_sub(kv_bytes(c, ctx, 0) + fixed_session_bytes(c, ctx));
            left.min(PLAN_CHUNK * work_bytes_per_token(c, ctx))
        } else {
            free / CHUNK_MEM_FRACTION
        };
        let chunk = prefill_chunk(c, ctx, budget, asked);
        tracing::info!(
            "session of {ctx} tokens: prefill chunk {chunk} ({:.2} GiB free before it)",
            free as f64 / (1u64 << 30) as f64
        );
        let raw_cap = window + chunk;
        let mut layers = Vec::with_capacity(c.n_layer);
        for il in 0..c.n_layer {
            if !w.range.contains(&il) {
                // A layer another GPU runs (a split model): no state here.
                layers.push(LayerState::ring_only(g.zeros::<f32>(1)?));
                continue;
            }
            let r = c.compress_ratios[il];
            let lanes = Config::compressor_lanes(r);
            let zeros = |n: usize| g.zeros::<f32>(n);
            let neg = |n: usize| g.upload(&vec![crate::kv::NEG_INF; n]);
            // The pooled rows, window state and window scores of a compressor whose
            // rows are d wide (the main one: head_dim; the indexer's: idx_head_dim).
            let compressor = |d: usize| -> Result<_> {
                let f = lanes * r * lanes * d;
                Ok((
                    Some(zeros(comp_cap(ctx, r) * d)?),
                    Some(zeros(f)?),
                    Some(neg(f)?),
                ))
            };
            let (comp, skv, ssc) = if r != 0 {
                compressor(hd)?
            } else {
                (None, None, None)
            };
            let (index, iskv, issc) = if c.has_indexer(il) {
                compressor(c.idx_head_dim)?
            } else {
                (None, None, None)
            };
            layers.push(LayerState {
                ring: zeros(raw_cap * hd)?,
                comp,
                skv,
                ssc,
                index,
                iskv,
                issc,
            });
        }
        // The GPU's prefill buffers, sized for this session now (not at its first chunk),
        // so that the free memory a session pool sees already excludes them.
        prefill_work(&mut w.prefill_work(), w, ctx, chunk, att_stride)?;
        Ok(DeviceState {
            ctx,
            n_tokens: 0,
            window,
            raw_cap,
            chunk,
            att_stride,
            layers,
            s: Work::new(g, c, ctx, 1, att_stride)?,
            graphs: HashMap::new(),
            graph_numerics: None,
            use_graphs: !g.profiling()
                && std::env::var("DS4_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            plan,
            rows: None,
            mtp: None,
            mtp_mark_pending: false,
            last_hc: None,
            steer: None,
            picks: None,
            spec: None,
        })
    }

    /// KV bytes in use at `n_tokens`: the raw rows in the window and the compressed and
    /// index rows so far (the cache's allocation is larger: it is sized for `ctx`).
    pub fn kv_bytes_used(&self, c: &Config) -> usize {
        let n = self.n_tokens;
        let raw = n.min(self.window) * c.head_dim * c.n_layer;
        let comp: usize = (0..c.n_layer)
            .map(|il| match c.compress_ratios[il] {
                0 => 0,
                r if c.has_indexer(il) => n / r * (c.head_dim + c.idx_head_dim),
                r => n / r * c.head_dim,
            })
            .sum();
        4 * (raw + comp)
    }

    /// Tokens per batched prefill chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Lowers the chunk (the ring and the batch buffers stay sized for the first one).
    pub fn set_chunk(&mut self, chunk: usize) {
        self.chunk = chunk.clamp(1, self.raw_cap - self.window);
    }

    /// Runs one token at position `n_tokens`; with `head` the logits are computed.
    pub fn decode(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        token: u32,
        head: bool,
    ) -> Result<()> {
        let g = &w.gpu.launcher(self.plan);
        let pos = self.n_tokens as i32;
        g.write(&mut self.s.s.step, &[pos, token as i32])?;
        if self.use_graphs {
            if self.graph_numerics != Some(numerics) {
                self.graphs.clear();
                self.graph_numerics = Some(numerics);
            }
            // One key at a time: a session that decodes a token now and then (an MTP
            // cycle without drafts) captures only what it uses; a greedy run captures
            // every key up front (`decode_pick`).
            let key = (head, self.emit_key(&w.config));
            if !self.graphs.contains_key(&key) {
                let graph = g.capture(|| self.enqueue_token(w, numerics, head))?;
                self.graphs.insert(key, graph);
            }
            self.graphs[&key].launch()?;
        } else {
            self.enqueue_token(w, numerics, head)?;
        }
        // The MTP draft's `HcSource::Last`: the decode scratch's streams.
        self.last_hc = Some(g.ptr(&self.s.s.h));
        self.n_tokens += 1;
        Ok(())
    }

    fn kv(&self) -> KvView<'_> {
        KvView {
            layers: &self.layers,
            window: self.window,
            raw_cap: self.raw_cap,
            ctx: self.ctx,
            plan: self.plan,
            journal: None,
            steer: self.steer.as_ref(),
            kvt: 0,
            window_at: 0,
            end: self.ctx,
            emit_pos: None,
        }
    }

    /// Which of the model's compressor ratios emit a row at the next position
    /// (`n_tokens`; bit i: the i-th smallest distinct ratio): the key of a decode graph
    /// under `comp_defer`, whose joins depend on it. Without it, `u64::MAX`: one graph
    /// for every position.
    fn emit_key(&self, c: &Config) -> u64 {
        self.emit_key_at(c, self.n_tokens)
    }

    /// The pick graphs to capture when the one for position `n_tokens` is missing (a
    /// greedy run, `decode_pick`): its key with that position, then under `comp_defer`
    /// every other key of the next positions, each with a position of its own (only the
    /// key shapes a capture; the graph reads the real position from the step buffer).
    /// All at once, so that no capture (~10–30 ms) interrupts the run later.
    fn capture_plan(&self, c: &Config) -> Vec<(u64, usize)> {
        let here = self.n_tokens;
        let mut plan = vec![(self.emit_key_at(c, here), here)];
        if self.plan.has(Variant::CompDefer) {
            // Every key recurs within the ratios' least common multiple (128 for the
            // Flash model's 4 and 128); a bound keeps odd ratios cheap.
            for pos in here + 1..here + 4096 {
                let k = self.emit_key_at(c, pos);
                if !plan.iter().any(|p| p.0 == k) {
                    plan.push((k, pos));
                }
            }
        }
        plan
    }

    /// [`DeviceState::emit_key`] at position `pos`.
    fn emit_key_at(&self, c: &Config, pos: usize) -> u64 {
        if !self.plan.has(Variant::CompDefer) {
            return u64::MAX;
        }
        let mut ratios: Vec<usize> = c
            .compress_ratios
            .iter()
            .copied()
            .filter(|&r| r > 0)
            .collect();
        ratios.sort_unstable();
        ratios.dedup();
        ratios
            .iter()
            .enumerate()
            .filter(|&(_, &r)| (pos + 1).is_multiple_of(r))
            .fold(0, |m, (i, _)| m | 1 << i)
    }

    /// Enqueues every launch of one token (the step buffer already holds pos/token).
    fn enqueue_token(&mut self, w: &CudaWeights, numerics: Numerics, head: bool) -> Result<()> {
        let kv = KvView {
            layers: &self.layers,
            window: self.window,
            raw_cap: self.raw_cap,
            ctx: self.ctx,
            plan: self.plan,
            journal: None,
            steer: self.steer.as_ref(),
            kvt: 0,
            window_at: 0,
            end: self.ctx,
            emit_pos: self.plan.has(Variant::CompDefer).then_some(self.n_tokens),
        };
        kv.enqueue(w, numerics, &mut self.s, 1)?;
        if head {
            let h = w.gpu.ptr(&self.s.s.h);
            head_logits(
                &w.gpu.launcher(self.plan),
                w,
                numerics,
                &mut self.s,
                h,
                w.head(),
            )?;
        }
        Ok(())
    }

    fn enqueue_layers(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        b: &mut Work,
        n_tok: usize,
    ) -> Result<()> {
        let kv = KvView {
            end: self.n_tokens + n_tok,
            ..self.kv()
        };
        kv.enqueue(w, numerics, b, n_tok)
    }

    /// The logits of the HC state at `h` into the decode scratch.
    fn head(&mut self, w: &CudaWeights, numerics: Numerics, h: u64) -> Result<()> {
        head_logits(
            &w.gpu.launcher(self.plan),
            w,
            numerics,
            &mut self.s,
            h,
            w.head(),
        )
    }

    pub fn logits(&self, w: &CudaWeights) -> Result<Vec<f32>> {
        Ok(w.gpu.download_f32(&self.s.s.logits, usize::MAX)?)
    }
}

/// The output head on one token's HC state `h`, into `s.logits`: the stream collapse
/// `hc` and the final norm `norm` (the model's, or the MTP block's), then the model's
/// output projection.
fn head_logits(
    g: &Launcher,
    w: &CudaWeights,
    numerics: Numerics,
    b: &mut Work,
    h: u64,
    head: (&HcDev, &DeviceBuf<f32>),
) -> Result<()> {
    let hx = g.ptr(&b.s.hx);
    head_collapse(g, w, &b.s, h, head, hx)?;
    let fast = numerics == Numerics::Fast;
    let logits = g.ptr(&b.s.logits);
    mv(g, &w.output, hx, &mut b.q8.embd, false, logits, 1, fast)?;
    Ok(())
}

/// The output head of the first `n` rows of a multi-row pass over `work` (a multi-row
/// step, a batched step over sessions): each row's stream collapse into `hx`
/// (`[n][n_embd]`), then one product of the output matrix over every row into `logits`
/// (one pass over its weights).
fn head_rows(
    g: &Launcher,
    w: &CudaWeights,
    numerics: Numerics,
    work: &mut Work,
    (hx, logits): (&DeviceBuf<f32>, &DeviceBuf<f32>),
    n: usize,
) -> Result<()> {
    let c = &w.config;
    let (hx, h) = (g.ptr(hx), g.ptr(&work.s.h));
    let row = (c.n_hc * c.n_embd * 4) as u64;
    for r in 0..n {
        let out = hx + (r * c.n_embd * 4) as u64;
        head_collapse(g, w, &work.s, h + r as u64 * row, w.head(), out)?;
    }
    let fast = numerics == Numerics::Fast;
    mv(
        g,
        &w.output,
        hx,
        &mut work.q8.embd,
        false,
        g.ptr(logits),
        n,
        fast,
    )?;
    Ok(())
}

/// The head's stream collapse of one token's HC state `h` (`hc`, then the final norm
/// `norm`) into the `n_embd` floats at `out`, through `s`'s mix and tmp buffers.
fn head_collapse(
    g: &Launcher,
    w: &CudaWeights,
    s: &Scratch,
    h: u64,
    (hc, norm): (&HcDev, &DeviceBuf<f32>),
    out: u64,
) -> Result<()> {
    let c = &w.config;
    g.hc_mix_mat(1, h, &hc.fn_, c.rms_eps, g.ptr(&s.mix))?;
    g.head_collapse(
        (h, g.ptr(&s.mix)),
        &hc_params(g, c, hc),
        g.ptr(norm),
        ds4_cuda::WT_F32,
        c.rms_eps,
        g.ptr(&s.tmp),
        out,
    )?;
    Ok(())
}

impl Scratch {
    /// Writes one (position, token) record per row into the step buffer, which the
    /// layer kernels read (a batched step over several sessions: each row at its own
    /// session's position).
    fn write_rows(&mut self, g: &Gpu, rows: impl IntoIterator<Item = (usize, u32)>) -> Result<()> {
        let steps: Vec<i32> = rows
            .into_iter()
            .flat_map(|(pos, t)| [pos as i32, t as i32])
            .collect();
        let mut view = self.step.slice_mut(0..steps.len());
        g.stream()
            .memcpy_htod(&steps, &mut view)
            .map_err(CudaError::from)?;
        Ok(())
    }

    /// The records of `tokens` at positions `n0..` (one sequence).
    fn write_steps(&mut self, g: &Gpu, n0: usize, tokens: &[u32]) -> Result<()> {
        self.write_rows(g, (n0..).zip(tokens.iter().copied()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flash() -> Config {
        Config::flash()
    }

    #[test]
    fn attention_split_settings_parse() {
        assert_eq!(parse_att_splits(None), ATT_SPLITS);
        assert_eq!(parse_att_splits(Some(" 16 ")), 16);
        assert_eq!(parse_att_splits(Some("128")), 128);
        for bad in ["0", "129", "x", ""] {
            assert_eq!(parse_att_splits(Some(bad)), ATT_SPLITS, "{bad}");
        }
    }

    #[test]
    fn a_batch_costs_about_a_megabyte_per_token_at_the_flash_shape() {
        let b = work_bytes_per_token(&flash(), 32768);
        assert!((700_000..1_500_000).contains(&b), "{b} bytes per token");
        // The indexer score row grows with the context: 4 bytes per 4 positions.
        let grow = work_bytes_per_token(&flash(), 32768 + 4096) - b;
        assert_eq!(grow, 4096);
    }

    #[test]
    fn chunks_are_max_chunk_tokens_when_memory_allows() {
        let c = flash();
        assert_eq!(
            prefill_chunk(&c, 32768, (50 << 30) / CHUNK_MEM_FRACTION, None),
            MAX_CHUNK
        );
        assert_eq!(
            prefill_chunk(&c, 32768, (50 << 30) / CHUNK_MEM_FRACTION, Some(300)),
            300
        );
        // Never more than the context, never zero.
        assert_eq!(prefill_chunk(&c, 100, 50 << 30, None), 100);
        assert_eq!(
            prefill_chunk(&c, 32768, (50 << 30) / CHUNK_MEM_FRACTION, Some(0)),
            1
        );
    }

    #[test]
    fn chunks_shrink_with_free_memory_and_long_contexts() {
        let c = flash();
        let per = work_bytes_per_token(&c, 32768);
        // A quarter of 1 GiB free holds fewer than 2,048 tokens of buffers.
        let chunk = prefill_chunk(&c, 32768, (1 << 30) / CHUNK_MEM_FRACTION, None);
        assert_eq!(chunk, (1usize << 30) / CHUNK_MEM_FRACTION / per);
        assert!(chunk < MAX_CHUNK);
        assert_eq!(prefill_chunk(&c, 32768, 0, None), 1);
        // At 1M context the indexer score rows cap the chunk (512 MiB budget).
        let long = prefill_chunk(&c, 1 << 20, 1 << 38, None);
        assert_eq!(long, CHUNK_SCORE_BUDGET / (4 * comp_cap(1 << 20, 4)));
        assert!(long < MAX_CHUNK);
    }

    #[test]
    fn a_session_at_2k_fits_in_a_few_gib_and_grows_with_the_context() {
        let c = flash();
        let at = |ctx| session_bytes(&c, ctx, PLAN_CHUNK) as f64 / (1u64 << 30) as f64;
        // The planner's reserve for the H100 acceptance (2k) must stay small, and 100k
        // must cost more KV (compressed and index rows grow with the context).
        assert!((0.8..3.0).contains(&at(2048)), "{} GiB at 2k", at(2048));
        assert!(at(100_000) > at(2048) + 0.3, "{} GiB at 100k", at(100_000));
        let kv = |ctx| kv_bytes(&c, ctx, 0);
        assert!(kv(100_000) > kv(2048));
    }
}
