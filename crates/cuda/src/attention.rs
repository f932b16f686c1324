//! Launchers of the attention and indexer kernels (kernels/layer_attention.cu,
//! layer_indexer.cu, layer_indexer_step.cu, mma_attention.cu, mma_indexer.cu), with the layer launchers'
//! conventions (raw device addresses; see layer.rs).

#![allow(clippy::too_many_arguments)]

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::device::Gpu;
use crate::error::CudaError;
use crate::layer::{cfg, cfg2, wide_grid, wide_rope_fits, RopeP, WIDE_THREADS};
use crate::plan::{Launcher, Variant};

/// The most compressed rows a token for which `indexer_step` is used: a 32k context
/// at ratio 4 (`ctx / 4 + 2`, the default context), whose live rows (at most 8,192)
/// keep the top-k's keys in registers. Past it the three-launch chain is used.
pub const INDEXER_STEP_MAX_ROWS: usize = 8194;

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
    /// A batched step over several sessions: the rows' KV table (`KVT_*`), whose ring,
    /// compressed rows and ring capacity replace `ring`, `comp` and `raw_cap` per
    /// token. 0: one session.
    pub kvt: u64,
    /// The device address of an `i32` that lowers `window` (the MTP block's ring count,
    /// which grows after a prompt: its captured draft then serves every count). The
    /// split FMA kernels only (`attention`); 0: `window` as given.
    pub window_at: u64,
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

// Rows per shared-memory batch of `attention_split_staged` (ATT_STAGE_ROWS), the
// attention shape of `attention_prefill_mma` (AMMA_HEADS × AMMA_HD).
use crate::consts::{
    AMMA_HD, AMMA_HEADS, ATT_STAGE_ROWS, IXS_CLUSTER, IXS_NARROW_MAX, IXS_ROWS, IXS_SMEM,
};

impl Gpu {
    /// Whether [`Launcher::attention_prefill_mma`] takes this attention shape.
    pub fn attention_mma_shape(heads: usize, hd: usize) -> bool {
        heads == AMMA_HEADS && hd == AMMA_HD
    }
}

impl Launcher<'_> {
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
            return launch!(self, "indexer_q_warp", cfg2((heads as u32).div_ceil(8), n_tok, 256);
                step, q, h, rope
            );
        }
        let d = dim as i32;
        launch!(self, "indexer_q", cfg2(heads as u32, n_tok, 256); step, q, d, rope)
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
        kvt: u64,
    ) -> Result<(), CudaError> {
        if heads > 64 || dim > 128 || !dim.is_multiple_of(4) {
            return Err(CudaError::Invalid(format!(
                "indexer of {heads} heads × {dim}: at most 64 × 128, dim a multiple of 4"
            )));
        }
        let (h, d, r, k) = (heads as i32, dim as i32, ratio as i32, top_k as i32);
        let ss = max_rows as i32;
        // A batch at the Flash shape on tensor cores (`idx_mma`, mma_indexer.cu).
        // (Its tokens share each tile of rows: one session's only, so not with `kvt`.)
        if n_tok > 1 && kvt == 0 && heads == 64 && dim == 128 && self.on(Variant::IdxMma) {
            // The rows and queries as bf16 [64][136] each, the dot products [64][68] f32.
            let smem = 2 * 64 * 136 * 2 + 64 * 68 * 4;
            let mut cfg = cfg2((max_rows as u32).div_ceil(64), n_tok.div_ceil(8), 128);
            cfg.shared_mem_bytes = smem as u32;
            self.allow_smem("indexer_scores_mma", smem)?;
            let nt = n_tok as i32;
            return launch!(self, "indexer_scores_mma", cfg;
                step, rows, q, wt, nt, wscale, r, k, scores, ss
            );
        }
        // qs and ks (dim × 68 floats each) and the 16 × 64 reduction.
        let smem = (2 * dim * 68 + 16 * 64) * 4;
        let mut cfg = cfg2((max_rows as u32).div_ceil(64), n_tok, 256);
        cfg.shared_mem_bytes = smem as u32;
        let name = self.pick(Variant::IdxBanks, "indexer_scores", "indexer_scores_sp");
        self.allow_smem(name, smem)?;
        launch!(self, name, cfg; step, rows, q, wt, h, d, wscale, r, k, scores, ss, kvt)
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
        launch!(self, name, cfg2(1, n_tok, 1024); step, scores, ss, r, kk, sel)
    }

    /// Whether `indexer_step` takes an indexer of `heads` × `dim` with RoPE on its last
    /// `rope_dim` dims and up to `max_rows` compressed rows a token: the Flash shape,
    /// an even RoPE start, and up to [`INDEXER_STEP_MAX_ROWS`] rows.
    pub fn indexer_step_fits(
        &self,
        heads: usize,
        dim: usize,
        rope_dim: usize,
        max_rows: usize,
    ) -> bool {
        heads == 64
            && dim == 128
            && rope_dim <= dim
            && (dim - rope_dim).is_multiple_of(2)
            && max_rows <= INDEXER_STEP_MAX_ROWS
            && self.on(Variant::IdxStep)
    }

    /// The decode indexer in one launch (`indexer_step`, layer_indexer_step.cu):
    /// `indexer_q` of the raw queries `q_raw` (read, not rewritten), `indexer_scores`
    /// into `scores` and `topk_select` into `sel`, with those launches' bits, for
    /// `n_tok` tokens (a decode token, or a batched step's rows with `kvt`). `done` holds
    /// `n_tok` u32 counters, zero before the launch and left zero. Shape: see
    /// [`Self::indexer_step_fits`].
    pub fn indexer_step(
        &self,
        n_tok: usize,
        step: u64,
        rows: u64,
        q_raw: u64,
        wt: u64,
        rope: RopeP,
        wscale: f32,
        ratio: usize,
        top_k: usize,
        scores: u64,
        (scores_stride, max_rows): (usize, usize),
        sel: u64,
        done: u64,
        kvt: u64,
    ) -> Result<(), CudaError> {
        if max_rows > scores_stride
            || max_rows > INDEXER_STEP_MAX_ROWS
            || ratio == 0
            || top_k == 0
            || top_k > 4096
            || rope.rope_dim as usize > 128
        {
            return Err(CudaError::Invalid(format!(
                "indexer_step: {max_rows} rows (at most {INDEXER_STEP_MAX_ROWS}) in a stride of \
                 {scores_stride}, ratio {ratio}, top-k {top_k} (1 to 4,096)"
            )));
        }
        // A block a tile (16 rows up to 2,048 live rows, 64 past them) over a
        // grid-stride loop, in clusters of 8 (each block of a cluster transforms 8 of
        // the 64 heads for all 8), at most 64 blocks (8 clusters) on an H200's 132 SMs:
        // a cluster's 8 blocks start together within one GPC, and at 16 clusters
        // (128 blocks) the last ones started 6-8 µs late (NOTES session 33).
        let sms = self.info().multiprocessors.max(16) as usize;
        let tiles = (max_rows.min(IXS_NARROW_MAX).div_ceil(16)).max(max_rows.div_ceil(IXS_ROWS));
        let blocks = tiles
            .clamp(
                1,
                (sms / 2).min(8 * IXS_CLUSTER) / IXS_CLUSTER * IXS_CLUSTER,
            )
            .next_multiple_of(IXS_CLUSTER);
        let (r, k, ss) = (ratio as i32, top_k as i32, scores_stride as i32);
        let mut cfg = cfg2(blocks as u32, n_tok, 256);
        cfg.shared_mem_bytes = IXS_SMEM as u32;
        self.allow_smem("indexer_step", IXS_SMEM)?;
        launch!(self, "indexer_step", cfg;
            step, rows, q_raw, rope, wt, wscale, r, k, scores, ss, sel, done, kvt
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
        // A multi-row step's few tokens too (the kernel takes its token from
        // blockIdx.z).
        let staged = a.n_tok <= crate::Q8_TOKENS_MAX && self.on(Variant::AttStage);
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
        launch!(self, name, grid;
            a.step, a.q, a.ring, rc, win, a.comp, r, a.sel, tk, a.sinks, nh, hd_, a.scale, rpc, part_acc, part_ml, out, q_norm, q_eps, q_rope, a.kvt, a.window_at
        )?;
        if n_chunks > 1 {
            self.attention_combine(a, n_chunks, part_acc, part_ml, out, tail)?;
        } else if let Some(t) = tail {
            self.attention_tail(a, t, out)?;
        }
        Ok(())
    }

    /// The split attention's second launch: the chunks' partials (acc [t][h][c][hd],
    /// (max, sum) [t][h][c]) with the sink into `out`, then the tail when given.
    fn attention_combine(
        &self,
        a: &AttnInput,
        n_chunks: usize,
        part_acc: u64,
        part_ml: u64,
        out: u64,
        tail: Option<&AttnTail>,
    ) -> Result<(), CudaError> {
        let (nc, nh, hd_) = (n_chunks as i32, a.heads as i32, a.hd as i32);
        let (rope, rope_on, q, d) = match tail {
            Some(t) => (t.rope, 1i32, t.q, t.d),
            None => (RopeP::default(), 0, 0, 0),
        };
        let name = self.pick(
            Variant::CombinePl,
            "attention_combine",
            "attention_combine_pl",
        );
        launch!(self, name, cfg2(a.heads as u32, a.n_tok, 128);
            part_acc, part_ml, a.sinks, nh, hd_, nc, out, a.step, rope, rope_on, q, d
        )
    }

    /// A multi-row step's attention on tensor cores (fast numerics: fp16 queries and
    /// rows, f32 sums): each token's 32-row tiles split over `n_chunks` blocks
    /// (`attention_split_mma`), then [`Launcher::attention`]'s combine and tail. The
    /// same chunk partials as the f32 split kernel, so the same scratch and combine.
    /// Queries are normed and rotated already (no `q_norm`).
    pub fn attention_split_mma(
        &self,
        a: &AttnInput,
        n_chunks: usize,
        part_acc: u64,
        part_ml: u64,
        out: u64,
        tail: Option<&AttnTail>,
    ) -> Result<(), CudaError> {
        if let Some(t) = tail {
            t.check(a.hd)?;
        }
        if !(2..=128).contains(&n_chunks) {
            return Err(CudaError::Invalid(format!(
                "split tensor-core attention takes 2..=128 chunks (got {n_chunks})"
            )));
        }
        const NAME: &str = "attention_split_mma";
        let smem = self.mma_attention_smem(a, NAME)?;
        let (raw_cap, window) = (a.raw_cap, a.window);
        let cfg = LaunchConfig {
            grid_dim: (n_chunks as u32, a.n_tok as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (rc, win, r, tk, nc) = (
            raw_cap as i32,
            window as i32,
            a.ratio as i32,
            a.top_k as i32,
            n_chunks as i32,
        );
        launch!(self, NAME, cfg;
            a.step, a.q, a.ring, rc, win, a.comp, r, a.sel, tk, a.sinks, a.scale, nc, part_acc, part_ml, a.kvt
        )?;
        self.attention_combine(a, n_chunks, part_acc, part_ml, out, tail)
    }

    /// The shared memory of the tensor-core attention kernels (`kernel`), after
    /// checking what they take: normed queries (no `q_norm`), the Flash head shape, a
    /// window within the ring, at least one token.
    fn mma_attention_smem(&self, a: &AttnInput, kernel: &'static str) -> Result<usize, CudaError> {
        let (heads, hd, raw_cap, window) = (a.heads, a.hd, a.raw_cap, a.window);
        if a.q_norm.is_some() || a.window_at != 0 {
            return Err(CudaError::Invalid(
                "tensor-core attention reads normed queries (no q_norm) and a window given \
                 as a value (no window_at)"
                    .into(),
            ));
        }
        if !Gpu::attention_mma_shape(heads, hd) || window > raw_cap || a.n_tok == 0 {
            return Err(CudaError::Invalid(format!(
                "tensor-core attention takes {AMMA_HEADS} heads of {AMMA_HD} (got {heads} of {hd}), window {window} <= ring {raw_cap}"
            )));
        }
        // Q + the fp16 row tile (rows padded by 8 halves) + the f32 tile in flight.
        let smem = (AMMA_HEADS + 32) * (AMMA_HD + 8) * 2 + 32 * AMMA_HD * 4;
        self.allow_smem(kernel, smem)?;
        Ok(smem)
    }

    /// The [`AttnTail`] of an attention output `out` written without it.
    pub fn attention_tail(&self, a: &AttnInput, t: &AttnTail, out: u64) -> Result<(), CudaError> {
        t.check(a.hd)?;
        // rope_tail_q8's warps quantise with shuffles over all 32 lanes: every warp must
        // run the same number of 128-value steps, so a token's row is whole steps.
        let whole_steps = (a.heads * a.hd).is_multiple_of(128);
        if t.q != 0 && self.on(Variant::Wide) && whole_steps && wide_rope_fits(a.hd, t.rope) {
            let (hd, heads) = (a.hd as i32, a.heads as i32);
            let grid = wide_grid(a.n_tok, a.heads * a.hd / (4 * WIDE_THREADS as usize));
            return launch!(self, "rope_tail_q8", grid; a.step, out, hd, heads, t.rope, 1i32, t.q, t.d);
        }
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
        const NAME: &str = "attention_prefill_mma";
        if a.kvt != 0 {
            return Err(CudaError::Invalid(
                "the prefill attention runs one session (no KV table)".into(),
            ));
        }
        let smem = self.mma_attention_smem(a, NAME)?;
        let (raw_cap, window) = (a.raw_cap, a.window);
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
        launch!(self, NAME, cfg;
            a.step, a.q, a.ring, rc, win, a.comp, r, a.sel, tk, a.sinks, a.scale, out
        )
    }

    /// [`Launcher::attention_prefill_mma`] over fp16 copies of the rows (`att_half`):
    /// `ring16` holds `a.raw_cap` rows and `comp16` the compressed rows the tokens
    /// attend, both as [`Launcher::rows_f16`] writes them from `a.ring` and `a.comp`.
    /// Bit-identical to the f32-row kernel (the same fp16 operands).
    pub fn attention_prefill_mma_h(
        &self,
        a: &AttnInput,
        ring16: u64,
        comp16: u64,
        out: u64,
    ) -> Result<(), CudaError> {
        const NAME: &str = "attention_prefill_mma_h";
        if a.kvt != 0 {
            return Err(CudaError::Invalid(
                "the prefill attention runs one session (no KV table)".into(),
            ));
        }
        // Validates the shape as the f32-row kernel; Q and two fp16 row tiles.
        self.mma_attention_smem(a, "attention_prefill_mma")?;
        let smem = (AMMA_HEADS + 2 * 32) * (AMMA_HD + 8) * 2;
        self.allow_smem(NAME, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (a.n_tok as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (rc, win, r, tk) = (
            a.raw_cap as i32,
            a.window as i32,
            a.ratio as i32,
            a.top_k as i32,
        );
        launch!(self, NAME, cfg;
            a.step, a.q, ring16, rc, win, comp16, r, a.sel, tk, a.sinks, a.scale, out
        )
    }

    /// fp16 copies (round to nearest) of `n` floats at `x` into `y` (u16 × n), `n` a
    /// multiple of 8: the rows of [`Launcher::attention_prefill_mma_h`].
    pub fn rows_f16(&self, x: u64, y: u64, n: usize) -> Result<(), CudaError> {
        if !n.is_multiple_of(8) {
            return Err(CudaError::Invalid(format!("rows_f16: {n} values")));
        }
        if n == 0 {
            return Ok(());
        }
        let nn = n as i64;
        launch!(self, "rows_f16", cfg((n / 8).div_ceil(256) as u32, 256); x, y, nn)
    }
}
