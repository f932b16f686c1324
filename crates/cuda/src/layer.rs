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
pub const WT_F32: i32 = 0;
pub const WT_F16: i32 = 1;
pub const WT_BF16: i32 = 2;
pub const WT_Q8_0: i32 = 8;

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

fn cfg(grid: u32, block: u32) -> LaunchConfig {
    cfg2(grid, 1, block)
}

/// Most hyper-connection streams the kernels take (HC_MAX in layer.cu).
const HC_MAX: usize = 5;
/// Value groups of 4 per thread in hc_pre (HC_PRE_VEC in layer.cu).
const HC_PRE_VEC: usize = 2;

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

/// What the attention launchers read for `n_tok` tokens (device addresses): queries
/// `q` (n_tok × heads × hd), the raw ring (position p at slot p % raw_cap, the last
/// `window` positions attended), the compressed rows of `ratio` (0 = none), the top-k
/// selections `sel` (n_tok × top_k; 0 = none: every compressed row), per-head sinks.
#[derive(Clone, Copy, Debug)]
pub struct AttnInput {
    pub n_tok: usize,
    pub step: u64,
    pub q: u64,
    pub ring: u64,
    pub raw_cap: usize,
    pub window: usize,
    pub comp: u64,
    pub ratio: usize,
    pub sel: u64,
    pub top_k: usize,
    pub sinks: u64,
    pub heads: usize,
    pub hd: usize,
    pub scale: f32,
    /// `attention` applies head_norm_rope to the queries as it reads them (they are
    /// then the q projection's raw output; decode: one launch less before attention).
    pub q_norm: Option<QNorm>,
}

/// head_norm_rope's work (unweighted RMS norm of each head, RoPE of its tail) done by
/// the attention on its query registers.
#[derive(Clone, Copy, Debug)]
pub struct QNorm {
    pub eps: f32,
    pub rope: RopeP,
}

/// What the output projection wants of the attention output, applied in the launch
/// that writes it where it can: the inverse RoPE of each head's tail at the token's
/// position and, with `q` / `d` ≠ 0, the Q8_0 form of the heads (n_tok × heads × hd
/// values, contiguous blocks of 32).
#[derive(Clone, Copy, Debug)]
pub struct AttnTail {
    pub rope: RopeP,
    pub q: u64,
    pub d: u64,
}

impl AttnTail {
    /// Whether heads of `hd` values can take this tail (Q8_0 blocks must not straddle
    /// heads).
    fn check(&self, hd: usize) -> Result<(), CudaError> {
        if self.q != 0 && !hd.is_multiple_of(32) {
            return Err(CudaError::Invalid(format!(
                "attention head dim {hd}: Q8_0 output needs a multiple of 32"
            )));
        }
        Ok(())
    }
}

/// The attention shape of `attention_prefill_mma` (AMMA_HEADS / AMMA_HD).
/// Rows per shared-memory batch of `attention_split_staged` (ATT_STAGE_ROWS in layer_attention.cu).
const ATT_STAGE_ROWS: usize = 32;
const ATT_MMA_HEADS: usize = 64;
const ATT_MMA_HD: usize = 512;

/// The hyper-connection kernels keep a token's streams in fixed register arrays.
fn check_hc_streams(n_hc: usize) -> Result<(), CudaError> {
    if n_hc > HC_MAX {
        return Err(CudaError::Invalid(format!(
            "{n_hc} hyper-connection streams > {HC_MAX}"
        )));
    }
    Ok(())
}

/// `tokens` blocks in y: the token of a batch (per-token kernels).
fn cfg2(grid: u32, tokens: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.max(1), (tokens as u32).max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `name` with the listed arguments (each pushed by reference).
macro_rules! launch {
    ($gpu:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let f = $gpu.func($name)?;
        $gpu.timed($name, || {
            let mut b = $gpu.launch_stream().launch_builder(&f);
            $( b.arg(&$arg); )*
            // SAFETY: each launcher passes exactly the parameters of the kernel of the
            // same name in the layer*.cu kernels, in order and with the same types;
            // buffer sizes are the caller's contract (documented per launcher).
            unsafe { b.launch($cfg) }?;
            Ok::<(), CudaError>(())
        })
    }};
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
        launch!(
            self,
            "embed",
            cfg2((n_embd as u32).div_ceil(256), n_tok, 256),
            step,
            table,
            ty,
            ne,
            nh,
            h
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
        launch!(
            self,
            name,
            cfg2(n_out as u32, n_tok, 1024),
            h,
            n,
            fn_,
            fn_type,
            eps,
            mix
        )
    }

    /// [`Gpu::hc_mix`] with the weights as a matrix (`n_out` rows of `n` = m.cols, F32 /
    /// F16 / BF16): a batch runs the dots as one GEMM (each weight row read once per
    /// tile of tokens instead of once per token) and then scales them per token.
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
        if n_tok <= 1 || !h.is_multiple_of(16) || !m.cols.is_multiple_of(8) {
            return self.hc_mix(
                n_tok,
                h,
                m.cols,
                self.ptr(&m.parts[0]),
                code,
                eps,
                mix,
                m.rows,
            );
        }
        self.matmul_f32(m, h, mix, crate::Batch::plain(n_tok, m.cols, m.rows))?;
        let (n, n_out) = (m.cols as i32, m.rows as i32);
        launch!(
            self,
            "hc_mix_scale",
            cfg2(n_tok as u32, 1, 256),
            h,
            n,
            eps,
            mix,
            n_out
        )
    }

    /// The sublayer input `y` (pre-weighted sum of the streams) and, with `norm`, its RMS
    /// norm (and Q8_0 form), per token. post and comb come from `hc_comb`.
    #[allow(clippy::too_many_arguments)]
    pub fn hc_pre(
        &self,
        n_tok: usize,
        h: u64,
        mix: u64,
        scale: u64,
        base: u64,
        n_hc: usize,
        n_embd: usize,
        eps: f32,
        y: u64,
        norm: Option<HcNorm>,
    ) -> Result<(), CudaError> {
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
        launch!(
            self,
            name,
            cfg2(1, n_tok, threads as u32),
            h,
            mix,
            scale,
            base,
            nh,
            ne,
            eps,
            y,
            nm.w,
            nm.w_type,
            nm.eps,
            nm.out,
            nm.q,
            nm.d
        )
    }

    /// post (`n_hc` values) and the Sinkhorn-normalised comb matrix (`n_hc²`) of each of
    /// `n_tok` tokens from their mix into `hcp`: what hc_post needs and hc_pre does not
    /// (the engine runs it on a side lane).
    #[allow(clippy::too_many_arguments)]
    pub fn hc_comb(
        &self,
        n_tok: usize,
        mix: u64,
        scale: u64,
        base: u64,
        n_hc: usize,
        iters: usize,
        eps: f32,
        hcp: u64,
    ) -> Result<(), CudaError> {
        check_hc_streams(n_hc)?;
        let (nh, it, nt) = (n_hc as i32, iters as i32, n_tok as i32);
        launch!(
            self,
            "hc_comb",
            cfg(n_tok.div_ceil(8) as u32, 256),
            mix,
            scale,
            base,
            nh,
            it,
            eps,
            hcp,
            nt
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
        let name = self.pick(Variant::HcPreload, "hc_post", "hc_post_pl");
        launch!(
            self,
            name,
            cfg2((n_embd as u32).div_ceil(256), n_tok, 256),
            h,
            out,
            parts,
            np,
            hcp,
            nh,
            ne,
            h_out
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
        launch!(
            self,
            "rmsnorm",
            cfg(rows as u32, block),
            x,
            w,
            w_type,
            n,
            eps,
            y
        )
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
        launch!(
            self,
            "rope_tail",
            cfg2(rows as u32, n_tok, 64),
            step,
            x,
            st,
            pos_offset,
            rope,
            inv
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
        launch!(
            self,
            "head_norm_rope",
            cfg2(rows as u32, n_tok, 256),
            step,
            x,
            st,
            eps,
            rope
        )
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
    ) -> Result<(), CudaError> {
        if hd > 1024 {
            return Err(CudaError::Invalid(format!("head dim {hd} > 1024")));
        }
        let (hd_, fr, rc) = (hd as i32, f16_round as i32, raw_cap as i32);
        launch!(
            self,
            "kv_finish",
            cfg2(1, n_tok, 512),
            step,
            kv,
            norm_w,
            norm_type,
            hd_,
            eps,
            rope,
            fr,
            ring,
            rc
        )
    }

    /// One compressor step; `kvs` = new kv (lanes·d) then new gate scores (lanes·d).
    pub fn compressor_step(
        &self,
        step: u64,
        kvs: u64,
        ape: u64,
        ape_type: i32,
        skv: u64,
        ssc: u64,
        ratio: usize,
        lanes: usize,
        d: usize,
        norm_w: u64,
        norm_type: i32,
        eps: f32,
        rope: RopeP,
        indexer: bool,
        f16_round: bool,
        rows: u64,
    ) -> Result<(), CudaError> {
        if d > 1024 || (indexer && !d.is_power_of_two()) {
            return Err(CudaError::Invalid(format!(
                "compressor width {d} unsupported"
            )));
        }
        let (r, l, dd, mode, fr) = (
            ratio as i32,
            lanes as i32,
            d as i32,
            indexer as i32,
            f16_round as i32,
        );
        launch!(
            self,
            "compressor_step",
            cfg(1, 1024),
            step,
            kvs,
            ape,
            ape_type,
            skv,
            ssc,
            r,
            l,
            dd,
            norm_w,
            norm_type,
            eps,
            rope,
            mode,
            fr,
            rows
        )
    }

    /// The compressor over a batch of `n_tok` tokens starting at step[0].pos: emits
    /// every row completed in the batch, then advances the frontier state, exactly as
    /// `compressor_step` per token. `kvs[t]` = kv (lanes·d) then raw gate scores.
    pub fn compressor_batch(
        &self,
        n_tok: usize,
        step: u64,
        kvs: u64,
        ape: u64,
        ape_type: i32,
        skv: u64,
        ssc: u64,
        ratio: usize,
        lanes: usize,
        d: usize,
        norm_w: u64,
        norm_type: i32,
        eps: f32,
        rope: RopeP,
        indexer: bool,
        f16_round: bool,
        rows: u64,
    ) -> Result<(), CudaError> {
        if d > 1024 || (indexer && !d.is_power_of_two()) || ratio == 0 || !(1..=2).contains(&lanes)
        {
            return Err(CudaError::Invalid(format!(
                "compressor width {d} / ratio {ratio} / {lanes} lanes unsupported"
            )));
        }
        let (nt, r, l, dd, mode, fr) = (
            n_tok as i32,
            ratio as i32,
            lanes as i32,
            d as i32,
            indexer as i32,
            f16_round as i32,
        );
        // Rows completed in the batch: at most n_tok / ratio + 1.
        let emits = (n_tok / ratio + 1) as u32;
        launch!(
            self,
            "compressor_emit",
            cfg(emits, 1024),
            step,
            nt,
            kvs,
            ape,
            ape_type,
            skv,
            ssc,
            r,
            l,
            dd,
            norm_w,
            norm_type,
            eps,
            rope,
            mode,
            fr,
            rows
        )?;
        let cells = (ratio * lanes * d) as u32;
        launch!(
            self,
            "compressor_state",
            cfg(cells.div_ceil(256).min(4096), 256),
            step,
            nt,
            kvs,
            ape,
            ape_type,
            skv,
            ssc,
            r,
            l,
            dd
        )
    }

    /// RoPE + Hadamard + FP4 on each of `heads` indexer query heads of `dim` values.
    pub fn indexer_q(
        &self,
        n_tok: usize,
        step: u64,
        q: u64,
        heads: usize,
        dim: usize,
        rope: RopeP,
    ) -> Result<(), CudaError> {
        // One warp per head where the lanes' 4-value parts fit (`idxq_warp`).
        let tail_start = dim as i64 - rope.rope_dim as i64;
        if dim == 128 && tail_start >= 0 && tail_start % 2 == 0 && self.on(Variant::IdxqWarp) {
            let h = heads as i32;
            return launch!(
                self,
                "indexer_q_warp",
                cfg2((heads as u32).div_ceil(8), n_tok, 256),
                step,
                q,
                h,
                rope
            );
        }
        let d = dim as i32;
        launch!(
            self,
            "indexer_q",
            cfg2(heads as u32, n_tok, 256),
            step,
            q,
            d,
            rope
        )
    }

    /// Indexer scores of up to `max_rows` index rows per token (the live count comes
    /// from pos); token t's scores start at t · max_rows. With `idx_mma` a batch at the
    /// Flash shape (64 heads × 128) runs on bf16 tensor cores, which is exact only for
    /// FP4-simulated rows and queries — what the model's indexer always feeds it.
    pub fn indexer_scores(
        &self,
        n_tok: usize,
        step: u64,
        rows: u64,
        q: u64,
        wt: u64,
        heads: usize,
        dim: usize,
        wscale: f32,
        ratio: usize,
        top_k: usize,
        scores: u64,
        max_rows: usize,
    ) -> Result<(), CudaError> {
        if heads > 64 || dim > 128 || !dim.is_multiple_of(4) {
            return Err(CudaError::Invalid(format!(
                "indexer of {heads} heads × {dim}: at most 64 × 128, dim a multiple of 4"
            )));
        }
        let (h, d, r, k) = (heads as i32, dim as i32, ratio as i32, top_k as i32);
        let ss = max_rows as i32;
        // A batch at the Flash shape on tensor cores (`idx_mma`, mma_indexer.cu).
        if n_tok > 1 && heads == 64 && dim == 128 && self.on(Variant::IdxMma) {
            // The rows and queries as bf16 [64][136] each, the dot products [64][68] f32.
            let smem = 2 * 64 * 136 * 2 + 64 * 68 * 4;
            let mut cfg = cfg2((max_rows as u32).div_ceil(64), n_tok.div_ceil(8), 128);
            cfg.shared_mem_bytes = smem as u32;
            self.allow_smem("indexer_scores_mma", smem)?;
            let nt = n_tok as i32;
            return launch!(
                self,
                "indexer_scores_mma",
                cfg,
                step,
                rows,
                q,
                wt,
                nt,
                wscale,
                r,
                k,
                scores,
                ss
            );
        }
        // qs and ks (dim × 68 floats each) and the 16 × 64 reduction.
        let smem = (2 * dim * 68 + 16 * 64) * 4;
        let mut cfg = cfg2((max_rows as u32).div_ceil(64), n_tok, 256);
        cfg.shared_mem_bytes = smem as u32;
        let name = self.pick(Variant::IdxBanks, "indexer_scores", "indexer_scores_sp");
        self.allow_smem(name, smem)?;
        launch!(self, name, cfg, step, rows, q, wt, h, d, wscale, r, k, scores, ss)
    }

    /// Per token, the indices of the `k` best of its (pos+1)/ratio scores (row t of
    /// `scores` at t · scores_stride) into `sel[t][k]`, ascending; untouched while the
    /// count is ≤ k (attention then uses every row).
    pub fn topk_select(
        &self,
        n_tok: usize,
        step: u64,
        scores: u64,
        scores_stride: usize,
        ratio: usize,
        k: usize,
        sel: u64,
    ) -> Result<(), CudaError> {
        let (ss, r, kk) = (scores_stride as i32, ratio as i32, k as i32);
        let name = self.pick(Variant::TopkReg, "topk_select", "topk_select_rg");
        launch!(
            self,
            name,
            cfg2(1, n_tok, 1024),
            step,
            scores,
            ss,
            r,
            kk,
            sel
        )
    }

    /// Sink attention of every head of each token over its raw window and its
    /// compressed rows (see [`AttnInput`]), split into `n_chunks` chunks of
    /// `rows_per_chunk` rows (0: the token's rows divided evenly, computed on the device
    /// from its position); with more than one chunk the partials go to `part_acc`
    /// (n_tok·heads·n_chunks·hd floats) and `part_ml` (twice n_tok·heads·n_chunks) and a
    /// combine pass writes `out`.
    pub fn attention(
        &self,
        a: &AttnInput,
        rows_per_chunk: usize,
        n_chunks: usize,
        part_acc: u64,
        part_ml: u64,
        out: u64,
        tail: Option<&AttnTail>,
    ) -> Result<(), CudaError> {
        let (hd, heads, raw_cap, window) = (a.hd, a.heads, a.raw_cap, a.window);
        if let Some(t) = tail {
            t.check(hd)?;
        }
        if !hd.is_multiple_of(4) || hd > 512 {
            return Err(CudaError::Invalid(format!(
                "attention head dim {hd}: must be a multiple of 4, at most 512"
            )));
        }
        if window > raw_cap || n_chunks == 0 || n_chunks > 128 {
            return Err(CudaError::Invalid(format!(
                "attention window {window} / ring {raw_cap} / {n_chunks} chunks of {rows_per_chunk}"
            )));
        }
        let (rc, win, r, tk, nh, hd_, rpc) = (
            raw_cap as i32,
            window as i32,
            a.ratio as i32,
            a.top_k as i32,
            heads as i32,
            hd as i32,
            rows_per_chunk as i32,
        );
        let (q_norm, q_eps, q_rope) = match a.q_norm {
            Some(qn) => {
                let rd = qn.rope.rope_dim as usize;
                if rd > hd || !rd.is_multiple_of(2) || !(hd - rd).is_multiple_of(2) {
                    return Err(CudaError::Invalid(format!(
                        "query RoPE of {rd} dims in heads of {hd}: needs an even tail and start"
                    )));
                }
                (1i32, qn.eps, qn.rope)
            }
            None => (0, 0.0, RopeP::default()),
        };
        let groups = (heads as u32).div_ceil(8);
        // A decode token's blocks stage their rows in shared memory (`att_stage`).
        let staged = a.n_tok == 1 && self.on(Variant::AttStage);
        let (name, smem) = if staged {
            let name = self.pick(
                Variant::AttEarly,
                "attention_split_staged",
                "attention_split_early",
            );
            (name, (ATT_STAGE_ROWS * hd * 4) as u32)
        } else {
            ("attention_split", 0)
        };
        if staged {
            self.allow_smem(name, smem as usize)?;
        }
        let grid = LaunchConfig {
            grid_dim: (n_chunks as u32, groups, a.n_tok as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem,
        };
        launch!(
            self, name, grid, a.step, a.q, a.ring, rc, win, a.comp, r, a.sel, tk, a.sinks, nh, hd_,
            a.scale, rpc, part_acc, part_ml, out, q_norm, q_eps, q_rope
        )?;
        if n_chunks > 1 {
            let nc = n_chunks as i32;
            let (rope, rope_on, q, d) = match tail {
                Some(t) => (t.rope, 1i32, t.q, t.d),
                None => (RopeP::default(), 0, 0, 0),
            };
            let name = self.pick(
                Variant::CombinePl,
                "attention_combine",
                "attention_combine_pl",
            );
            launch!(
                self,
                name,
                cfg2(heads as u32, a.n_tok, 128),
                part_acc,
                part_ml,
                a.sinks,
                nh,
                hd_,
                nc,
                out,
                a.step,
                rope,
                rope_on,
                q,
                d
            )?;
        } else if let Some(t) = tail {
            self.attention_tail(a, t, out)?;
        }
        Ok(())
    }

    /// The [`AttnTail`] of an attention output `out` written without it.
    pub fn attention_tail(&self, a: &AttnInput, t: &AttnTail, out: u64) -> Result<(), CudaError> {
        t.check(a.hd)?;
        self.rope_tail(a.n_tok, a.step, out, a.hd, a.heads, 0, t.rope, true)?;
        if t.q != 0 {
            self.quantize_q8_raw(out, t.q, t.d, a.n_tok * a.heads * a.hd / 32)?;
        }
        Ok(())
    }

    /// Sink attention on tensor cores (fp16 operands, f32 sums; the fast numerics): one
    /// block per token over all its rows, output as `attention` with one chunk. Only the
    /// DeepSeek V4 Flash shape (64 heads of 512).
    pub fn attention_prefill_mma(&self, a: &AttnInput, out: u64) -> Result<(), CudaError> {
        let (heads, hd, raw_cap, window) = (a.heads, a.hd, a.raw_cap, a.window);
        if a.q_norm.is_some() {
            return Err(CudaError::Invalid(
                "tensor-core attention reads normed queries (no q_norm)".into(),
            ));
        }
        if !Gpu::attention_mma_shape(heads, hd) || window > raw_cap || a.n_tok == 0 {
            return Err(CudaError::Invalid(format!(
                "tensor-core attention takes {ATT_MMA_HEADS} heads of {ATT_MMA_HD} (got {heads} of {hd}), window {window} <= ring {raw_cap}"
            )));
        }
        const NAME: &str = "attention_prefill_mma";
        // Q + the fp16 row tile (rows padded by 8 halves) + the f32 tile in flight.
        let smem = (ATT_MMA_HEADS + 32) * (ATT_MMA_HD + 8) * 2 + 32 * ATT_MMA_HD * 4;
        self.allow_smem(NAME, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (a.n_tok as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (rc, win, r, tk) = (
            raw_cap as i32,
            window as i32,
            a.ratio as i32,
            a.top_k as i32,
        );
        launch!(
            self, NAME, cfg, a.step, a.q, a.ring, rc, win, a.comp, r, a.sel, tk, a.sinks, a.scale,
            out
        )
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
        launch!(
            self,
            name,
            cfg(n_tok as u32, 512),
            step,
            logits,
            ne,
            kk,
            bias,
            tid2eid,
            wscale,
            ids,
            weights
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
        launch!(
            self,
            "swiglu",
            cfg(((n * n_sel) as u32).div_ceil(256), 256),
            gate,
            up,
            weights,
            nn,
            ns,
            clamp,
            mid
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
        launch!(
            self,
            "repeat_rows",
            cfg2((width as u32).div_ceil(256), n * k, 256),
            src,
            w,
            kk,
            dst
        )
    }

    /// The head's stream collapse and final norm into `x`.
    pub fn head_collapse(
        &self,
        h: u64,
        mix: u64,
        scale: u64,
        base: u64,
        n_hc: usize,
        n_embd: usize,
        hc_eps: f32,
        norm_w: u64,
        norm_type: i32,
        eps: f32,
        tmp: u64,
        x: u64,
    ) -> Result<(), CudaError> {
        let (nh, ne) = (n_hc as i32, n_embd as i32);
        launch!(
            self,
            "head_collapse",
            cfg(1, 1024),
            h,
            mix,
            scale,
            base,
            nh,
            ne,
            hc_eps,
            norm_w,
            norm_type,
            eps,
            tmp,
            x
        )
    }
}

impl Gpu {
    /// Whether [`Gpu::attention_prefill_mma`] takes this attention shape.
    pub fn attention_mma_shape(heads: usize, hd: usize) -> bool {
        heads == ATT_MMA_HEADS && hd == ATT_MMA_HD
    }

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
