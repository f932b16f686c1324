//! Per-session device state (KV rows, compressor frontiers, scratch) and the decode
//! of one token.

use ds4_cuda::{Batch, CudaError, DeviceBuf, Gpu, MatSel, QuantAct, RoutePlan, TokenGraph};
use ds4_gguf::GgmlType;

use super::weights::{CudaWeights, LayerDev};
use crate::config::Config;
use crate::error::Result;
use crate::kv::{Frontier, KvCache};
use crate::ops::linear::Numerics;

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
        + 2 * c.q_dim()
        + hd
        + og
        + 4 * hd
        + 4 * c.idx_head_dim
        + c.idx_heads * (c.idx_head_dim + 1)
        + comp_cap(ctx, 4)
        + c.n_expert
        + k
        + 2 * k * e
        + 3 * k * ff
        + 3 * ffs;
    let ints = 2 + c.idx_topk + k + c.o_groups;
    // int8 values plus one f32 scale per 32.
    let q8 = e + c.q_lora_rank + c.q_dim() + og + ffs + k * e + k * ff;
    4 * (floats + ints) + q8 + q8 / 8
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
    /// Split-attention partials (decode: the rows split evenly over ATT_SPLITS chunks).
    att_acc: DeviceBuf<f32>,
    att_ml: DeviceBuf<f32>,
    /// Rows a token can attend to at most (window + compressed rows).
    att_stride: usize,
    rlog: DeviceBuf<f32>,
    ids: DeviceBuf<i32>,
    rw: DeviceBuf<f32>,
    /// The experts' input repeated per (token, expert) pair (batches only).
    rep: DeviceBuf<f32>,
    g: DeviceBuf<f32>,
    u: DeviceBuf<f32>,
    mid: DeviceBuf<f32>,
    dn: DeviceBuf<f32>,
    sg: DeviceBuf<f32>,
    su: DeviceBuf<f32>,
    smid: DeviceBuf<f32>,
    sh: DeviceBuf<f32>,
    hx: DeviceBuf<f32>,
    tmp: DeviceBuf<f32>,
    logits: DeviceBuf<f32>,
    /// Matrix ids g = i mod o_groups of the grouped output projection, cap × o_groups.
    group_ids: DeviceBuf<i32>,
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
        Ok(Work {
            s: Scratch::new(g, c, ctx, cap, att_stride)?,
            q8: QuantBufs::new(g, c, cap)?,
            plan,
        })
    }
}

/// Which products a batch of more than one token runs as tensor-core / tiled GEMMs
/// instead of per-token matvecs: `DS4_CUDA_GEMM` = `0` (none, for comparison) or a comma
/// list of `q8` (Q8_0 × int8), `f32` (f32 activations), `group` (the grouped output
/// projection), `experts`, `attn` (tensor-core attention, fast numerics); all by
/// default.
#[derive(Clone, Copy)]
enum Gemm {
    Q8,
    F32,
    Group,
    Experts,
    Attn,
}

fn gemm(kind: Gemm) -> bool {
    static ON: std::sync::OnceLock<[bool; 5]> = std::sync::OnceLock::new();
    ON.get_or_init(|| match std::env::var("DS4_CUDA_GEMM") {
        Err(_) => [true; 5],
        Ok(v) if v == "0" => [false; 5],
        Ok(v) => {
            let on = |k: &str| v.split(',').any(|p| p.trim() == k);
            [on("q8"), on("f32"), on("group"), on("experts"), on("attn")]
        }
    })[kind as usize]
}

/// Whether `matmul_f32` takes this weight format.
fn f32_gemm_format(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
    )
}

/// f32 activations × `m` for `n` tokens laid out by `b`: a GEMM for batches, the
/// matvec otherwise.
fn dense_f32(
    g: &Gpu,
    m: &ds4_cuda::DeviceMatrix,
    x: u64,
    y: u64,
    b: Batch,
) -> Result<(), CudaError> {
    if b.n_tok > 1 && gemm(Gemm::F32) && f32_gemm_format(m.ty) && b.n_groups == 1 {
        g.matmul_f32(m, x, y, b)
    } else {
        let sel = MatSel {
            ids: 0,
            x_stride: b.x_tok as i64,
            y_stride: b.y_tok as i64,
        };
        g.matvec(m, x, y, b.n_tok, sel)
    }
}

impl Scratch {
    fn new(g: &Gpu, c: &Config, ctx: usize, cap: usize, att_stride: usize) -> Result<Scratch> {
        let k = c.n_expert_used;
        let ff = c.n_ff_exp;
        let ffs = c.n_ff_exp * c.n_expert_shared;
        let e = c.n_embd;
        let icap = comp_cap(ctx, 4);
        let hd = c.head_dim;
        let z = |n: usize| g.zeros::<f32>(n.max(1));
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
            y: z(cap * e)?,
            n: z(cap * e)?,
            qa: z(cap * c.q_lora_rank)?,
            qr: z(cap * c.q_lora_rank)?,
            q: z(cap * c.q_dim())?,
            kv: z(cap * hd)?,
            heads: z(cap * c.q_dim())?,
            low: z(cap * c.o_groups * c.o_lora_rank)?,
            o: z(cap * e)?,
            ckv: z(cap * 4 * hd)?,
            icv: z(cap * 4 * c.idx_head_dim)?,
            qi: z(cap * c.idx_heads * c.idx_head_dim)?,
            wt: z(cap * c.idx_heads)?,
            iscores: z(cap * icap)?,
            iscores_stride: icap,
            sel: g.zeros::<i32>((cap * c.idx_topk).max(1))?,
            att_acc: z(if cap == 1 {
                c.n_head * att_splits(att_stride) * hd
            } else {
                1
            })?,
            att_ml: z(if cap == 1 {
                2 * c.n_head * att_splits(att_stride)
            } else {
                1
            })?,
            att_stride,
            rlog: z(cap * c.n_expert)?,
            ids: g.zeros::<i32>(cap * k)?,
            rw: z(cap * k)?,
            rep: z(if cap == 1 { 1 } else { cap * k * e })?,
            g: z(cap * k * ff)?,
            u: z(cap * k * ff)?,
            mid: z(cap * k * ff)?,
            dn: z(cap * k * e)?,
            sg: z(cap * ffs)?,
            su: z(cap * ffs)?,
            smid: z(cap * ffs)?,
            sh: z(cap * e)?,
            hx: z(e)?,
            tmp: z(e)?,
            logits: z(c.vocab)?,
            group_ids: g.upload(&groups)?,
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
    /// One token (decode, captured in graphs).
    s: Work,
    /// `chunk` tokens, allocated on the first batched forward.
    batch: Option<Work>,
    /// One captured token (without / with the output head), replayed per token; all
    /// position-dependent counts are read from the device step buffer.
    graphs: [Option<TokenGraph>; 2],
    graph_numerics: Option<Numerics>,
    use_graphs: bool,
}

fn comp_cap(ctx: usize, ratio: usize) -> usize {
    ctx / ratio + 2
}

/// Device bytes per token of the batch buffers that grow with the context (attention
/// scores and indexer scores); chunks are sized so these stay within 512 MiB.
const CHUNK_SCORE_BUDGET: usize = 512 << 20;
/// Tokens per prefill chunk at most. Each chunk streams every routed expert's weights
/// once (a chunk of 512 gives each expert ~12 tokens), so longer chunks amortise the
/// weight decoding: H200 q2 prefill at 2k / 16k 3,179 / 2,552 tok/s with 512,
/// 3,927 / 2,979 with 1,024, 4,378 / 3,219 with 2,048 (bench/RESULTS.md, v10f).
const MAX_CHUNK: usize = 2048;
/// A chunk's buffers (~1 MB per token at the Flash shape) take at most this fraction
/// of the device memory free when the session is created.
const CHUNK_MEM_FRACTION: usize = 4;
/// Chunks of a decode token's attention rows (split evenly on the device by the row
/// count at that position): 8 head groups × 32 chunks fill the GPU with blocks of a
/// few rows each. A prefill batch uses one chunk per token: its tokens fill the GPU.
const ATT_SPLITS: usize = 32;

fn att_splits(att_stride: usize) -> usize {
    ATT_SPLITS.min(att_stride.max(1))
}

impl DeviceState {
    pub fn new(w: &CudaWeights, ctx: usize) -> Result<DeviceState> {
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
        let per_token = 4 * comp_cap(ctx, 4);
        let free = g.mem_info().map_or(usize::MAX, |(free, _)| free);
        let mem_chunk = free / CHUNK_MEM_FRACTION / work_bytes_per_token(c, ctx).max(1);
        let chunk = std::env::var("DS4_CUDA_PREFILL_CHUNK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(MAX_CHUNK)
            .min(CHUNK_SCORE_BUDGET / per_token)
            .min(mem_chunk)
            .clamp(1, ctx.max(1));
        let raw_cap = window + chunk;
        let mut layers = Vec::with_capacity(c.n_layer);
        for (il, l) in w.layers.iter().enumerate() {
            let r = l.ratio;
            let lanes = Config::compressor_lanes(r);
            let zeros = |n: usize| g.zeros::<f32>(n);
            let neg = |n: usize| g.upload(&vec![crate::kv::NEG_INF; n]);
            let (comp, skv, ssc) = if r != 0 {
                let f = lanes * r * lanes * hd;
                (
                    Some(zeros(comp_cap(ctx, r) * hd)?),
                    Some(zeros(f)?),
                    Some(neg(f)?),
                )
            } else {
                (None, None, None)
            };
            let (index, iskv, issc) = if c.has_indexer(il) {
                let d = c.idx_head_dim;
                let f = lanes * r * lanes * d;
                (
                    Some(zeros(comp_cap(ctx, r) * d)?),
                    Some(zeros(f)?),
                    Some(neg(f)?),
                )
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
        Ok(DeviceState {
            ctx,
            n_tokens: 0,
            window,
            raw_cap,
            chunk,
            att_stride,
            layers,
            s: Work::new(g, c, ctx, 1, att_stride)?,
            batch: None,
            graphs: [None, None],
            graph_numerics: None,
            use_graphs: !g.profiling()
                && std::env::var("DS4_CUDA_GRAPHS").map_or(true, |v| v != "0"),
        })
    }

    /// Tokens per batched prefill chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Lowers the chunk (the ring and the batch buffers stay sized for the first one).
    pub fn set_chunk(&mut self, chunk: usize) {
        self.chunk = chunk.clamp(1, self.raw_cap - self.window);
    }

    /// Runs `tokens` (at most `chunk()`) at positions `n_tokens..` as one batch; with
    /// `all_rows` the logits of every token are returned, otherwise (with `head`) the
    /// last token's.
    pub fn prefill(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        tokens: &[u32],
        head: bool,
        all_rows: bool,
    ) -> Result<Vec<f32>> {
        let n = tokens.len();
        if n == 0 || n > self.chunk {
            return Err(crate::error::EngineError::Invalid(format!(
                "prefill batch of {n} tokens (chunk {})",
                self.chunk
            )));
        }
        let g = &*w.gpu;
        if self.batch.is_none() {
            self.batch = Some(Work::new(
                g,
                &w.config,
                self.ctx,
                self.chunk,
                self.att_stride,
            )?);
        }
        let mut b = self.batch.take().expect("allocated above");
        debug_assert!(n <= b.s.cap);
        let result = (|| -> Result<Vec<f32>> {
            let steps: Vec<i32> = tokens
                .iter()
                .enumerate()
                .flat_map(|(i, &t)| [(self.n_tokens + i) as i32, t as i32])
                .collect();
            let mut view = b.s.step.slice_mut(0..steps.len());
            g.stream()
                .memcpy_htod(&steps, &mut view)
                .map_err(CudaError::from)?;
            self.enqueue_layers(w, numerics, &mut b, n)?;
            let c = &w.config;
            let row = (c.n_hc * c.n_embd * 4) as u64;
            let mut out = Vec::new();
            if all_rows {
                for t in 0..n {
                    self.head(w, numerics, g.ptr(&b.s.h) + t as u64 * row)?;
                    out.extend(g.download(&self.s.s.logits)?);
                }
            } else if head {
                self.head(w, numerics, g.ptr(&b.s.h) + (n as u64 - 1) * row)?;
                out = g.download(&self.s.s.logits)?;
            }
            Ok(out)
        })();
        self.batch = Some(b);
        let out = result?;
        self.n_tokens += n;
        Ok(out)
    }

    /// Runs one token at position `n_tokens`; with `head` the logits are computed.
    pub fn decode(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        token: u32,
        head: bool,
    ) -> Result<()> {
        let g = &*w.gpu;
        let pos = self.n_tokens as i32;
        g.write(&mut self.s.s.step, &[pos, token as i32])?;
        if self.use_graphs {
            if self.graph_numerics != Some(numerics) {
                self.graphs = [None, None];
                self.graph_numerics = Some(numerics);
            }
            let key = usize::from(head);
            if self.graphs[key].is_none() {
                g.begin_capture()?;
                let enqueued = self.enqueue_token(w, numerics, head);
                let graph = g.end_capture();
                enqueued?;
                self.graphs[key] = Some(graph?);
            }
            self.graphs[key]
                .as_ref()
                .expect("captured above")
                .launch()?;
        } else {
            self.enqueue_token(w, numerics, head)?;
        }
        self.n_tokens += 1;
        Ok(())
    }

    fn kv(&self) -> KvView<'_> {
        KvView {
            layers: &self.layers,
            window: self.window,
            raw_cap: self.raw_cap,
            ctx: self.ctx,
        }
    }

    /// Enqueues every launch of one token (the step buffer already holds pos/token).
    fn enqueue_token(&mut self, w: &CudaWeights, numerics: Numerics, head: bool) -> Result<()> {
        let kv = KvView {
            layers: &self.layers,
            window: self.window,
            raw_cap: self.raw_cap,
            ctx: self.ctx,
        };
        kv.enqueue(w, numerics, &mut self.s, 1)?;
        if head {
            let h = w.gpu.ptr(&self.s.s.h);
            head_logits(w, numerics, &mut self.s, h)?;
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
        self.kv().enqueue(w, numerics, b, n_tok)
    }

    /// The logits of the HC state at `h` into the decode scratch.
    fn head(&mut self, w: &CudaWeights, numerics: Numerics, h: u64) -> Result<()> {
        head_logits(w, numerics, &mut self.s, h)
    }

    pub fn logits(&self, w: &CudaWeights) -> Result<Vec<f32>> {
        Ok(w.gpu.download(&self.s.s.logits)?)
    }
}

/// The output head on one token's HC state `h`, into `s.logits`.
fn head_logits(w: &CudaWeights, numerics: Numerics, b: &mut Work, h: u64) -> Result<()> {
    let (s, q8) = (&b.s, &mut b.q8);
    let g = &*w.gpu;
    let c = &w.config;
    let p = |b: &DeviceBuf<f32>| g.ptr(b);
    g.hc_mix_mat(1, h, &w.head_hc.fn_, c.rms_eps, p(&s.mix))?;
    g.head_collapse(
        h,
        p(&s.mix),
        p(&w.head_hc.scale),
        p(&w.head_hc.base),
        c.n_hc,
        c.n_embd,
        c.hc_eps,
        p(&w.output_norm),
        ds4_cuda::WT_F32,
        c.rms_eps,
        p(&s.tmp),
        p(&s.hx),
    )?;
    let fast = numerics == Numerics::Fast;
    mv(
        g,
        &w.output,
        p(&s.hx),
        &mut q8.embd,
        false,
        p(&s.logits),
        1,
        fast,
    )?;
    Ok(())
}

/// The KV state as the layer launches see it.
struct KvView<'a> {
    layers: &'a [LayerState],
    window: usize,
    raw_cap: usize,
    ctx: usize,
}

/// The sublayer input `s.y` from the streams `h`, and its RMS norm (weights `norm_w`)
/// into `s.n` in the same launch; with `quantize` also into `xq` (Q8_0). Returns
/// whether `xq` now holds `s.n`.
#[allow(clippy::too_many_arguments)]
fn hc_pre_norm(
    s: &Scratch,
    n_tok: usize,
    g: &Gpu,
    c: &Config,
    hc: &super::weights::HcDev,
    h: u64,
    norm_w: u64,
    xq: &mut QuantAct,
    quantize: bool,
) -> Result<bool, CudaError> {
    if quantize && (xq.cols != c.n_embd || xq.rows < n_tok) {
        return Err(CudaError::Invalid(format!(
            "hc_pre: {n_tok}×{} into activations of {}×{}",
            c.n_embd, xq.rows, xq.cols
        )));
    }
    g.hc_mix_mat(n_tok, h, &hc.fn_, c.rms_eps, g.ptr(&s.mix))?;
    let norm = ds4_cuda::HcNorm {
        w: norm_w,
        w_type: ds4_cuda::WT_F32,
        eps: c.rms_eps,
        out: g.ptr(&s.n),
        q: if quantize { g.ptr(&xq.q) } else { 0 },
        d: if quantize { g.ptr(&xq.d) } else { 0 },
    };
    g.hc_pre(
        n_tok,
        h,
        g.ptr(&s.mix),
        g.ptr(&hc.scale),
        g.ptr(&hc.base),
        c.n_hc,
        c.n_embd,
        c.sinkhorn_iters,
        c.hc_eps,
        g.ptr(&s.y),
        g.ptr(&s.hcp),
        Some(norm),
    )?;
    Ok(quantize)
}

impl KvView<'_> {
    /// Embeds the `n_tok` tokens of `s.step` and runs every layer on them.
    fn enqueue(
        &self,
        w: &CudaWeights,
        numerics: Numerics,
        b: &mut Work,
        n_tok: usize,
    ) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        let s = &b.s;
        g.embed(
            n_tok,
            g.ptr(&s.step),
            g.ptr(&w.token_embd.buf),
            w.token_embd.ty,
            c.n_embd,
            c.n_hc,
            g.ptr(&s.h),
        )?;
        for il in 0..c.n_layer {
            self.attention(w, numerics, il, b, n_tok)?;
            self.ffn(w, numerics, il, b, n_tok)?;
        }
        Ok(())
    }

    fn attention(
        &self,
        w: &CudaWeights,
        numerics: Numerics,
        il: usize,
        b: &mut Work,
        n: usize,
    ) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        let l: &LayerDev = &w.layers[il];
        let st = &self.layers[il];
        let (s, qb) = (&b.s, &mut b.q8);
        let p = |b: &DeviceBuf<f32>| g.ptr(b);
        let step = g.ptr(&s.step);
        let rope = w.rope(il);
        let fast = numerics == Numerics::Fast;
        let f32t = ds4_cuda::WT_F32;
        let hd = c.head_dim;

        let n_q8 = hc_pre_norm(
            s,
            n,
            g,
            c,
            &l.hc_attn,
            p(&s.h),
            p(&l.attn_norm),
            &mut qb.embd,
            fast && l.q_a.ty == GgmlType::Q8_0,
        )?;
        // Three branches from the normed input, joined before attention: side lane 1
        // writes this token's raw row and compressed rows, side lane 2 the indexer's
        // compressed rows and then (once the main lane has q_r) the top-k selection,
        // and the main lane builds the queries. Each is a chain of small kernels that
        // cannot fill the GPU alone.
        g.branch(1, || {
            // The same quantised `n` as attn_q_a (quantised by the norm when Q8_0).
            mv(
                g,
                &l.kv,
                p(&s.n),
                &mut qb.embd,
                l.q_a.ty == GgmlType::Q8_0,
                p(&s.kv),
                n,
                fast,
            )?;
            g.kv_finish(
                n,
                step,
                p(&s.kv),
                p(&l.kv_norm),
                f32t,
                hd,
                c.rms_eps,
                rope,
                fast,
                p(&st.ring),
                self.raw_cap,
            )?;
            if let (Some(cw), Some(comp)) = (&l.compressor, &st.comp) {
                let ckv = p(&s.ckv);
                compressor_inputs(g, cw, p(&s.n), ckv, n)?;
                compress(
                    g,
                    c,
                    n,
                    step,
                    ckv,
                    cw,
                    st.skv.as_ref(),
                    st.ssc.as_ref(),
                    rope,
                    false,
                    fast,
                    p(comp),
                )?;
            }
            Ok(())
        })?;
        let indexer = match (&l.compressor, &l.indexer, &st.index) {
            (Some(cw), Some(ix), Some(index)) => Some((cw, ix, index)),
            _ => None,
        };
        if let Some((_, ix, index)) = indexer {
            g.branch(2, || {
                let icw = &ix.compressor;
                let icv = p(&s.icv);
                compressor_inputs(g, icw, p(&s.n), icv, n)?;
                compress(
                    g,
                    c,
                    n,
                    step,
                    icv,
                    icw,
                    st.iskv.as_ref(),
                    st.issc.as_ref(),
                    rope,
                    true,
                    fast,
                    p(index),
                )?;
                dense_f32(g, &ix.proj, p(&s.n), p(&s.wt), plain(&ix.proj, n))
            })?;
        }
        // attn_q_a reads `n` as quantised by the norm: the kv branch only quantises
        // its own copy when q_a is not Q8_0 (then q_a does not read it).
        let q_a_xq_ready = n_q8;
        mv(
            g,
            &l.q_a,
            p(&s.n),
            &mut qb.embd,
            q_a_xq_ready,
            p(&s.qa),
            n,
            fast,
        )?;
        let qr_q8 = norm(
            g,
            p(&s.qa),
            p(&l.q_a_norm),
            c.q_lora_rank,
            n,
            c.rms_eps,
            p(&s.qr),
            &mut qb.qr,
            fast && l.q_b.ty == GgmlType::Q8_0,
        )?;
        let mut sel = 0u64;
        if let Some((cw, ix, index)) = indexer {
            g.branch(2, || {
                // The indexer runs every token so one captured graph serves every
                // position: below top_k rows the kernels themselves select every row.
                let max_rows = comp_cap(self.ctx, cw.ratio);
                dense_f32(g, &ix.q_b, p(&s.qr), p(&s.qi), plain(&ix.q_b, n))?;
                g.indexer_q(n, step, p(&s.qi), c.idx_heads, c.idx_head_dim, rope)?;
                let wscale =
                    ((c.idx_head_dim as f64).powf(-0.5) * (c.idx_heads as f64).powf(-0.5)) as f32;
                debug_assert!(max_rows <= s.iscores_stride);
                g.indexer_scores(
                    n,
                    step,
                    p(index),
                    p(&s.qi),
                    p(&s.wt),
                    c.idx_heads,
                    c.idx_head_dim,
                    wscale,
                    cw.ratio,
                    c.idx_topk,
                    p(&s.iscores),
                    s.iscores_stride,
                )?;
                g.topk_select(
                    n,
                    step,
                    p(&s.iscores),
                    s.iscores_stride,
                    cw.ratio,
                    c.idx_topk,
                    g.ptr(&s.sel),
                )
            })?;
            sel = g.ptr(&s.sel);
        }
        mv(g, &l.q_b, p(&s.qr), &mut qb.qr, qr_q8, p(&s.q), n, fast)?;
        g.head_norm_rope(n, step, p(&s.q), hd, c.n_head, c.rms_eps, rope)?;
        g.join(1)?;
        if indexer.is_some() {
            g.join(2)?;
        }
        let scale = (hd as f64).powf(-0.5) as f32;
        if n > 1 && fast && gemm(Gemm::Attn) && Gpu::attention_mma_shape(c.n_head, hd) {
            g.attention_prefill_mma(
                n,
                step,
                p(&s.q),
                p(&st.ring),
                self.raw_cap,
                self.window,
                st.comp.as_ref().map_or(0, p),
                l.ratio,
                sel,
                c.idx_topk,
                p(&l.sinks),
                c.n_head,
                hd,
                scale,
                p(&s.heads),
            )?;
        } else {
            let (rows_per_chunk, n_chunks) = if n == 1 {
                (0, att_splits(s.att_stride))
            } else {
                (s.att_stride, 1)
            };
            g.attention(
                n,
                step,
                p(&s.q),
                p(&st.ring),
                self.raw_cap,
                self.window,
                st.comp.as_ref().map_or(0, p),
                l.ratio,
                sel,
                c.idx_topk,
                p(&l.sinks),
                c.n_head,
                hd,
                scale,
                rows_per_chunk,
                n_chunks,
                p(&s.att_acc),
                p(&s.att_ml),
                p(&s.heads),
            )?;
        }
        g.rope_tail(n, step, p(&s.heads), hd, c.n_head, 0, rope, true)?;
        let groups = MatSel {
            ids: g.ptr(&s.group_ids),
            x_stride: (c.q_dim() / c.o_groups) as i64,
            y_stride: c.o_lora_rank as i64,
        };
        let og = c.o_groups;
        let grouped = Batch {
            n_tok: n,
            x_tok: c.q_dim(),
            y_tok: og * c.o_lora_rank,
            n_groups: og,
            x_grp: c.q_dim() / og,
            y_grp: c.o_lora_rank,
        };
        if n > 1 && gemm(Gemm::Group) && fast && l.out_a.ty == GgmlType::Q8_0 {
            g.quantize_act_rows(p(&s.heads), &mut qb.heads, n)?;
            g.matmul_q8act(&l.out_a, &qb.heads, p(&s.low), grouped)?;
        } else if n > 1 && gemm(Gemm::Group) && !fast && f32_gemm_format(l.out_a.ty) {
            g.matmul_f32(&l.out_a, p(&s.heads), p(&s.low), grouped)?;
        } else {
            mv_sel(
                g,
                &l.out_a,
                p(&s.heads),
                &mut qb.heads,
                p(&s.low),
                n * og,
                groups,
                fast,
            )?;
        }
        mv(g, &l.out_b, p(&s.low), &mut qb.low, false, p(&s.o), n, fast)?;
        g.hc_post(
            n,
            p(&s.h),
            p(&s.o),
            0,
            0,
            p(&s.hcp),
            c.n_hc,
            c.n_embd,
            p(&s.h2),
        )?;
        Ok(())
    }

    fn ffn(
        &self,
        w: &CudaWeights,
        numerics: Numerics,
        il: usize,
        b: &mut Work,
        n: usize,
    ) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        let l: &LayerDev = &w.layers[il];
        let (s, qb) = (&b.s, &mut b.q8);
        let step = g.ptr(&s.step);
        let (k, ff, e) = (c.n_expert_used, c.n_ff_exp, c.n_embd);
        let fast = numerics == Numerics::Fast;
        let p = |b: &DeviceBuf<f32>| g.ptr(b);
        let n_q8 = hc_pre_norm(
            s,
            n,
            g,
            c,
            &l.hc_ffn,
            p(&s.h2),
            p(&l.ffn_norm),
            &mut qb.embd,
            fast && l.gate_sh.ty == GgmlType::Q8_0,
        )?;
        // The shared expert needs only the normed input: it runs on side lane 1 while
        // the router and the routed experts run on the main lane.
        g.branch(1, || {
            let ffs = c.n_ff_exp * c.n_expert_shared;
            mv(
                g,
                &l.gate_sh,
                p(&s.n),
                &mut qb.embd,
                n_q8,
                p(&s.sg),
                n,
                fast,
            )?;
            mv(
                g,
                &l.up_sh,
                p(&s.n),
                &mut qb.embd,
                l.gate_sh.ty == GgmlType::Q8_0,
                p(&s.su),
                n,
                fast,
            )?;
            let smid_q8 = fast && l.down_sh.ty == GgmlType::Q8_0;
            if smid_q8 {
                g.swiglu_quant(
                    p(&s.sg),
                    p(&s.su),
                    0,
                    ffs,
                    n,
                    c.swiglu_clamp_shexp[il],
                    p(&s.smid),
                    &mut qb.shared_mid,
                    false,
                )?;
            } else {
                g.swiglu(
                    p(&s.sg),
                    p(&s.su),
                    0,
                    ffs,
                    n,
                    c.swiglu_clamp_shexp[il],
                    p(&s.smid),
                )?;
            }
            mv(
                g,
                &l.down_sh,
                p(&s.smid),
                &mut qb.shared_mid,
                smid_q8,
                p(&s.sh),
                n,
                fast,
            )
        })?;
        dense_f32(g, &l.gate_inp, p(&s.n), p(&s.rlog), plain(&l.gate_inp, n))?;
        g.router(
            n,
            step,
            p(&s.rlog),
            c.n_expert,
            k,
            l.exp_probs_b.as_ref().map_or(0, p),
            l.tid2eid.as_ref().map_or(0, |t| g.ptr(t)),
            c.expert_weights_scale,
            g.ptr(&s.ids),
            p(&s.rw),
        )?;
        let ids = g.ptr(&s.ids);
        let int8 = |m: &ds4_cuda::DeviceMatrix| {
            numerics == Numerics::Fast
                && matches!(m.ty, GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K)
        };
        let expert_gemm = n > 1
            && b.plan.is_some()
            && int8(&l.gate_exps)
            && int8(&l.up_exps)
            && int8(&l.down_exps);
        // The matvecs' input: one shared row for a single token, otherwise one row per
        // (token, expert) pair.
        let (x_in, in_stride) = if n == 1 || expert_gemm {
            (p(&s.n), 0)
        } else {
            g.repeat_rows(p(&s.n), n, e, k, p(&s.rep))?;
            (p(&s.rep), e as i64)
        };
        let gate_up = MatSel {
            ids,
            x_stride: in_stride,
            y_stride: ff as i64,
        };
        let per_mid = MatSel {
            ids,
            x_stride: ff as i64,
            y_stride: e as i64,
        };
        let pairs = n * k;
        // Batches with int8 experts: grouped expert GEMMs over per-expert pair lists
        // (gate/up read each token's Q8_K row once for its k pairs); otherwise matvecs
        // over the (token, expert) pairs.
        let plan = match b.plan.as_mut().filter(|_| expert_gemm) {
            Some(plan) => {
                g.route_plan(ids, pairs, c.n_expert, plan)?;
                g.quantize_act_k_rows(p(&s.n), &mut qb.exp_in, n)?;
                g.matmul_experts_q8act(&l.gate_exps, &qb.exp_in, plan, k, true, p(&s.g))?;
                g.matmul_experts_q8act(&l.up_exps, &qb.exp_in, plan, k, true, p(&s.u))?;
                Some(&*plan)
            }
            None if int8(&l.gate_exps) && int8(&l.up_exps) => {
                let in_rows = if n == 1 { 1 } else { pairs };
                g.quantize_act_k_rows(x_in, &mut qb.exp_in, in_rows)?;
                g.matvec_q8act_pair(
                    &l.gate_exps,
                    &l.up_exps,
                    &qb.exp_in,
                    p(&s.g),
                    p(&s.u),
                    pairs,
                    gate_up,
                )?;
                None
            }
            None => {
                g.matvec(&l.gate_exps, x_in, p(&s.g), pairs, gate_up)?;
                g.matvec(&l.up_exps, x_in, p(&s.u), pairs, gate_up)?;
                None
            }
        };
        if int8(&l.down_exps) {
            g.swiglu_quant(
                p(&s.g),
                p(&s.u),
                p(&s.rw),
                ff,
                pairs,
                c.swiglu_clamp[il],
                p(&s.mid),
                &mut qb.exp_mid,
                true,
            )?;
            match plan {
                Some(plan) => {
                    g.matmul_experts_q8act(&l.down_exps, &qb.exp_mid, plan, k, false, p(&s.dn))?
                }
                None => g.matvec_q8act(&l.down_exps, &qb.exp_mid, p(&s.dn), pairs, per_mid)?,
            }
        } else {
            g.swiglu(
                p(&s.g),
                p(&s.u),
                p(&s.rw),
                ff,
                pairs,
                c.swiglu_clamp[il],
                p(&s.mid),
            )?;
            g.matvec(&l.down_exps, p(&s.mid), p(&s.dn), pairs, per_mid)?;
        }
        g.join(1)?;
        // The routed experts' rows summed plus the shared expert, inside hc_post.
        g.hc_post(
            n,
            p(&s.h2),
            p(&s.sh),
            p(&s.dn),
            k,
            p(&s.hcp),
            c.n_hc,
            c.n_embd,
            p(&s.h),
        )?;
        Ok(())
    }
}

/// The compressor's kv and gate projections of `n` tokens: token t's kv at
/// out + t·2w, its gate scores right after.
fn compressor_inputs(
    g: &Gpu,
    cw: &super::weights::CompressorDev,
    x: u64,
    out: u64,
    n: usize,
) -> Result<(), CudaError> {
    let width = cw.lanes * cw.dim;
    let b = Batch {
        y_tok: 2 * width,
        ..Batch::plain(n, cw.kv.cols, 0)
    };
    dense_f32(g, &cw.kv, x, out, b)?;
    dense_f32(g, &cw.gate, x, out + 4 * width as u64, b)
}

/// Advances a compressor by `n` tokens (one: the graph-captured decode step).
#[allow(clippy::too_many_arguments)]
fn compress(
    g: &Gpu,
    c: &Config,
    n: usize,
    step: u64,
    kvs: u64,
    cw: &super::weights::CompressorDev,
    skv: Option<&DeviceBuf<f32>>,
    ssc: Option<&DeviceBuf<f32>>,
    rope: ds4_cuda::RopeP,
    indexer: bool,
    fast: bool,
    rows_out: u64,
) -> Result<(), CudaError> {
    let skv = g.ptr(skv.expect("compressed layer state"));
    let ssc = g.ptr(ssc.expect("compressed layer state"));
    let f32t = ds4_cuda::WT_F32;
    if n == 1 {
        g.compressor_step(
            step,
            kvs,
            g.ptr(&cw.ape),
            f32t,
            skv,
            ssc,
            cw.ratio,
            cw.lanes,
            cw.dim,
            g.ptr(&cw.norm),
            f32t,
            c.rms_eps,
            rope,
            indexer,
            fast,
            rows_out,
        )
    } else {
        g.compressor_batch(
            n,
            step,
            kvs,
            g.ptr(&cw.ape),
            f32t,
            skv,
            ssc,
            cw.ratio,
            cw.lanes,
            cw.dim,
            g.ptr(&cw.norm),
            f32t,
            c.rms_eps,
            rope,
            indexer,
            fast,
            rows_out,
        )
    }
}

/// `n` packed input rows of `m` to `n` packed output rows.
fn plain(m: &ds4_cuda::DeviceMatrix, n: usize) -> Batch {
    Batch::plain(n, m.cols, m.rows)
}

/// A plain matrix applied to `n` consecutive input rows.
fn rows(m: &ds4_cuda::DeviceMatrix) -> MatSel {
    MatSel {
        ids: 0,
        x_stride: m.cols as i64,
        y_stride: m.rows as i64,
    }
}

impl DeviceState {
    /// The state in host form (rows in logical order, frontiers as stored).
    pub fn export(&self, w: &CudaWeights) -> Result<KvCache> {
        let g = &*w.gpu;
        let c = &w.config;
        let mut kv = KvCache::new(c, self.ctx);
        kv.n_tokens = self.n_tokens;
        let hd = c.head_dim;
        for (il, (lc, st)) in kv.layers.iter_mut().zip(&self.layers).enumerate() {
            let ring = g.download(&st.ring)?;
            let n_raw = self.n_tokens.min(self.window);
            let first = self.n_tokens - n_raw;
            let rows: Vec<f32> = (first..self.n_tokens)
                .flat_map(|pos| {
                    ring[(pos % self.raw_cap) * hd..(pos % self.raw_cap + 1) * hd]
                        .iter()
                        .copied()
                })
                .collect();
            lc.set_raw(&rows);
            let r = c.compress_ratios[il];
            if let (Some(comp), Some(skv), Some(ssc)) = (&st.comp, &st.skv, &st.ssc) {
                let n = self.n_tokens / r;
                lc.comp = g.download(comp)?[..n * hd].to_vec();
                set_frontier(lc.comp_state.as_mut(), g.download(skv)?, g.download(ssc)?);
            }
            if let (Some(index), Some(iskv), Some(issc)) = (&st.index, &st.iskv, &st.issc) {
                let n = self.n_tokens / r;
                lc.index = g.download(index)?[..n * c.idx_head_dim].to_vec();
                set_frontier(
                    lc.index_state.as_mut(),
                    g.download(iskv)?,
                    g.download(issc)?,
                );
            }
        }
        Ok(kv)
    }

    /// Loads a host-form state.
    pub fn import(&mut self, w: &CudaWeights, kv: &KvCache) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        if kv.ctx > self.ctx || kv.layers.len() != self.layers.len() {
            return Err(crate::error::EngineError::Invalid(format!(
                "state for ctx {} / {} layers does not fit this session (ctx {})",
                kv.ctx,
                kv.layers.len(),
                self.ctx
            )));
        }
        let hd = c.head_dim;
        for (lc, st) in kv.layers.iter().zip(self.layers.iter_mut()) {
            let n_raw = lc.n_raw();
            let mut ring = vec![0.0f32; self.raw_cap * hd];
            for i in 0..n_raw {
                let pos = kv.n_tokens - n_raw + i;
                let slot = pos % self.raw_cap;
                ring[slot * hd..(slot + 1) * hd].copy_from_slice(lc.raw_row(i));
            }
            g.write(&mut st.ring, &ring)?;
            if let (Some(comp), Some(skv), Some(ssc), Some(f)) =
                (&mut st.comp, &mut st.skv, &mut st.ssc, &lc.comp_state)
            {
                write_prefix(g, comp, &lc.comp)?;
                g.write(skv, &f.kv)?;
                g.write(ssc, &f.score)?;
            }
            if let (Some(index), Some(iskv), Some(issc), Some(f)) =
                (&mut st.index, &mut st.iskv, &mut st.issc, &lc.index_state)
            {
                write_prefix(g, index, &lc.index)?;
                g.write(iskv, &f.kv)?;
                g.write(issc, &f.score)?;
            }
        }
        self.n_tokens = kv.n_tokens;
        Ok(())
    }

    /// An independent copy (a snapshot of the session), copied on the device: only the
    /// compressed rows in use move, so a long session snapshots in milliseconds instead
    /// of a host round trip.
    pub fn duplicate(&self, w: &CudaWeights) -> Result<DeviceState> {
        let mut d = DeviceState::new(w, self.ctx)?;
        if d.raw_cap != self.raw_cap || d.layers.len() != self.layers.len() {
            // The ring geometry changed (DS4_CUDA_PREFILL_CHUNK differs): go through the
            // host form, which is independent of it.
            d.import(w, &self.export(w)?)?;
            return Ok(d);
        }
        let g = &*w.gpu;
        let c = &w.config;
        let copy = |src: &DeviceBuf<f32>, dst: &mut DeviceBuf<f32>, n: usize| {
            let n = n.min(src.len()).min(dst.len());
            if n == 0 {
                return Ok::<(), CudaError>(());
            }
            Ok(g.stream()
                .memcpy_dtod(&src.slice(0..n), &mut dst.slice_mut(0..n))?)
        };
        for (il, (src, dst)) in self.layers.iter().zip(d.layers.iter_mut()).enumerate() {
            copy(&src.ring, &mut dst.ring, src.ring.len())?;
            let r = c.compress_ratios[il].max(1);
            let n_comp = self.n_tokens / r;
            let pairs = [
                (&src.comp, &mut dst.comp, n_comp * c.head_dim),
                (&src.skv, &mut dst.skv, usize::MAX),
                (&src.ssc, &mut dst.ssc, usize::MAX),
                (&src.index, &mut dst.index, n_comp * c.idx_head_dim),
                (&src.iskv, &mut dst.iskv, usize::MAX),
                (&src.issc, &mut dst.issc, usize::MAX),
            ];
            for (s, t, n) in pairs {
                if let (Some(s), Some(t)) = (s, t) {
                    copy(s, t, n)?;
                }
            }
        }
        d.n_tokens = self.n_tokens;
        d.chunk = self.chunk;
        g.synchronize()?;
        Ok(d)
    }
}

/// `rows` RMS norms into `y`; with `quantize` also into `xq` (Q8_0) in the same launch.
/// Returns whether `xq` now holds `y`.
#[allow(clippy::too_many_arguments)]
fn norm(
    g: &Gpu,
    x: u64,
    w: u64,
    n: usize,
    rows: usize,
    eps: f32,
    y: u64,
    xq: &mut QuantAct,
    quantize: bool,
) -> Result<bool, CudaError> {
    if quantize {
        g.rmsnorm_q8(x, w, ds4_cuda::WT_F32, n, rows, eps, y, xq)?;
    } else {
        g.rmsnorm(x, w, ds4_cuda::WT_F32, n, rows, eps, y)?;
    }
    Ok(quantize)
}

/// One projection of `n` input rows: in the fast numerics a Q8_0 weight gets its input
/// quantised to Q8_0 first (into `xq`, which `quantized` says already holds `x`), as on
/// the CPU.
#[allow(clippy::too_many_arguments)]
fn mv(
    g: &Gpu,
    m: &ds4_cuda::DeviceMatrix,
    x: u64,
    xq: &mut QuantAct,
    quantized: bool,
    y: u64,
    n: usize,
    fast: bool,
) -> Result<(), CudaError> {
    if fast && m.ty == GgmlType::Q8_0 {
        if !quantized {
            g.quantize_act_rows(x, xq, n)?;
        }
        if n > 1 && gemm(Gemm::Q8) {
            g.matmul_q8act(m, xq, y, Batch::plain(n, xq.cols, m.rows))
        } else {
            g.matvec_q8act(m, xq, y, n, rows(m))
        }
    } else {
        dense_f32(g, m, x, y, plain(m, n))
    }
}

/// A selected / grouped projection (`n_sel` selections, inputs at sel.x_stride).
#[allow(clippy::too_many_arguments)]
fn mv_sel(
    g: &Gpu,
    m: &ds4_cuda::DeviceMatrix,
    x: u64,
    xq: &mut QuantAct,
    y: u64,
    n_sel: usize,
    sel: MatSel,
    fast: bool,
) -> Result<(), CudaError> {
    if fast && m.ty == GgmlType::Q8_0 {
        let rows_q = (n_sel * sel.x_stride as usize).div_ceil(xq.cols);
        g.quantize_act_rows(x, xq, rows_q)?;
        g.matvec_q8act(m, xq, y, n_sel, sel)
    } else {
        g.matvec(m, x, y, n_sel, sel)
    }
}

fn set_frontier(f: Option<&mut Frontier>, kv: Vec<f32>, score: Vec<f32>) {
    if let Some(f) = f {
        f.kv = kv;
        f.score = score;
    }
}

fn write_prefix(g: &Gpu, dst: &mut DeviceBuf<f32>, src: &[f32]) -> Result<(), CudaError> {
    if src.is_empty() {
        return Ok(());
    }
    let mut view = dst.slice_mut(0..src.len());
    Ok(g.stream().memcpy_htod(src, &mut view)?)
}
