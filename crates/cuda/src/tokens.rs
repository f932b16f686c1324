//! The products of a few tokens (2..=16: a multi-row step's rows, a batched step's
//! sessions) in one pass over a plain matrix's weights: the dp4a / FMA token kernels
//! (`matvec_q8_0_q8_t{T}r{R}`, `matvec_f16_t{T}`), which give each token the one-token
//! sums, and from 8 tokens the tensor-core kernels (`tokens_mma`, `f16_mma`). Split
//! from ops.rs, whose public entry points (`matvec`, `matvec_q8act`) dispatch here.

use cudarc::driver::{LaunchConfig, PushKernelArg};

// MMA_TOKENS_MAX_KS: most warps a row tile and a block of the tensor-core kernels;
// TMMA_UNROLL: pairs of blocks a warp step of theirs takes at 8 tokens.
use crate::consts::{MMA_TOKENS_MAX_KS, Q8_ROWS_PER_WARP, ROWS_PER_BLOCK, TMMA_UNROLL};
use crate::error::CudaError;
use crate::matmul::Batch;
use crate::ops::{
    check_act_cover, push_weights, q8_pair_strides, same_stack_shape, split_k, split_k_q8, MatSel,
    QuantAct,
};
use crate::plan::{Launcher, Variant};
use crate::weights::DeviceMatrix;
use ds4_gguf::GgmlType;

/// Rows from which a 2-token product takes 4 rows a warp whatever its width (the
/// 129,280-row output head; `matvec_q8_tokens`).
pub(crate) const Q8_TOKENS_R4_ROWS: usize = 65536;

impl Launcher<'_> {
    /// The token count T of the dp4a / FMA token kernels that serve `n_tok` tokens: the
    /// next power of two from 2, except 3 and 5 themselves under `tokens3` and `tokens5`
    /// (past n_tok the kernel's tokens are padding, computed and not stored).
    fn token_capacity(&self, n_tok: usize) -> usize {
        match n_tok {
            3 if self.on(Variant::Tokens3) => 3,
            5 if self.on(Variant::Tokens5) => 5,
            n => n.next_power_of_two().max(2),
        }
    }

    /// `n_tok` (2..=16) tokens of a plain F16 matrix in one pass over its weights
    /// (`matvec_f16_t{T}`), with the warps a row of the one-token launch: the same sums.
    pub(crate) fn matvec_f16_tokens(
        &self,
        m: &DeviceMatrix,
        x: u64,
        y: u64,
        n_tok: usize,
        sel: MatSel,
    ) -> Result<(), CudaError> {
        let ks = split_k(m.rows, 1);
        let name = match self.token_capacity(n_tok) {
            2 => "matvec_f16_t2",
            3 => "matvec_f16_t3",
            4 => "matvec_f16_t4",
            5 => "matvec_f16_t5",
            8 => "matvec_f16_t8",
            _ => "matvec_f16_t16",
        };
        let blocks = (m.rows as u32).div_ceil(ROWS_PER_BLOCK / ks);
        self.launch_f16_tokens(name, (blocks, ROWS_PER_BLOCK, ks), m, (x, y), n_tok, sel)
    }

    /// Launches a multi-token F16 kernel (`matvec_f16_t{T}` or `matvec_f16_mma8/16`: the
    /// same parameters) over `blocks` blocks of `warps` warps, `ks` warps a row (or a
    /// row tile).
    fn launch_f16_tokens(
        &self,
        name: &'static str,
        (blocks, warps, ks): (u32, u32, u32),
        m: &DeviceMatrix,
        (x, y): (u64, u64),
        n_tok: usize,
        sel: MatSel,
    ) -> Result<(), CudaError> {
        let f = self.func(name)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32, warps, 1),
            shared_mem_bytes: 0,
        };
        let w = m.part_ptr(self, 0);
        let (rows, cols, ks_arg, n_arg) = (m.rows as i32, m.cols as i32, ks as i32, n_tok as i32);
        let mut b = self.launch_stream().launch_builder(&f);
        b.arg(&w)
            .arg(&x)
            .arg(&y)
            .arg(&rows)
            .arg(&cols)
            .arg(&sel)
            .arg(&ks_arg)
            .arg(&n_arg);
        // SAFETY: argument order matches F16_TOK_KERNEL in matvec.cu and F16_MMA_KERNEL
        // in mma_tokens_f16.cu (the same list); x holds n_tok rows at sel.x_stride (16-byte
        // aligned for the mma kernels: checked by `matvec`) and y n_tok rows at
        // sel.y_stride (caller, as for `matvec`).
        unsafe { self.launch_timed(name, &mut b, cfg) }?;
        Ok(())
    }

    /// [`Launcher::matvec_f16_tokens`] for 8..=16 tokens on tf32 tensor cores
    /// (`f16_mma`, kernels/mma_tokens_f16.cu; rows of a multiple of 64 columns): warp
    /// tiles of 16 rows, split over `ks` warps as the Q8_0 tensor-core products
    /// (`matvec_q8_tokens_mma`) so that ~4,096 warps stream the weights, each warp whole
    /// steps of 2 spans of 32 columns.
    pub(crate) fn matvec_f16_tokens_mma(
        &self,
        m: &DeviceMatrix,
        x: u64,
        y: u64,
        n_tok: usize,
        sel: MatSel,
    ) -> Result<(), CudaError> {
        let name = if n_tok <= 8 {
            "matvec_f16_mma8"
        } else {
            "matvec_f16_mma16"
        };
        let tiles = m.rows.div_ceil(16);
        let max_ks = MMA_TOKENS_MAX_KS.min(prev_power_of_two((m.cols / 64).max(1)));
        let (ks, warps, tiles_per_block) = mma_split(tiles, 4096, max_ks);
        let blocks = (tiles as u32).div_ceil(tiles_per_block);
        self.launch_f16_tokens(name, (blocks, warps, ks), m, (x, y), n_tok, sel)
    }

    /// The grouped output projection of a multi-row step (`b.n_tok` ≤ 16 tokens, each
    /// with `b.n_groups` inputs at `x_grp`, matrix g of the stack on input g): one pass
    /// over the weights for every token (see `matvec_q8_tokens`).
    pub fn matvec_q8act_groups(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        b: Batch,
    ) -> Result<(), CudaError> {
        let need = b.x_tok * (b.n_tok.max(1) - 1) + b.x_grp * (b.n_groups.max(1) - 1) + m.cols;
        if m.ty != GgmlType::Q8_0
            || !(1..=Q8_TOKENS_MAX).contains(&b.n_tok)
            || b.n_groups != m.n_mats
            || need > xq.rows * xq.cols
            || !b.x_tok.is_multiple_of(32)
            || !b.x_grp.is_multiple_of(32)
        {
            return Err(CudaError::Invalid(format!(
                "a grouped multi-token product takes a Q8_0 stack of {} matrices and at most \
                 {Q8_TOKENS_MAX} tokens within the activations, not {} ({} groups, {} tokens)",
                m.n_mats, m.ty, b.n_groups, b.n_tok
            )));
        }
        self.matvec_q8_tokens(m, xq, y, b, None)
    }

    /// `b.n_tok` (1..=16) tokens of a Q8_0 matrix (or of each of `b.n_groups` matrices)
    /// in one pass over its weights (`matvec_q8_0_q8_t{T}r{R}`, T the token capacity):
    /// the rows a warp and warps a row are those the one-token launch picks, so each
    /// token's sums are the ones it gives (gpu-selftest). The caller checked the
    /// activations' extent.
    pub(crate) fn matvec_q8_tokens(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        bt: Batch,
        ks: Option<u32>,
    ) -> Result<(), CudaError> {
        let n_tok = bt.n_tok;
        let sel = MatSel {
            ids: 0,
            x_stride: bt.x_tok as i64,
            y_stride: bt.y_tok as i64,
        };
        // The tensor-core form from 8 tokens (one full tile): at 2 and 4 tokens the dp4a
        // kernels were faster (H200, 8 layers: R = 2 1.95 against 2.3 ms a step), at 8
        // and 16 sessions the tensor cores (5.4 → 5.1, 11.3 → 9.9 ms; bench/RESULTS.md v24).
        if n_tok >= mma_from()
            && self.on(Variant::TokensMma)
            && tokens_mma_fits(m.cols, bt.x_tok, bt.x_grp)
        {
            return self.matvec_q8_tokens_mma(m, xq, y, bt, sel);
        }
        // The one-token choice (see matvec_q8act_launch): warps per row, then, for one
        // warp a row of the early kernel, 4 or 2 rows a warp.
        // (A grouped stack's one-token launch has one selection per group.)
        let ks = ks.unwrap_or_else(|| split_k_q8(m.rows, bt.n_groups.max(1)));
        // The output head at 2 tokens: 4 rows a warp (t2r4 holds three blocks an SM)
        // 136.7 µs against 162.4 at the one-token launch's 2 (`--bench-tokens`, H200).
        // A row's steps and reduction are the same at any rows a warp.
        let head_r4 = self.on(Variant::Q8Early)
            && ks == 1
            && n_tok.next_power_of_two().max(2) == 2
            && m.rows >= Q8_TOKENS_R4_ROWS
            && self.on(Variant::Q8Rows2);
        let r = if head_r4 {
            Q8_ROWS_PER_WARP
        } else {
            self.early_rows_a_warp(ks, m.cols)
        };
        self.launch_q8_dp4a_tokens(m, xq, y, bt, sel, (r, ks))
    }

    /// Rows a warp of the one-token launch at `ks` warps a row (see
    /// `matvec_q8act_launch`): where one warp takes a row of the early kernel, 4 for rows
    /// of up to 1,024 columns (`q8_rows`) and 2 for longer ones (`q8_rows2`), else 1.
    fn early_rows_a_warp(&self, ks: u32, cols: usize) -> u32 {
        let early = self.on(Variant::Q8Early) && ks == 1;
        match () {
            _ if early && cols <= 1024 && self.on(Variant::Q8Rows) => Q8_ROWS_PER_WARP,
            _ if early && cols > 1024 && self.on(Variant::Q8Rows2) => 2,
            _ => 1,
        }
    }

    /// `b.n_tok` tokens of a plain Q8_0 matrix through the dp4a kernel of `r` rows a
    /// warp (1, 2 or 4) at `ks` warps a row, whatever the default would pick: the
    /// timing of other shapes (`gpu-selftest --bench-tokens`). Per row the same sums as
    /// the default at the same `ks`.
    #[doc(hidden)]
    pub fn matvec_q8_tokens_forced(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        bt: Batch,
        (r, ks): (u32, u32),
    ) -> Result<(), CudaError> {
        if m.ty != GgmlType::Q8_0
            || bt.n_groups > 1
            || !(2..=Q8_TOKENS_MAX).contains(&bt.n_tok)
            || !matches!(ks, 1 | 2 | 4 | 8)
            || !matches!(r, 1 | 2 | 4)
            || (r > 1 && ks != 1)
            || bt.x_tok * (bt.n_tok - 1) + m.cols > xq.rows * xq.cols
        {
            return Err(CudaError::Invalid(format!(
                "forced multi-token launch: {} tokens, {r} rows a warp at {ks} warps a row",
                bt.n_tok
            )));
        }
        let sel = MatSel {
            ids: 0,
            x_stride: bt.x_tok as i64,
            y_stride: bt.y_tok as i64,
        };
        self.launch_q8_dp4a_tokens(m, xq, y, bt, sel, (r, ks))
    }

    /// The dp4a multi-token kernel `matvec_q8_0_q8_t{T}r{R}` (T the token capacity:
    /// [`Launcher::token_capacity`]; `r` rows a warp: 1, 2 or 4) at `ks` warps a row,
    /// over every row of each of `bt.n_groups` matrices.
    fn launch_q8_dp4a_tokens(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        bt: Batch,
        sel: MatSel,
        (r, ks): (u32, u32),
    ) -> Result<(), CudaError> {
        let name = self.dp4a_tokens_kernel(bt.n_tok, r);
        let rows_per_block = ROWS_PER_BLOCK / ks * r;
        let grid = (
            (m.rows as u32).div_ceil(rows_per_block),
            bt.n_groups.max(1) as u32,
        );
        self.launch_q8_tokens(name, grid, ROWS_PER_BLOCK, m, xq, y, bt, sel, ks)
    }

    /// The shared expert's gate and up of a multi-row step (`tokens_pair`): two plain
    /// Q8_0 matrices of one shape on the same `n_tok` inputs (`x_stride` apart) as one
    /// dp4a launch of two groups — group 1's matrix, scales and outputs at their
    /// distances from group 0's — at the rows a warp and warps a row of a decode
    /// token's pair launch (`split_k_q8` over both), so each token gets the bits of its
    /// one-token pair. Ok(false) where it does not apply (tensor-core token counts,
    /// addresses whose distances are not whole elements): the caller launches two.
    pub(crate) fn matvec_q8_tokens_pair(
        &self,
        (m, y): (&DeviceMatrix, u64),
        (m2, y2): (&DeviceMatrix, u64),
        xq: &QuantAct,
        n_tok: usize,
        sel: MatSel,
    ) -> Result<bool, CudaError> {
        if !(2..mma_from().max(2)).contains(&n_tok)
            || !self.on(Variant::TokensPair)
            || m.ty != GgmlType::Q8_0
            || !same_stack_shape(m, m2)
            || sel.ids != 0
            || sel.x_stride <= 0
            || sel.y_stride < m.rows as i64
        {
            return Ok(false);
        }
        let dy = y2 as i64 - y as i64;
        let Some(mat) = q8_pair_strides(self, m, m2).filter(|_| dy % 4 == 0) else {
            return Ok(false);
        };
        check_act_cover(xq, m.cols, n_tok, sel.x_stride as usize)?;
        // A decode token's pair launch: two selections, so split_k_q8 of twice the rows,
        // then the early kernel's rows a warp.
        let ks = split_k_q8(m.rows, 2);
        let r = self.early_rows_a_warp(ks, m.cols);
        let bt = Batch {
            n_tok,
            x_tok: sel.x_stride as usize,
            y_tok: sel.y_stride as usize,
            n_groups: 2,
            x_grp: 0,
            y_grp: 0,
        };
        let layout = GroupLayout {
            mat,
            x: 0,
            y: dy / 4,
        };
        let name = self.dp4a_tokens_kernel(n_tok, r);
        let grid = ((m.rows as u32).div_ceil(ROWS_PER_BLOCK / ks * r), 2);
        self.launch_q8_tokens_at(name, grid, ROWS_PER_BLOCK, m, xq, y, bt, sel, ks, layout)?;
        Ok(true)
    }

    /// The dp4a token kernel for `n_tok` tokens at `r` rows a warp.
    fn dp4a_tokens_kernel(&self, n_tok: usize, r: u32) -> &'static str {
        match (self.token_capacity(n_tok), r) {
            (5, 1) => "matvec_q8_0_q8_t5r1",
            (5, 2) => "matvec_q8_0_q8_t5r2",
            (5, _) => "matvec_q8_0_q8_t5r4",
            (3, 1) => "matvec_q8_0_q8_t3r1",
            (3, 2) => "matvec_q8_0_q8_t3r2",
            (3, _) => "matvec_q8_0_q8_t3r4",
            (2, 1) => "matvec_q8_0_q8_t2r1",
            (2, 2) => "matvec_q8_0_q8_t2r2",
            (2, _) => "matvec_q8_0_q8_t2r4",
            (4, 1) => "matvec_q8_0_q8_t4r1",
            (4, 2) => "matvec_q8_0_q8_t4r2",
            (4, _) => "matvec_q8_0_q8_t4r4",
            (8, 1) => "matvec_q8_0_q8_t8r1",
            (8, 2) => "matvec_q8_0_q8_t8r2",
            (8, _) => "matvec_q8_0_q8_t8r4",
            (_, 1) => "matvec_q8_0_q8_t16r1",
            (_, 2) => "matvec_q8_0_q8_t16r2",
            _ => "matvec_q8_0_q8_t16r4",
        }
    }

    /// Launches a multi-token Q8_0 kernel (`matvec_q8_0_q8_t{T}r{R}`, or
    /// `matvec_q8_0_q8_mma8/16`: the same parameters) over `grid` blocks of `warps`
    /// warps, `ks` warps a row (or a row tile).
    #[allow(clippy::too_many_arguments)]
    fn launch_q8_tokens(
        &self,
        name: &'static str,
        (blocks, groups): (u32, u32),
        warps: u32,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        bt: Batch,
        sel: MatSel,
        ks: u32,
    ) -> Result<(), CudaError> {
        let elems = (m.rows * m.cols) as i64;
        let layout = GroupLayout {
            mat: (elems, elems / 32),
            x: bt.x_grp as i64,
            y: bt.y_grp as i64,
        };
        self.launch_q8_tokens_at(name, (blocks, groups), warps, m, xq, y, bt, sel, ks, layout)
    }

    /// [`Launcher::launch_q8_tokens`] with the groups' matrices, inputs and outputs at
    /// `layout`'s strides (a pair of separate matrices: their distances).
    #[allow(clippy::too_many_arguments)]
    fn launch_q8_tokens_at(
        &self,
        name: &'static str,
        (blocks, groups): (u32, u32),
        warps: u32,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        bt: Batch,
        sel: MatSel,
        ks: u32,
        layout: GroupLayout,
    ) -> Result<(), CudaError> {
        let f = self.func(name)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, groups, 1),
            block_dim: (32, warps, 1),
            shared_mem_bytes: 0,
        };
        let (gx, gy) = (layout.x, layout.y);
        let p: Vec<u64> = m.parts.iter().map(|b| b.ptr(self)).collect();
        let strides = layout.mat;
        let grid = 0u64;
        let mut b = self.launch_stream().launch_builder(&f);
        push_weights(&mut b, m.ty, &p, &strides, &grid);
        let (xq_p, xd_p) = (self.ptr(&xq.q), self.ptr(&xq.d));
        let (rows, cols, ks_arg) = (m.rows as i32, m.cols as i32, ks as i32);
        let n_arg = bt.n_tok as i32;
        b.arg(&xq_p)
            .arg(&xd_p)
            .arg(&y)
            .arg(&rows)
            .arg(&cols)
            .arg(&sel)
            .arg(&ks_arg)
            .arg(&n_arg)
            .arg(&gx)
            .arg(&gy);
        // SAFETY: argument order matches Q8_TOK_KERNEL in matvec_q8act.cu and
        // Q8_MMA_KERNEL in mma_tokens.cu (the same list); xq holds n_tok rows at
        // sel.x_stride (checked by the caller), y n_tok rows at sel.y_stride of m.rows
        // floats (caller).
        unsafe { self.launch_timed(name, &mut b, cfg) }?;
        Ok(())
    }

    /// [`Launcher::matvec_q8_tokens`] on int8 tensor cores (`tokens_mma`,
    /// kernels/mma_tokens.cu; rows of a multiple of 64 columns): warp tiles of 16 rows,
    /// split over `ks` warps where the matrix has few tiles so that enough warps stream
    /// its weights (`mma_wide`: ~4,096 warps, up to 16 a tile in blocks of up to 16
    /// warps; else ~1,024 warps, up to 8 a tile).
    fn matvec_q8_tokens_mma(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        bt: Batch,
        sel: MatSel,
    ) -> Result<(), CudaError> {
        let n_tok = bt.n_tok;
        let name = if n_tok <= 8 {
            "matvec_q8_0_q8_mma8"
        } else {
            "matvec_q8_0_q8_mma16"
        };
        let groups = bt.n_groups.max(1);
        let tiles = m.rows.div_ceil(16);
        // ncu (H200, a batched step of 8 sessions): at ~1,024 warps the grouped output
        // projection and wo_b ran one 8-warp block an SM, long-scoreboard stalls 7.7
        // cycles an instruction, 0.87 TB/s.
        let (target, max_ks) = if self.on(Variant::MmaWide) {
            (4096, MMA_TOKENS_MAX_KS)
        } else {
            (1024, ROWS_PER_BLOCK as usize)
        };
        // A warp takes whole steps of pairs of blocks (TMMA_UNROLL pairs for 8 tokens,
        // half for 16): no more warps a tile than a row has steps.
        let pairs = if n_tok <= 8 {
            TMMA_UNROLL
        } else {
            TMMA_UNROLL / 2
        };
        let steps = m.cols / 64 / pairs;
        let max_ks = max_ks.min(prev_power_of_two(steps.max(1)));
        let (ks, warps, tiles_per_block) = mma_split(tiles * groups, target, max_ks);
        let grid = ((tiles as u32).div_ceil(tiles_per_block), groups as u32);
        self.launch_q8_tokens(name, grid, warps, m, xq, y, bt, sel, ks)
    }
}

/// The split of the tensor-core token products' `tiles` 16-row tiles (over all groups)
/// so that about `target` warps stream the weights: (`ks` warps a tile, a power of two up
/// to `max_ks`; warps a block; tiles a block).
fn mma_split(tiles: usize, target: usize, max_ks: usize) -> (u32, u32, u32) {
    let ks = (target / tiles.max(1))
        .clamp(1, max_ks)
        .next_power_of_two()
        .min(max_ks) as u32;
    let warps = ks.max(ROWS_PER_BLOCK);
    (ks, warps, warps / ks)
}

/// Whether the tensor-core token products take a Q8_0 matrix of `cols` columns with
/// activations `x_tok` apart a token and `x_grp` a group: rows of a multiple of 256
/// columns and strides of 128, as the kernel reads a step's weight scales and
/// activation scales in 16-byte loads (every product of the model fits; the gpu-selftest
/// check asserts its shapes do).
pub(crate) fn tokens_mma_fits(cols: usize, x_tok: usize, x_grp: usize) -> bool {
    cols.is_multiple_of(256) && x_tok.is_multiple_of(128) && x_grp.is_multiple_of(128)
}

/// Whether the tf32 tensor-core token products (`f16_mma`) take an F16 matrix of `cols`
/// columns: whole 2-span steps of 32 columns, so a multiple of 64.
pub(crate) fn f16_mma_fits(cols: usize) -> bool {
    cols.is_multiple_of(64)
}

/// The largest power of two ≤ `n` (n ≥ 1).
fn prev_power_of_two(n: usize) -> usize {
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// Tokens from which a step's plain Q8_0 and F16 products take the tensor-core kernels
/// (`tokens_mma`, `f16_mma`): 8, or `DS4_CUDA_MMA_FROM` (2..=16) for timing other
/// thresholds.
pub(crate) fn mma_from() -> usize {
    static FROM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| {
        std::env::var("DS4_CUDA_MMA_FROM")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|n| (2..=Q8_TOKENS_MAX).contains(n))
            .unwrap_or(8)
    })
}

/// Most tokens of one [`Launcher::matvec_q8act`] call that share a pass over a plain
/// Q8_0 matrix (the multi-row step's rows; more take the GEMMs).
pub const Q8_TOKENS_MAX: usize = 16;

/// Where a multi-token Q8_0 launch finds group g: its matrix at g × `mat` (int8 values,
/// scales), its input at g × `x` and its output at g × `y` elements.
#[derive(Clone, Copy)]
struct GroupLayout {
    mat: (i64, i64),
    x: i64,
    y: i64,
}
