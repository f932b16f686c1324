//! Launchers of the layer kernels (kernels/layer.cu and its neighbours
//! layer_attention.cu, layer_indexer.cu, layer_kv.cu, layer_moe.cu). Arguments are raw
//! device addresses (`u64`) so that a whole token's launches have stable parameters and can
//! be captured in a CUDA graph; the engine's CUDA backend owns the buffers.

// Each launcher takes exactly its kernel's parameters; grouping them into structs
// would only move the same list elsewhere.
#![allow(clippy::too_many_arguments)]

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use crate::device::Gpu;
use crate::error::CudaError;
use crate::plan::{Launcher, Variant};
use crate::weights::DeviceMatrix;
use ds4_gguf::GgmlType;

/// Storage type codes of small dense tensors passed to the layer kernels.
pub const WT_F32: i32 = crate::consts::WT_F32;
pub const WT_F16: i32 = crate::consts::WT_F16;
pub const WT_BF16: i32 = crate::consts::WT_BF16;
pub const WT_Q8_0: i32 = 8;

/// The most rows `hc_mix_tc` takes (its 3 n-tiles of 8; the model's mix has 24). Its
/// blocks are 16 tokens each (`HX_TOK` in `kernels/hc_mix_tc.cu`).
const HC_MIX_TC_ROWS: usize = 24;

/// RoPE parameters (mirrors `RopeP` in layer.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RopeP {
    /// Device address of `rope_dim / 2` f32 frequencies.
    pub freqs: u64,
    pub rope_dim: i32,
    pub pad: i32,
}

// SAFETY: repr(C) plain data matching the CUDA struct.
unsafe impl DeviceRepr for RopeP {}

pub(crate) fn cfg(grid: u32, block: u32) -> LaunchConfig {
    cfg2(grid, 1, block)
}

// Most hyper-connection streams the kernels take (HC_MAX), value groups of 4 per
// thread in hc_pre (HC_PRE_VEC).
use crate::consts::{
    HCG_MIX, HCG_PARTS, HCG_POST_THREADS, HCG_START_THREADS, HCG_STREAMS, HC_MAX, HC_PRE_VEC,
};

/// A hyper-connection's per-layer weights (`scale`, `base`, device addresses of F32
/// values) and the model's HC sizes: what `hc_pre`, `hc_comb` and `head_collapse` share.
#[derive(Clone, Copy, Debug)]
pub struct HcParams {
    pub scale: u64,
    pub base: u64,
    /// Streams.
    pub n_hc: usize,
    pub n_embd: usize,
    pub eps: f32,
    /// Sinkhorn iterations of the comb matrix.
    pub iters: usize,
}

/// The sublayer RMS norm fused into `hc_pre`: `out = rmsnorm(y)·w` per token and, with
/// `q` / `d` ≠ 0, its Q8_0 form (int8 values, one f32 scale per 32).
#[derive(Clone, Copy, Debug, Default)]
pub struct HcNorm {
    pub w: u64,
    pub w_type: i32,
    pub eps: f32,
    pub out: u64,
    pub q: u64,
    pub d: u64,
}

/// A KV compressor's launch ([`Launcher::compressor`]; device addresses): `kvs[t]` =
/// the token's new kv (lanes·d) then its new gate scores (lanes·d); `ape` (type
/// `ape_type`) the positional bias, `skv` / `ssc` the frontier state, `ratio` tokens per
/// row over `lanes` lanes of `d` values; each completed row is RMS-normed (`norm_w` of
/// `norm_type`, `eps`), roped, (`indexer`: Hadamard and FP4; `f16_round`: rounded to
/// f16) and written to `rows` at its row index.
#[derive(Clone, Copy, Debug)]
pub struct Compressor {
    pub step: u64,
    pub kvs: u64,
    pub ape: u64,
    pub ape_type: i32,
    pub skv: u64,
    pub ssc: u64,
    pub ratio: usize,
    pub lanes: usize,
    pub d: usize,
    pub norm_w: u64,
    pub norm_type: i32,
    pub eps: f32,
    pub rope: RopeP,
    pub indexer: bool,
    pub f16_round: bool,
    pub rows: u64,
    /// A batched step over several sessions: the rows' KV table (`KVT_*`) offset to this
    /// compressor's state fields (`KVT_SKV` or `KVT_ISKV`); `skv`, `ssc` and `rows` are
    /// then unused. 0: one session.
    pub kvt: u64,
}

/// Whether `hc_gram`'s kernels take this boundary: the model's `HCG_STREAMS` streams of
/// a multiple of 32 values and a mix of `HCG_MIX` F32 / F16 / BF16 rows over them.
pub fn hc_gram_fits(n_hc: usize, n_embd: usize, fn_: &DeviceMatrix) -> bool {
    hc_gram_code(n_hc, n_embd, fn_).is_ok()
}

/// Floats of `hc_post_gram`'s shares for `n_tok` tokens of `n_embd` columns.
pub fn hc_gram_floats(n_tok: usize, n_embd: usize) -> usize {
    n_tok * n_embd.div_ceil(HCG_POST_THREADS) * HCG_PARTS
}

/// The mix weights' type code for the `hc_gram` kernels, or why they do not fit.
fn hc_gram_code(n_hc: usize, n_embd: usize, m: &DeviceMatrix) -> Result<i32, CudaError> {
    let code = match m.ty {
        GgmlType::F32 => WT_F32,
        GgmlType::F16 => WT_F16,
        GgmlType::BF16 => WT_BF16,
        _ => -1,
    };
    if code < 0
        || n_hc != HCG_STREAMS
        || !n_embd.is_multiple_of(32)
        || m.rows != HCG_MIX
        || m.cols != n_hc * n_embd
        || m.n_mats != 1
    {
        return Err(CudaError::Invalid(format!(
            "hc_gram: {n_hc} streams of {n_embd}, a {} mix of {}×{} (takes {HCG_STREAMS} streams of a multiple of 32 and {HCG_MIX} F32/F16/BF16 rows)",
            m.ty, m.rows, m.cols
        )));
    }
    Ok(code)
}

/// The hyper-connection kernels keep a token's streams in fixed register arrays.
fn check_hc_streams(n_hc: usize) -> Result<(), CudaError> {
    if n_hc > HC_MAX {
        return Err(CudaError::Invalid(format!(
            "{n_hc} hyper-connection streams > {HC_MAX}"
        )));
    }
    Ok(())
}

/// Fewest tokens of a launch that `hc_post_x4` (variant `wide`) takes: prefill chunks.
/// Decode and the steps over sessions keep `hc_post_pl`'s one value a thread: at 16
/// tokens its 4× more threads were faster (16 sessions 30.3 → 31.0 ms a step with 16).
pub(crate) const WIDE_MIN_TOKENS: usize = 64;

/// Threads a block of the `layer_wide.cu` kernels (one token a block).
pub(crate) const WIDE_THREADS: u32 = 512;

/// Whether the `layer_wide.cu` RoPE kernels take heads of `hd` with this RoPE tail: the
/// tail starts on a 4-value boundary inside the head, and its pairs fit the token's
/// shared-memory table (WIDE_ROPE_PAIRS).
pub(crate) fn wide_rope_fits(hd: usize, rope: RopeP) -> bool {
    let rd = rope.rope_dim;
    rd >= 0 && rd % 4 == 0 && rd as usize <= hd && rd / 2 <= 128
}

/// The grid of a `layer_wide.cu` kernel: one block a token (x), and for a few tokens
/// the token's work split over up to `max_split` blocks (y) so that the launch still
/// fills the GPU.
pub(crate) fn wide_grid(n_tok: usize, max_split: usize) -> LaunchConfig {
    let split = (256 / n_tok.max(1)).clamp(1, max_split.max(1));
    LaunchConfig {
        grid_dim: ((n_tok as u32).max(1), split as u32, 1),
        block_dim: (WIDE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `tokens` blocks in y: the token of a batch (per-token kernels).
pub(crate) fn cfg2(grid: u32, tokens: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.max(1), (tokens as u32).max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Launcher<'_> {
    /// H[t][s] = embedding row of `step[t].token`, for every stream s and each of
    /// `n_tok` tokens.
    pub fn embed(
        &self,
        n_tok: usize,
        step: u64,
        table: u64,
        ty: i32,
        n_embd: usize,
        n_hc: usize,
        h: u64,
    ) -> Result<(), CudaError> {
        let (ne, nh) = (n_embd as i32, n_hc as i32);
        launch!(self, "embed", cfg2((n_embd as u32).div_ceil(256), n_tok, 256);
            step, table, ty, ne, nh, h
        )
    }

    /// mix[t][k] = rms_scale(h[t]) · (fn_k · h[t]) for k < n_out; h[t] has n values.
    pub fn hc_mix(
        &self,
        n_tok: usize,
        h: u64,
        n: usize,
        fn_: u64,
        fn_type: i32,
        eps: f32,
        mix: u64,
        n_out: usize,
    ) -> Result<(), CudaError> {
        let n = n as i32;
        let name = self.pick(Variant::HcPreload, "hc_mix", "hc_mix_pl");
        launch!(self, name, cfg2(n_out as u32, n_tok, 1024); h, n, fn_, fn_type, eps, mix)
    }

    /// [`Launcher::hc_mix`] with the weights as a matrix (`n_out` rows of `n` = m.cols, F32 /
    /// F16 / BF16): a batch of F16 weights of ≤ 24 rows runs `hc_mix_tc` (variant
    /// `hc_mix_tc`: one pass over H, dots and sums of squares together); other batches
    /// run the dots as one GEMM (each weight row read once per tile of tokens instead
    /// of once per token) and then scale them per token.
    pub fn hc_mix_mat(
        &self,
        n_tok: usize,
        h: u64,
        m: &DeviceMatrix,
        eps: f32,
        mix: u64,
    ) -> Result<(), CudaError> {
        let code = match m.ty {
            GgmlType::F32 => WT_F32,
            GgmlType::F16 => WT_F16,
            GgmlType::BF16 => WT_BF16,
            other => {
                return Err(CudaError::Invalid(format!(
                    "hyper-connection mix weights of type {other}"
                )))
            }
        };
        if m.rows > 256 || m.n_mats != 1 {
            return Err(CudaError::Invalid(format!(
                "hyper-connection mix of {} outputs × {} matrices",
                m.rows, m.n_mats
            )));
        }
        // A few tokens (decode, a multi-row step): per token, as the GEMM's tiles
        // would mostly idle (80 µs against 15 µs for two tokens on the H200).
        if n_tok <= crate::Q8_TOKENS_MAX || !h.is_multiple_of(16) || !m.cols.is_multiple_of(8) {
            return self.hc_mix(
                n_tok,
                h,
                m.cols,
                m.part_ptr(self, 0),
                code,
                eps,
                mix,
                m.rows,
            );
        }
        if self.on(Variant::HcMixTc)
            && m.ty == GgmlType::F16
            && m.rows <= HC_MIX_TC_ROWS
            && m.cols.is_multiple_of(64)
        {
            let (n, rows, nt) = (m.cols as i32, m.rows as i32, n_tok as i32);
            let (x_tok, y_tok) = (m.cols as i64, m.rows as i64);
            let w = m.part_ptr(self, 0);
            return launch!(self, "hc_mix_tc", cfg(n_tok.div_ceil(16) as u32, 256);
                h, x_tok, n, w, rows, eps, mix, y_tok, nt);
        }
        self.matmul_f32(m, h, mix, crate::Batch::plain(n_tok, m.cols, m.rows))?;
        let (n, n_out) = (m.cols as i32, m.rows as i32);
        launch!(self, "hc_mix_scale", cfg2(n_tok as u32, 1, 256); h, n, eps, mix, n_out)
    }

    /// The sublayer input `y` (pre-weighted sum of the streams) and, with `norm`, its RMS
    /// norm (and Q8_0 form), per token. post and comb come from `hc_comb`.
    pub fn hc_pre(
        &self,
        n_tok: usize,
        (h, mix): (u64, u64),
        hp: &HcParams,
        y: u64,
        norm: Option<HcNorm>,
    ) -> Result<(), CudaError> {
        let HcParams {
            scale,
            base,
            n_hc,
            n_embd,
            eps,
            ..
        } = *hp;
        check_hc_streams(n_hc)?;
        // Threads own 4 consecutive values (8 of them form a Q8_0 block); the count is
        // rmsnorm's, whose sum order the norm keeps.
        let threads = if n_embd >= 1024 { 1024 } else { 256 };
        if !n_embd.is_multiple_of(32) || n_embd > 4 * HC_PRE_VEC * threads {
            return Err(CudaError::Invalid(format!(
                "hc_pre: {n_embd} values (a multiple of 32, at most {})",
                4 * HC_PRE_VEC * 1024
            )));
        }
        let (nh, ne) = (n_hc as i32, n_embd as i32);
        let nm = norm.unwrap_or_default();
        let name = self.pick(Variant::HcPreload, "hc_pre", "hc_pre_pl");
        launch!(self, name, cfg2(1, n_tok, threads as u32);
            h, mix, scale, base, nh, ne, eps, y, nm.w, nm.w_type, nm.eps, nm.out, nm.q, nm.d
        )
    }

    /// post (`n_hc` values) and the Sinkhorn-normalised comb matrix (`n_hc²`) of each of
    /// `n_tok` tokens from their mix into `hcp`: what hc_post needs and hc_pre does not
    /// (the engine runs it on a side lane).
    pub fn hc_comb(
        &self,
        n_tok: usize,
        mix: u64,
        hp: &HcParams,
        hcp: u64,
    ) -> Result<(), CudaError> {
        let HcParams {
            scale,
            base,
            n_hc,
            eps,
            iters,
            ..
        } = *hp;
        check_hc_streams(n_hc)?;
        let (nh, it, nt) = (n_hc as i32, iters as i32, n_tok as i32);
        launch!(self, "hc_comb", cfg(n_tok.div_ceil(8) as u32, 256);
            mix, scale, base, nh, it, eps, hcp, nt
        )
    }

    /// H'_j = out·post_j + Σ_i comb[i][j]·H_i per token, post and comb from `hcp`.
    /// With `parts` ≠ 0 the sublayer output is the sum of the token's `n_parts` rows
    /// there (k ascending) plus `out`: the routed experts and the shared expert.
    #[allow(clippy::too_many_arguments)]
    pub fn hc_post(
        &self,
        n_tok: usize,
        h: u64,
        out: u64,
        parts: u64,
        n_parts: usize,
        hcp: u64,
        n_hc: usize,
        n_embd: usize,
        h_out: u64,
    ) -> Result<(), CudaError> {
        check_hc_streams(n_hc)?;
        let (nh, ne, np) = (n_hc as i32, n_embd as i32, n_parts as i32);
        if self.on(Variant::Wide) && n_tok >= WIDE_MIN_TOKENS && n_embd.is_multiple_of(4) {
            return launch!(self, "hc_post_x4", cfg2((n_embd as u32 / 4).div_ceil(256), n_tok, 256);
                h, out, parts, np, hcp, nh, ne, h_out
            );
        }
        let name = self.pick(Variant::HcPreload, "hc_post", "hc_post_pl");
        launch!(self, name, cfg2((n_embd as u32).div_ceil(256), n_tok, 256);
            h, out, parts, np, hcp, nh, ne, h_out
        )
    }

    /// [`Launcher::hc_post`] (bit-identical H') that also forms, per block of
    /// `HCG_POST_THREADS` columns, the next sublayer's share of its mix dots (`fn_`, its
    /// mix weights) and of the streams' Gram products, into `gram`
    /// ([`hc_gram_floats`] floats): variant `hc_gram`, ended by
    /// [`Launcher::hc_start_gram`]. Shapes: [`hc_gram_fits`].
    #[allow(clippy::too_many_arguments)]
    pub fn hc_post_gram(
        &self,
        n_tok: usize,
        (h, out): (u64, u64),
        (parts, n_parts): (u64, usize),
        hcp: u64,
        n_embd: usize,
        h_out: u64,
        fn_: &DeviceMatrix,
        gram: u64,
    ) -> Result<(), CudaError> {
        let code = hc_gram_code(HCG_STREAMS, n_embd, fn_)?;
        let (ne, np) = (n_embd as i32, n_parts as i32);
        let w = fn_.part_ptr(self, 0);
        let blocks = n_embd.div_ceil(HCG_POST_THREADS) as u32;
        launch!(self, "hc_post_gram", cfg2(blocks, n_tok, HCG_POST_THREADS as u32);
            h, out, parts, np, hcp, ne, h_out, w, code, gram
        )
    }

    /// [`Launcher::hc_post_gram`]'s shares of the streams `h` as they are (no hc_post: a
    /// sublayer start that no `hc_post_gram` prepared), the same sums over the same
    /// values, so a start has the same bits either way.
    pub fn hc_gram_shares(
        &self,
        n_tok: usize,
        h: u64,
        n_embd: usize,
        fn_: &DeviceMatrix,
        gram: u64,
    ) -> Result<(), CudaError> {
        let code = hc_gram_code(HCG_STREAMS, n_embd, fn_)?;
        let ne = n_embd as i32;
        let w = fn_.part_ptr(self, 0);
        let blocks = n_embd.div_ceil(HCG_POST_THREADS) as u32;
        launch!(self, "hc_gram_shares", cfg2(blocks, n_tok, HCG_POST_THREADS as u32);
            h, ne, w, code, gram
        )
    }

    /// The next sublayer's start from [`Launcher::hc_post_gram`]'s shares: the mix into
    /// `mix` (for `hc_comb`), and [`Launcher::hc_pre`]'s norm (`norm.out`, with `norm.q`
    /// its Q8_0 form) from the streams `h` (hc_post_gram's `h_out`). `mix_eps` is the
    /// mix's RMS epsilon (`hc_mix`'s `eps`), `hp.eps` pre's.
    pub fn hc_start_gram(
        &self,
        n_tok: usize,
        (h, gram): (u64, u64),
        hp: &HcParams,
        mix_eps: f32,
        mix: u64,
        norm: HcNorm,
    ) -> Result<(), CudaError> {
        let HcParams {
            scale,
            base,
            n_hc,
            n_embd,
            eps,
            ..
        } = *hp;
        if n_hc != HCG_STREAMS || !n_embd.is_multiple_of(32) {
            return Err(CudaError::Invalid(format!(
                "hc_start_gram: {n_hc} streams of {n_embd} (takes {HCG_STREAMS} of a multiple of 32)"
            )));
        }
        let nb = n_embd.div_ceil(HCG_POST_THREADS) as i32;
        let ne = n_embd as i32;
        let blocks = n_embd.div_ceil(4 * HCG_START_THREADS) as u32;
        launch!(self, "hc_start_gram", cfg2(blocks, n_tok, HCG_START_THREADS as u32);
            h, gram, nb, scale, base, ne, eps, mix_eps, mix, norm.w, norm.w_type, norm.eps,
            norm.out, norm.q, norm.d
        )
    }

    /// `rows` independent RMS norms of n values; `w = 0` for the unweighted norm.
    pub fn rmsnorm(
        &self,
        x: u64,
        w: u64,
        w_type: i32,
        n: usize,
        rows: usize,
        eps: f32,
        y: u64,
    ) -> Result<(), CudaError> {
        let n = n as i32;
        let block = if n >= 1024 { 1024 } else { 256 };
        launch!(self, "rmsnorm", cfg(rows as u32, block); x, w, w_type, n, eps, y)
    }

    /// RoPE on the tail of `rows` vectors of `stride` floats per token, at the token's
    /// position + offset.
    pub fn rope_tail(
        &self,
        n_tok: usize,
        step: u64,
        x: u64,
        stride: usize,
        rows: usize,
        pos_offset: i32,
        rope: RopeP,
        inverse: bool,
    ) -> Result<(), CudaError> {
        let (st, inv) = (stride as i32, inverse as i32);
        launch!(self, "rope_tail", cfg2(rows as u32, n_tok, 64);
            step, x, st, pos_offset, rope, inv
        )
    }

    /// Unweighted RMS norm of each of `rows` head rows of `stride` floats per token,
    /// then RoPE on their tails at the token's position (rmsnorm + rope_tail fused).
    #[allow(clippy::too_many_arguments)]
    pub fn head_norm_rope(
        &self,
        n_tok: usize,
        step: u64,
        x: u64,
        stride: usize,
        rows: usize,
        eps: f32,
        rope: RopeP,
    ) -> Result<(), CudaError> {
        let st = stride as i32;
        if self.on(Variant::Wide)
            && stride.is_multiple_of(128)
            && stride <= 512
            && wide_rope_fits(stride, rope)
        {
            let heads = rows as i32;
            let grid = wide_grid(n_tok, rows / (WIDE_THREADS as usize / 32));
            return launch!(self, "head_norm_rope_t", grid; step, x, st, heads, eps, rope);
        }
        launch!(self, "head_norm_rope", cfg2(rows as u32, n_tok, 256); step, x, st, eps, rope)
    }

    /// Normalises, rotates and QAT-rounds each token's new KV row into ring slot
    /// pos % raw_cap.
    pub fn kv_finish(
        &self,
        n_tok: usize,
        step: u64,
        kv: u64,
        norm_w: u64,
        norm_type: i32,
        hd: usize,
        eps: f32,
        rope: RopeP,
        f16_round: bool,
        ring: u64,
        raw_cap: usize,
        kvt: u64,
    ) -> Result<(), CudaError> {
        if hd > 1024 {
            return Err(CudaError::Invalid(format!("head dim {hd} > 1024")));
        }
        let (hd_, fr, rc) = (hd as i32, f16_round as i32, raw_cap as i32);
        launch!(self, "kv_finish", cfg2(1, n_tok, 512);
            step, kv, norm_w, norm_type, hd_, eps, rope, fr, ring, rc, kvt
        )
    }

    /// The KV compressor over `n_tok` tokens starting at step[0].pos: one token
    /// through `compressor_step`; a batch emits every row completed in it
    /// (`compressor_emit`), then advances the frontier state (`compressor_state`),
    /// exactly as `compressor_step` per token.
    pub fn compressor(&self, n_tok: usize, c: &Compressor) -> Result<(), CudaError> {
        let (ratio, lanes, d) = (c.ratio, c.lanes, c.d);
        if d > 1024 || (c.indexer && !d.is_power_of_two()) {
            return Err(CudaError::Invalid(format!(
                "compressor width {d} unsupported"
            )));
        }
        if n_tok == 1 || c.kvt != 0 {
            // One token, or one token of each row's own session (a batched step over
            // several sessions: every row advances its own frontier).
            let grid = cfg2(1, n_tok, 1024);
            return self.compressor_launch("compressor_step", grid, None, c, true);
        }
        if ratio == 0 || !(1..=2).contains(&lanes) {
            return Err(CudaError::Invalid(format!(
                "compressor width {d} / ratio {ratio} / {lanes} lanes unsupported"
            )));
        }
        // Rows completed in the batch: at most n_tok / ratio + 1.
        let emits = (n_tok / ratio + 1) as u32;
        let nt = Some(n_tok as i32);
        self.compressor_launch("compressor_emit", cfg(emits, 1024), nt, c, true)?;
        let cells = (ratio * lanes * d) as u32;
        let grid = cfg(cells.div_ceil(256).min(4096), 256);
        self.compressor_launch("compressor_state", grid, nt, c, false)
    }

    /// Launches a compressor kernel: `step`, then (batch kernels) `n_tok`, then the
    /// state arguments through `d`, then (with `rows`) the row-finishing arguments.
    fn compressor_launch(
        &self,
        name: &'static str,
        grid: LaunchConfig,
        n_tok: Option<i32>,
        c: &Compressor,
        rows: bool,
    ) -> Result<(), CudaError> {
        let (r, l, dd) = (c.ratio as i32, c.lanes as i32, c.d as i32);
        let (mode, fr) = (c.indexer as i32, c.f16_round as i32);
        let f = self.func(name)?;
        self.timed(name, || {
            let mut b = self.launch_stream().launch_builder(&f);
            b.arg(&c.step);
            if let Some(nt) = &n_tok {
                b.arg(nt);
            }
            b.arg(&c.kvs)
                .arg(&c.ape)
                .arg(&c.ape_type)
                .arg(&c.skv)
                .arg(&c.ssc);
            b.arg(&r).arg(&l).arg(&dd);
            if rows {
                b.arg(&c.norm_w).arg(&c.norm_type).arg(&c.eps).arg(&c.rope);
                b.arg(&mode).arg(&fr).arg(&c.rows);
            }
            if name == "compressor_step" {
                b.arg(&c.kvt);
            }
            // SAFETY: the parameters of compressor_step / _emit / _state in
            // layer_kv.cu, in order and with the same types; buffer sizes are the
            // caller's contract (see Compressor).
            unsafe { b.launch(grid) }?;
            Ok(())
        })
    }

    /// Expert selection and weights of each token (`tid2eid = 0`: top-k routing,
    /// `bias = 0`: none); token t's ids/weights at t · k.
    pub fn router(
        &self,
        n_tok: usize,
        step: u64,
        logits: u64,
        n_expert: usize,
        k: usize,
        bias: u64,
        tid2eid: u64,
        wscale: f32,
        ids: u64,
        weights: u64,
    ) -> Result<(), CudaError> {
        if n_expert > 512 || k > 64 {
            return Err(CudaError::Invalid(format!(
                "{n_expert} experts / {k} used: at most 512 / 64"
            )));
        }
        let (ne, kk) = (n_expert as i32, k as i32);
        let name = if self.on(Variant::RouterSplit) {
            "router_split"
        } else {
            self.pick(Variant::Router4, "router", "router_wide")
        };
        launch!(self, name, cfg(n_tok as u32, 512);
            step, logits, ne, kk, bias, tid2eid, wscale, ids, weights
        )
    }

    /// mid = silu(min(g, c))·clamp(u, ±c)·w_k over n_sel rows of n (`weights = 0`: 1).
    pub fn swiglu(
        &self,
        gate: u64,
        up: u64,
        weights: u64,
        n: usize,
        n_sel: usize,
        clamp: f32,
        mid: u64,
    ) -> Result<(), CudaError> {
        let (nn, ns) = (n as i32, n_sel as i32);
        launch!(self, "swiglu", cfg(((n * n_sel) as u32).div_ceil(256), 256);
            gate, up, weights, nn, ns, clamp, mid
        )
    }

    /// dst[t·k + j] = src[t] for j < k: each of `n` rows of `width` floats repeated k
    /// times (the routed experts' per-pair inputs of a batch).
    pub fn repeat_rows(
        &self,
        src: u64,
        n: usize,
        width: usize,
        k: usize,
        dst: u64,
    ) -> Result<(), CudaError> {
        let (w, kk) = (width as i32, k as i32);
        launch!(self, "repeat_rows", cfg2((width as u32).div_ceil(256), n * k, 256);
            src, w, kk, dst
        )
    }

    /// The head's stream collapse and final norm into `x`.
    pub fn head_collapse(
        &self,
        (h, mix): (u64, u64),
        hp: &HcParams,
        norm_w: u64,
        norm_type: i32,
        eps: f32,
        tmp: u64,
        x: u64,
    ) -> Result<(), CudaError> {
        let HcParams {
            scale,
            base,
            n_hc,
            n_embd,
            eps: hc_eps,
            ..
        } = *hp;
        let (nh, ne) = (n_hc as i32, n_embd as i32);
        launch!(self, "head_collapse", cfg(1, 1024);
            h, mix, scale, base, nh, ne, hc_eps, norm_w, norm_type, eps, tmp, x
        )
    }
}

impl Launcher<'_> {
    /// The undo record of a multi-row step (kernels/rows.cu): `items` holds `n_items`
    /// entries of five i64 `{state, saved, floats, ring_cap, row}` (device pointers and
    /// counts). Saves (`restore` false) or restores the ring slots of the step's rows
    /// `first..n_rows` (positions in `step`) and the whole buffers. The pointers must
    /// stay valid and the saved buffers hold `n_rows × row` / `floats` values (caller).
    pub fn rows_undo(
        &self,
        items: u64,
        n_items: usize,
        step: u64,
        (first, n_rows): (usize, usize),
        restore: bool,
    ) -> Result<(), CudaError> {
        let (ni, f, n, r) = (n_items as i32, first as i32, n_rows as i32, restore as i32);
        let grid = LaunchConfig {
            grid_dim: (n_items.max(1) as u32, 32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "rows_undo", grid; items, ni, step, f, n, r)
    }
}

impl Gpu {
    /// Copies host values into a device buffer.
    pub fn write<T: DeviceRepr>(
        &self,
        dst: &mut cudarc::driver::CudaSlice<T>,
        src: &[T],
    ) -> Result<(), CudaError> {
        Ok(self.stream.memcpy_htod(src, dst)?)
    }

    /// Device-to-device copy of a whole buffer.
    pub fn copy<T: DeviceRepr>(
        &self,
        src: &cudarc::driver::CudaSlice<T>,
        dst: &mut cudarc::driver::CudaSlice<T>,
    ) -> Result<(), CudaError> {
        Ok(self.stream.memcpy_dtod(src, dst)?)
    }
}
