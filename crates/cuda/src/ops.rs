//! Kernel launchers.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};
use ds4_gguf::GgmlType;

use crate::device::Gpu;
use crate::error::CudaError;
use crate::layer::cfg;
use crate::matmul::Batch;
use crate::plan::{Launcher, Variant};
use crate::tokens::{f16_mma_fits, mma_from, Q8_TOKENS_MAX};
use crate::weights::DeviceMatrix;

/// Overrides of an int8-activation matvec launch (all `None`: the engine's choices).
#[derive(Clone, Copy, Default)]
struct Q8Launch {
    /// Q8_0: warps per row instead of the measured default.
    ks: Option<u32>,
    /// Another kernel of the same signature (the probes, or a named variant:
    /// `matvec_q8act_kernel`).
    kernel: Option<&'static str>,
    /// Q8_0: the distances (int8 values, scales) from matrix 0 to matrix 1 instead of
    /// the stack's (two matrices anywhere in device memory: `matvec_q8act_pair`).
    strides: Option<(i64, i64)>,
}

/// Which matrices of a stack a launch uses (mirrors `MatSel` in common.cuh).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MatSel {
    /// Device address of `i32` matrix ids, one per grid row; 0 = matrix 0 only.
    pub ids: u64,
    /// Input floats between consecutive selections (0: all share one input).
    pub x_stride: i64,
    /// Output floats between consecutive selections.
    pub y_stride: i64,
}

// SAFETY: plain repr(C) data with the layout of the CUDA struct.
unsafe impl DeviceRepr for MatSel {}

// EXP_ROWS_PER_WARP: rows per warp of the int8 expert kernels (Q2K_RX_ROWS, the row
// unit of matvec_q2_k_q8_rx, is the same); IQ2_RX_STEPS: steps of 32 lanes per row of
// `matvec_iq2_xxs_q8_rx`; Q8_ROWS_PER_WARP: rows per warp of `matvec_q8_0_q8_r4`.
// IQ2_LUT32_SMEM: the dynamic shared memory of `matvec_iq2_xxs_q8_rxtl` (its 48 KB of
// tables at a 32 KB boundary); IQ2_PRMT_SMEM: `matvec_iq2_xxs_q8_rxtm`'s (its tables
// around a 64 KB boundary).
use crate::consts::{
    EXP_ROWS_PER_WARP, IQ2_LUT32_SMEM, IQ2_PRMT_SMEM, IQ2_RX_STEPS, Q8_ROWS_PER_WARP,
    ROWS_PER_BLOCK,
};

/// Rows per warp unit, blocks per SM and warps per block of a register-activation expert
/// kernel: units of EXP_ROWS_PER_WARP at two blocks of ROWS_PER_BLOCK warps per SM,
/// except the pipelined IQ2_XXS kernels (`_rxp`, `_rxtp`: iq2_xxs_q8_rxp_body's R of 2
/// rows, or 4 at one block per SM for `probe_iq2_rxp4`) and `_rxtm` (one block of twice
/// the warps).
fn iq2_rx_units(kernel: &str) -> (usize, usize, u32) {
    let w = ROWS_PER_BLOCK;
    match kernel {
        "probe_iq2_rxp4" => (4, 1, w),
        "matvec_iq2_xxs_q8_rxp" | "matvec_iq2_xxs_q8_rxtp" | "matvec_iq2_xxs_q8_rxtl" => (2, 2, w),
        // One 16-warp block an SM (its tables at a 64 KB boundary).
        "matvec_iq2_xxs_q8_rxtm" => (2, 1, 2 * w),
        k if k.starts_with("probe_iq2_rxp_") => (2, 2, w),
        // q4k_rx_body's R: one 4096-column row (two spill), four 2048-column rows.
        "matvec_q4_k_q8_rx4" => (1, 2, w),
        "matvec_q4_k_q8_rx2" => (4, 2, w),
        _ => (EXP_ROWS_PER_WARP as usize, 2, w),
    }
}

/// The Q4_K register-activation kernels (`q4k_rx`) and the row width each takes.
const Q4K_RX_KERNELS: [(&str, usize); 2] =
    [("matvec_q4_k_q8_rx4", 4096), ("matvec_q4_k_q8_rx2", 2048)];

/// Fewest Q8_0 blocks of 32 that `quantize_q8_32x4` (variant `wide`) quantises: prefill
/// chunks (a 2,048-token chunk's 8,192-wide rows: 524,288 blocks); decode and the steps
/// over sessions (16 × 8,192 values: 4,096 blocks) keep a lane a value, more warps.
const WIDE_QUANT_BLOCKS: usize = 16384;

/// Fewest 256-blocks that `swiglu_q8k_w` (variant `wide`) takes: prefill chunks; a decode
/// token's 48 blocks (and the steps' few hundred) keep a thread a value, more warps.
/// (Session 32, H200, 2k, two interleaved pairs: the warp kernel from 1 block lost,
/// decode 189.4 against 193.4 tok/s, R = 2 7.07 against 6.89–6.96 ms a step.)
const WIDE_SWIGLU_BLOCKS: usize = 1024;

/// Fewest expert pairs (selections) of a launch that take the 32-copy IQ2_XXS tables
/// (`iq2_lut32`): their 48 KB a block are filled before the PDL wait. Session 10 measured
/// no gain at a decode token's 6 pairs; session 30 measured one (H200, 2k decode 188.65
/// -> 189.60 tok/s in two alternating pairs of runs; the 6-pair gate+up alone 17.9 ->
/// 16.3 µs), so every launch takes them.
const IQ2_LUT32_MIN_PAIRS: usize = 1;

/// Room kept beside the IQ2_XXS tables' dynamic shared memory for the kernel's static
/// shared memory (a 4-byte placeholder aligned to 2 KB) when checking a GPU's opt-in limit.
const IQ2_STATIC_SMEM: usize = 4096;

/// The dynamic shared memory an IQ2_XXS register-activation kernel asks for: the
/// 32-copy tables of `_rxtl` (at a 32 KB boundary) and `_rxtm` (at 64 KB); 0 for the rest.
pub(crate) fn iq2_dyn_smem(kernel: &str) -> usize {
    match kernel {
        "matvec_iq2_xxs_q8_rxtl" => IQ2_LUT32_SMEM,
        "matvec_iq2_xxs_q8_rxtm" => IQ2_PRMT_SMEM,
        _ => 0,
    }
}

/// `DS4_CUDA_LUT32_PAIRS=N` (1–4096): the fewest expert pairs that take the 32-copy
/// tables instead of IQ2_LUT32_MIN_PAIRS, for timing decode (6 pairs) with them.
fn lut32_min_pairs() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| env_count("DS4_CUDA_LUT32_PAIRS", 1..=4096).unwrap_or(IQ2_LUT32_MIN_PAIRS))
}

/// The timing knob `var` as a count within `range` (unset, unparsable or outside it:
/// None, so the tuned value stays).
fn env_count(var: &str, range: std::ops::RangeInclusive<usize>) -> Option<usize> {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| range.contains(n))
}

/// `DS4_CUDA_EXP_PER_SM=N` (1–16): blocks per SM of the register-activation expert
/// kernels instead of their tuned count, for timing batched steps (whose warps walk
/// many more row units than a decode token's).
fn exp_blocks_per_sm() -> Option<usize> {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *V.get_or_init(|| env_count("DS4_CUDA_EXP_PER_SM", 1..=16))
}

/// Warps per row (1, 2, 4 or 8: divides ROWS_PER_BLOCK) for a product of `rows` rows
/// and `n_sel` selections: short matrices split their columns so that the GPU holds
/// enough warps to stream the weights at full bandwidth.
pub(crate) fn split_k(rows: usize, n_sel: usize) -> u32 {
    match rows * n_sel {
        n if n >= 16384 => 1,
        n if n >= 4096 => 2,
        n if n >= 1024 => 4,
        _ => 8,
    }
}

/// Warps per row of the Q8_0 int8 matvec (block-of-32 lanes, 1 KiB per warp step):
/// measured on the H200 at the Flash shapes (`gpu-selftest --probe-q8`): one warp per
/// row from 4,096 rows, two for the 2,048-row shared expert, four below. The 129,280-row
/// output head took two while one warp a row meant one row a warp (135 against 158 µs);
/// with one warp a row it now gets two rows a warp (`q8_rows2`): 129.0 µs (4.36 TB/s,
/// 97% of the read probe) against 161.7 at two warps a row (session 29).
pub(crate) fn split_k_q8(rows: usize, n_sel: usize) -> u32 {
    match rows * n_sel {
        n if n >= 4096 => 1,
        n if n >= 2048 => 2,
        n if n >= 512 => 4,
        _ => 8,
    }
}

/// Pushes a matvec kernel's weight arguments for `ty` (they lead every matvec
/// signature): the parts `p` and the per-matrix strides `s` (Q8_0: int8 values and
/// scales; IQ2_XXS: quant words and scales, then the grid table; Q2_K after its three
/// parts, the others after their one: the stride in elements or blocks).
pub(crate) fn push_weights<'a>(
    b: &mut LaunchArgs<'a>,
    ty: GgmlType,
    p: &'a [u64],
    s: &'a (i64, i64),
    grid: &'a u64,
) {
    match ty {
        GgmlType::Q8_0 => b.arg(&p[0]).arg(&p[1]).arg(&s.0).arg(&s.1),
        GgmlType::IQ2_XXS => b.arg(&p[0]).arg(&p[1]).arg(&s.0).arg(&s.1).arg(grid),
        GgmlType::Q2_K => b.arg(&p[0]).arg(&p[1]).arg(&p[2]).arg(&s.0),
        _ => b.arg(&p[0]).arg(&s.0),
    };
}

/// Two stacks of one format and shape: one pair launch can serve both.
pub(crate) fn same_stack_shape(m: &DeviceMatrix, m2: &DeviceMatrix) -> bool {
    m2.ty == m.ty && (m2.rows, m2.cols, m2.n_mats) == (m.rows, m.cols, m.n_mats)
}

/// Two plain Q8_0 matrices as one launch's two groups: m2's int8 values and f16 scales
/// at their distances (bytes, scale elements) from m's, or None where the scales'
/// distance is not a whole element.
pub(crate) fn q8_pair_strides(
    g: &Launcher,
    m: &DeviceMatrix,
    m2: &DeviceMatrix,
) -> Option<(i64, i64)> {
    // (Q8_0: part 0 the int8 values, part 1 the f16 scales.)
    let (q, q2) = (m.part_ptr(g, 0) as i64, m2.part_ptr(g, 0) as i64);
    let (d, d2) = (m.part_ptr(g, 1) as i64, m2.part_ptr(g, 1) as i64);
    ((d2 - d) % 2 == 0).then_some((q2 - q, (d2 - d) / 2))
}

/// That `xq` covers `n_sel` inputs of `cols` values at `stride` (one shared row when
/// 0): a clear error, not a kernel reading past the activations.
pub(crate) fn check_act_cover(
    xq: &QuantAct,
    cols: usize,
    n_sel: usize,
    stride: usize,
) -> Result<(), CudaError> {
    let need = stride * n_sel.saturating_sub(1) + cols;
    if need > xq.rows * xq.cols || !stride.is_multiple_of(32) || (stride == 0 && xq.cols < cols) {
        return Err(CudaError::Invalid(format!(
            "activations of {}×{} do not cover {n_sel} inputs of {cols} at stride {stride}",
            xq.rows, xq.cols
        )));
    }
    Ok(())
}

impl Launcher<'_> {
    /// Whether this GPU gives a block of `kernel` the dynamic shared memory it asks for
    /// (iq2_dyn_smem), with room for its static tables.
    pub fn fits_smem(&self, kernel: &str) -> bool {
        let need = iq2_dyn_smem(kernel);
        need == 0 || need + IQ2_STATIC_SMEM <= self.info().smem_optin
    }

    /// `y[k][row] = W[ids[k]] · x[k]` for `n_sel` selections (`n_sel = 1`, `sel =
    /// MatSel::default()` for a plain matrix-vector product).
    pub fn matvec(
        &self,
        m: &DeviceMatrix,
        x: u64,
        y: u64,
        n_sel: usize,
        sel: MatSel,
    ) -> Result<(), CudaError> {
        if m.ty == GgmlType::F16
            && sel.ids == 0
            && sel.x_stride > 0
            && m.cols.is_multiple_of(8)
            && (2..=Q8_TOKENS_MAX).contains(&n_sel)
            && self.on(Variant::Tokens)
        {
            // (float4 activation loads: 16-byte aligned rows.)
            let aligned = x.is_multiple_of(16) && sel.x_stride % 4 == 0;
            if n_sel >= mma_from() && f16_mma_fits(m.cols) && aligned && self.on(Variant::F16Mma) {
                return self.matvec_f16_tokens_mma(m, x, y, n_sel, sel);
            }
            return self.matvec_f16_tokens(m, x, y, n_sel, sel);
        }
        let rows = m.rows as i32;
        let cols = m.cols as i32;
        let ks = if m.ty == GgmlType::F16 {
            split_k(m.rows, n_sel)
        } else {
            1
        };
        let cfg = LaunchConfig {
            grid_dim: (
                (m.rows as u32).div_ceil(ROWS_PER_BLOCK / ks),
                n_sel as u32,
                1,
            ),
            block_dim: (32, ROWS_PER_BLOCK, 1),
            shared_mem_bytes: 0,
        };
        let elems = (m.rows * m.cols) as i64;
        let p: Vec<u64> = m.parts.iter().map(|b| b.ptr(self)).collect();
        let kname = match m.ty {
            GgmlType::Q8_0 => "matvec_q8_0",
            GgmlType::F16 => "matvec_f16",
            GgmlType::F32 => "matvec_f32",
            GgmlType::IQ2_XXS => "matvec_iq2_xxs",
            GgmlType::Q2_K => "matvec_q2_k",
            GgmlType::Q4_K => "matvec_q4_k",
            other => return Err(CudaError::Invalid(format!("no matvec kernel for {other}"))),
        };
        // F16 weights loaded before the PDL wait where the selection is fixed (see
        // matvec_q8act_launch).
        let kname = if m.ty == GgmlType::F16 && sel.ids == 0 {
            self.pick(Variant::F16Early, kname, "matvec_f16_early")
        } else {
            kname
        };
        let f = self.func(kname)?;
        let mut b = self.launch_stream().launch_builder(&f);
        let (mat_a, mat_b) = match m.ty {
            GgmlType::Q8_0 => (elems, elems / 32),
            GgmlType::IQ2_XXS => (elems / 256 * 64, elems / 256),
            GgmlType::Q2_K | GgmlType::Q4_K => (elems / 256, 0),
            _ => (elems, 0),
        };
        let grid = self.iq2_grid()?;
        let strides = (mat_a, mat_b);
        push_weights(&mut b, m.ty, &p, &strides, &grid);
        b.arg(&x).arg(&y).arg(&rows).arg(&cols).arg(&sel);
        let ks_arg = ks as i32;
        if m.ty == GgmlType::F16 {
            b.arg(&ks_arg);
        }
        // SAFETY: argument order and types match the kernel signatures in matvec.cu;
        // the caller passes buffers of at least n_sel × cols inputs and n_sel × rows
        // outputs (checked by the safe wrappers that use this).
        unsafe { self.launch_timed(kname, &mut b, cfg) }?;
        Ok(())
    }

    /// Safe single-matrix product: `y = W · x`.
    pub fn matvec_buf(
        &self,
        m: &DeviceMatrix,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if x.len() < m.cols || y.len() < m.rows {
            return Err(CudaError::Invalid(format!(
                "matvec {}×{}: input {} / output {} too short",
                m.rows,
                m.cols,
                x.len(),
                y.len()
            )));
        }
        self.matvec(m, self.ptr(x), self.ptr(y), 1, MatSel::default())
    }

    /// Safe expert-stack product: `y[k] = W[ids[k]] · x[k]` (or `· x` when
    /// `shared_input`).
    pub fn matvec_selected(
        &self,
        m: &DeviceMatrix,
        ids: &CudaSlice<i32>,
        x: &CudaSlice<f32>,
        shared_input: bool,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = ids.len();
        let need_x = if shared_input { m.cols } else { n * m.cols };
        if x.len() < need_x || y.len() < n * m.rows {
            return Err(CudaError::Invalid(
                "matvec_selected: buffers too short".into(),
            ));
        }
        let sel = MatSel {
            ids: self.ptr(ids),
            x_stride: if shared_input { 0 } else { m.cols as i64 },
            y_stride: m.rows as i64,
        };
        self.matvec(m, self.ptr(x), self.ptr(y), n, sel)
    }

    fn iq2_grid(&self) -> Result<u64, CudaError> {
        Ok(self.ptr(&self.iq2_grid))
    }
}

/// Activations quantised to int8 per 32 values (ds4's Q8_0 activation rule), on the GPU.
pub struct QuantAct {
    pub q: CudaSlice<i8>,
    pub d: CudaSlice<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl Gpu {
    pub fn alloc_quant_act(&self, rows: usize, cols: usize) -> Result<QuantAct, CudaError> {
        if !cols.is_multiple_of(32) {
            return Err(CudaError::Invalid(format!(
                "{cols} activations are not whole 32-blocks"
            )));
        }
        Ok(QuantAct {
            q: self.zeros(rows * cols)?,
            d: self.zeros(rows * cols / 32)?,
            rows,
            cols,
        })
    }
}

/// The scale rule of quantised activations: one f32 scale per 32 values (`Q8_0`), or
/// one per 256 values stored once per 32 (`Q8K`, the K-quant and IQ2 activations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActRule {
    Q8_0,
    Q8K,
}

impl QuantAct {
    /// An error unless the first `rows` rows exist.
    fn check_rows(&self, rows: usize) -> Result<(), CudaError> {
        if rows > self.rows {
            return Err(CudaError::Invalid(format!(
                "{rows} rows into activations of {}",
                self.rows
            )));
        }
        Ok(())
    }
}

impl Launcher<'_> {
    /// Quantises `rows × cols` floats at `x` into `qa` with one scale per 256 values
    /// (Q8_K rule, bit-identical to the CPU's `quantize_q8_k`); the scale is stored
    /// once per 32 values.
    pub fn quantize_act_k(&self, x: u64, qa: &mut QuantAct) -> Result<(), CudaError> {
        self.quantize_rows(x, qa, qa.rows, ActRule::Q8K)
    }

    /// Quantises `rows × cols` floats at device address `x` into `qa`.
    pub fn quantize_act(&self, x: u64, qa: &mut QuantAct) -> Result<(), CudaError> {
        self.quantize_rows(x, qa, qa.rows, ActRule::Q8_0)
    }

    /// [`Launcher::quantize_act`] (`Q8_0`) or [`Launcher::quantize_act_k`] (`Q8K`) of
    /// the first `rows` rows only.
    pub fn quantize_rows(
        &self,
        x: u64,
        qa: &mut QuantAct,
        rows: usize,
        rule: ActRule,
    ) -> Result<(), CudaError> {
        qa.check_rows(rows)?;
        let (q, d) = (self.ptr(&qa.q), self.ptr(&qa.d));
        if rule == ActRule::Q8_0 {
            return self.quantize_q8_raw(x, q, d, rows * qa.cols / 32);
        }
        if !qa.cols.is_multiple_of(256) {
            return Err(CudaError::Invalid(format!(
                "{} activations are not whole 256-blocks",
                qa.cols
            )));
        }
        // x holds rows × cols floats (caller), q/d are sized by alloc_quant_act.
        let blocks = (rows * qa.cols / 256) as u32;
        launch!(self, "quantize_q8_k32", cfg(blocks, 256); x, q, d)
    }

    /// [`Launcher::quantize_rows`] in the Q8_K rule of `rows` rows at `x`, each row's
    /// result written to `k` consecutive rows of `qa` (row r to rows r·k..r·k + k): the
    /// same values as quantising `k` copies of every row.
    pub fn quantize_rows_rep(
        &self,
        x: u64,
        qa: &mut QuantAct,
        rows: usize,
        k: usize,
    ) -> Result<(), CudaError> {
        qa.check_rows(rows * k)?;
        if !qa.cols.is_multiple_of(256) {
            return Err(CudaError::Invalid(format!(
                "{} activations are not whole 256-blocks",
                qa.cols
            )));
        }
        let (q, d) = (self.ptr(&qa.q), self.ptr(&qa.d));
        let blocks = (rows * qa.cols / 256) as u32;
        let (cols, k) = (qa.cols as i32, k as i32);
        launch!(self, "quantize_q8_k32_rep", cfg(blocks, 256); x, q, d, cols, k)
    }

    /// `n_blocks` blocks of 32 floats at `x` to Q8_0 (int8 at `q`, one f32 scale per
    /// block at `d`); the caller sizes the buffers.
    pub(crate) fn quantize_q8_raw(
        &self,
        x: u64,
        q: u64,
        d: u64,
        n_blocks: usize,
    ) -> Result<(), CudaError> {
        // x holds n_blocks × 32 floats, q and d room for their Q8_0 form (caller).
        if self.on(Variant::Wide) && n_blocks >= WIDE_QUANT_BLOCKS {
            let nb = n_blocks as i64;
            let grid = cfg((n_blocks * 8).div_ceil(256) as u32, 256);
            return launch!(self, "quantize_q8_32x4", grid; x, q, d, nb);
        }
        let blocks = n_blocks as i32;
        let warps_per_block = 8u32;
        let grid = cfg(
            (blocks as u32).div_ceil(warps_per_block),
            32 * warps_per_block,
        );
        launch!(self, "quantize_q8_32", grid; x, q, d, blocks)
    }

    /// `rows` RMS norms of n values (weight `w`, 0 = none) written to `y` and quantised
    /// into `qa` (Q8_0 rule), as `rmsnorm` + `quantize_act` in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_q8(
        &self,
        x: u64,
        w: u64,
        w_type: i32,
        n: usize,
        rows: usize,
        eps: f32,
        y: u64,
        qa: &mut QuantAct,
    ) -> Result<(), CudaError> {
        if qa.cols != n || rows > qa.rows {
            return Err(CudaError::Invalid(format!(
                "rmsnorm_q8: {rows}×{n} into activations of {}×{}",
                qa.rows, qa.cols
            )));
        }
        // x/y hold rows × n floats (caller), q/d are sized by alloc_quant_act (checked).
        let grid = cfg(rows as u32, if n >= 1024 { 1024 } else { 256 });
        let name = self.pick(Variant::NormPl, "rmsnorm_q8", "rmsnorm_q8_pl");
        let (q, d, nn) = (self.ptr(&qa.q), self.ptr(&qa.d), n as i32);
        launch!(self, name, grid; x, w, w_type, nn, eps, y, q, d)
    }

    /// `swiglu` of `n_sel` rows of n into `mid` and, quantised, into `qa`: Q8_0 per 32
    /// (`k_rule = false`) or Q8_K per 256 (`k_rule = true`).
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu_quant(
        &self,
        gate: u64,
        up: u64,
        weights: u64,
        n: usize,
        n_sel: usize,
        clamp: f32,
        mid: u64,
        qa: &mut QuantAct,
        k_rule: bool,
    ) -> Result<(), CudaError> {
        let total = n * n_sel;
        let unit = if k_rule { 256 } else { 32 };
        if total > qa.rows * qa.cols || !n.is_multiple_of(unit) {
            return Err(CudaError::Invalid(format!(
                "swiglu_quant: {n_sel}×{n} into activations of {}×{}",
                qa.rows, qa.cols
            )));
        }
        let (q, d, nn, ns) = (self.ptr(&qa.q), self.ptr(&qa.d), n as i32, n_sel as i32);
        // gate/up/mid hold n·n_sel floats (caller).
        if k_rule && self.on(Variant::Wide) && total / 256 >= WIDE_SWIGLU_BLOCKS {
            let n_blocks = (total / 256) as i64;
            let grid = cfg((total / 256).div_ceil(8).max(1) as u32, 256);
            launch!(self, "swiglu_q8k_w", grid; gate, up, weights, nn, clamp, mid, q, d, n_blocks)
        } else if k_rule {
            let grid = cfg((total / 256) as u32, 256);
            launch!(self, "swiglu_q8k", grid; gate, up, weights, nn, clamp, mid, q, d)
        } else {
            let grid = cfg(((total / 32) as u32).div_ceil(8).max(1), 256);
            launch!(self, "swiglu_q8", grid; gate, up, weights, nn, ns, clamp, mid, q, d)
        }
    }

    /// `y[k] = W[ids[k]] · xq[k]` with int8 activations (`sel.x_stride` counts int8
    /// values; 0 = shared input). Q8_0, IQ2_XXS, Q2_K and Q4_K weights.
    pub fn matvec_q8act(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        n_sel: usize,
        sel: MatSel,
    ) -> Result<(), CudaError> {
        self.matvec_q8act_launch(m, None, xq, y, n_sel, sel, Q8Launch::default())
    }

    /// `y[k] = W[ids[k]] · xq[k]` and `y2[k] = W2[ids[k]] · xq[k]`: two stacks with the
    /// same selections and inputs in one launch when both are IQ2_XXS of one shape (the
    /// routed experts' gate and up) or both plain Q8_0 matrices of one shape applied to
    /// one input (the shared expert's), else as two launches.
    pub fn matvec_q8act_pair(
        &self,
        (m, y): (&DeviceMatrix, u64),
        (m2, y2): (&DeviceMatrix, u64),
        xq: &QuantAct,
        n_sel: usize,
        sel: MatSel,
    ) -> Result<(), CudaError> {
        let same_shape = same_stack_shape(m, m2);
        if same_shape && m.ty == GgmlType::Q8_0 && n_sel == 1 && sel.ids == 0 && y % 4 == y2 % 4 {
            // The Q8_0 kernel picks matrix `ids[blockIdx.y]` at that many strides past
            // the first: with ids 0 and 1 and the distance between the two matrices (and
            // outputs) as strides, one launch covers both.
            if let Some(strides) = q8_pair_strides(self, m, m2) {
                let pair = MatSel {
                    ids: self.ptr(&self.pair_ids),
                    x_stride: 0,
                    y_stride: (y2 as i64 - y as i64) / 4,
                };
                let opts = Q8Launch {
                    strides: Some(strides),
                    ..Q8Launch::default()
                };
                return self.matvec_q8act_launch(m, None, xq, y, 2, pair, opts);
            }
        }
        // A multi-row step's shared expert (`tokens_pair`).
        if n_sel > 1
            && self.on(Variant::Tokens)
            && self.matvec_q8_tokens_pair((m, y), (m2, y2), xq, n_sel, sel)?
        {
            return Ok(());
        }
        // One launch for both stacks: IQ2_XXS, or Q4_K where its register-activation
        // kernels apply.
        let one_launch = same_shape && (m.ty == GgmlType::IQ2_XXS || self.q4k_rx_shape(m));
        if !one_launch {
            self.matvec_q8act(m, xq, y, n_sel, sel)?;
            return self.matvec_q8act(m2, xq, y2, n_sel, sel);
        }
        self.matvec_q8act_launch(m, Some((m2, y2)), xq, y, n_sel, sel, Q8Launch::default())
    }

    /// A Q4_K stack that the register-activation kernels take (`q4k_rx`): rows of 4096
    /// columns (gate, up) or 2048 (down).
    fn q4k_rx_shape(&self, m: &DeviceMatrix) -> bool {
        m.ty == GgmlType::Q4_K
            && Q4K_RX_KERNELS.iter().any(|&(_, c)| c == m.cols)
            && self.on(Variant::Q4kRx)
    }

    /// [`Launcher::matvec_q8act`] with `ks` (1, 2, 4 or 8) warps per row of a Q8_0 matrix
    /// instead of the measured default (for tuning).
    pub fn matvec_q8act_split(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        (n_sel, sel): (usize, MatSel),
        ks: Option<u32>,
    ) -> Result<(), CudaError> {
        let opts = Q8Launch {
            ks,
            ..Q8Launch::default()
        };
        self.matvec_q8act_launch(m, None, xq, y, n_sel, sel, opts)
    }

    /// [`Launcher::matvec_q8act`] through a kernel named here, whatever the plan says:
    /// for IQ2_XXS one of the probe kernels of probe.cu (`probe_iq2_nolut`,
    /// `probe_iq2_nox`, `probe_iq2_loads`: the kernel with parts of its work taken out;
    /// outputs meaningless) for `gpu-selftest --probe-q8`, or a production kernel
    /// (`matvec_iq2_xxs_q8`, `_rx`, `_rxe`, `_rxt`, `_rxp`, `_rxtp`); for Q2_K `matvec_q2_k_q8` or `_rx`; for
    /// Q8_0 `matvec_q8_0_q8` or `_early` (the selftest's comparisons of the variants).
    #[doc(hidden)]
    pub fn matvec_q8act_kernel(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        (n_sel, sel): (usize, MatSel),
        kernel: &'static str,
    ) -> Result<(), CudaError> {
        let fits = match m.ty {
            GgmlType::IQ2_XXS => {
                kernel.starts_with("probe_iq2_") || kernel.starts_with("matvec_iq2_xxs_q8")
            }
            GgmlType::Q2_K => kernel.starts_with("matvec_q2_k_q8"),
            GgmlType::Q8_0 => kernel.starts_with("matvec_q8_0_q8"),
            GgmlType::Q4_K => kernel.starts_with("matvec_q4_k_q8"),
            _ => false,
        };
        if !fits {
            return Err(CudaError::Invalid(format!(
                "{kernel} is not an int8-activation kernel for {} matrices",
                m.ty
            )));
        }
        let opts = Q8Launch {
            kernel: Some(kernel),
            ..Q8Launch::default()
        };
        self.matvec_q8act_launch(m, None, xq, y, n_sel, sel, opts)
    }

    /// [`Launcher::matvec_q8act_pair`] for two IQ2_XXS stacks through a kernel named here
    /// (a production rx kernel or a `probe_iq2_rx*` probe): the routed experts' gate
    /// and up as decode launches them, for `gpu-selftest --probe-q8`.
    #[doc(hidden)]
    pub fn matvec_q8act_pair_kernel(
        &self,
        (m, y): (&DeviceMatrix, u64),
        (m2, y2): (&DeviceMatrix, u64),
        xq: &QuantAct,
        (n_sel, sel): (usize, MatSel),
        kernel: &'static str,
    ) -> Result<(), CudaError> {
        let same_shape = same_stack_shape(m, m2);
        if !(same_shape && m.ty == GgmlType::IQ2_XXS) {
            return Err(CudaError::Invalid(
                "a kernel-named pair takes two IQ2_XXS stacks of one shape".into(),
            ));
        }
        let opts = Q8Launch {
            kernel: Some(kernel),
            ..Q8Launch::default()
        };
        self.matvec_q8act_launch(m, Some((m2, y2)), xq, y, n_sel, sel, opts)
    }

    #[allow(clippy::too_many_arguments)]
    fn matvec_q8act_launch(
        &self,
        m: &DeviceMatrix,
        pair: Option<(&DeviceMatrix, u64)>,
        xq: &QuantAct,
        y: u64,
        n_sel: usize,
        sel: MatSel,
        opts: Q8Launch,
    ) -> Result<(), CudaError> {
        let Q8Launch {
            ks,
            kernel,
            strides,
        } = opts;
        if ks.is_some_and(|k| !matches!(k, 1 | 2 | 4 | 8)) {
            return Err(CudaError::Invalid(
                "warps per row must be 1, 2, 4 or 8".into(),
            ));
        }
        // Each selection reads m.cols values at k·x_stride (one shared row when 0).
        check_act_cover(xq, m.cols, n_sel, sel.x_stride.max(0) as usize)?;
        if m.ty == GgmlType::Q8_0
            && pair.is_none()
            && kernel.is_none()
            && strides.is_none()
            && sel.ids == 0
            && sel.x_stride > 0
            && (2..=Q8_TOKENS_MAX).contains(&n_sel)
            && self.on(Variant::Tokens)
        {
            let b = Batch {
                n_tok: n_sel,
                x_tok: sel.x_stride as usize,
                y_tok: sel.y_stride as usize,
                n_groups: 1,
                x_grp: 0,
                y_grp: 0,
            };
            return self.matvec_q8_tokens(m, xq, y, b, ks);
        }
        let rows = m.rows as i32;
        let cols = m.cols as i32;
        let elems = (m.rows * m.cols) as i64;
        let x_bytes = (m.cols + m.cols / 32 * 4) as u32;
        let p: Vec<u64> = m.parts.iter().map(|b| b.ptr(self)).collect();
        let (xq_p, xd_p) = (self.ptr(&xq.q), self.ptr(&xq.d));
        let (name, smem) = match m.ty {
            GgmlType::Q8_0 => ("matvec_q8_0_q8", 0),
            GgmlType::IQ2_XXS => ("matvec_iq2_xxs_q8", 2048 + x_bytes),
            GgmlType::Q2_K => ("matvec_q2_k_q8", x_bytes),
            GgmlType::Q4_K => ("matvec_q4_k_q8", x_bytes),
            other => {
                return Err(CudaError::Invalid(format!(
                    "no int8-activation kernel for {other}"
                )))
            }
        };
        // The register-activation kernels: IQ2_XXS rows of IQ2_RX_STEPS × 32 steps
        // (4096 columns), Q2_K rows of 32 steps (2048 columns).
        let iq2_shape = m.ty == GgmlType::IQ2_XXS && m.cols == IQ2_RX_STEPS * 32 * 64;
        let q2k_shape = m.ty == GgmlType::Q2_K && m.cols == 32 * 64;
        let name = match kernel {
            Some(k) => k,
            None if iq2_shape && self.on(Variant::Iq2Rx) => {
                if self.on(Variant::Iq2Tab) {
                    // The 32-copy tables' kernels where the GPU gives a block their
                    // shared memory.
                    if self.on(Variant::Iq2Pipe)
                        && self.on(Variant::Iq2Lut32)
                        && n_sel >= lut32_min_pairs()
                        && self.fits_smem("matvec_iq2_xxs_q8_rxtl")
                    {
                        if self.on(Variant::Iq2Prmt) && self.fits_smem("matvec_iq2_xxs_q8_rxtm") {
                            "matvec_iq2_xxs_q8_rxtm"
                        } else {
                            "matvec_iq2_xxs_q8_rxtl"
                        }
                    } else if self.on(Variant::Iq2Pipe) {
                        "matvec_iq2_xxs_q8_rxtp"
                    } else {
                        "matvec_iq2_xxs_q8_rxt"
                    }
                } else if self.on(Variant::Iq2Pipe) {
                    "matvec_iq2_xxs_q8_rxp"
                } else if self.on(Variant::Iq2Early) {
                    "matvec_iq2_xxs_q8_rxe"
                } else {
                    "matvec_iq2_xxs_q8_rx"
                }
            }
            None if q2k_shape && self.on(Variant::Q2kRx) => "matvec_q2_k_q8_rx",
            None if self.q4k_rx_shape(m) => Q4K_RX_KERNELS
                .iter()
                .find(|&&(_, c)| c == m.cols)
                .map_or(name, |&(k, _)| k),
            // Weights loaded before the PDL wait: only where the matrix selection is
            // fixed (no ids, or the constant shared-expert pair), as its ids are read
            // before the wait too.
            None if m.ty == GgmlType::Q8_0
                && self.on(Variant::Q8Early)
                && (sel.ids == 0 || sel.ids == self.ptr(&self.pair_ids) || self.ids_constant()) =>
            {
                "matvec_q8_0_q8_early"
            }
            None => name,
        };
        let iq2_rx = name.starts_with("matvec_iq2_xxs_q8_rx") || name.starts_with("probe_iq2_rx");
        let q2k_rx = name == "matvec_q2_k_q8_rx";
        let q4k_cols = Q4K_RX_KERNELS
            .iter()
            .find(|&&(k, _)| k == name)
            .map(|&(_, c)| c);
        let q4k_rx = q4k_cols.is_some();
        let q4k_fits = m.ty == GgmlType::Q4_K && q4k_cols == Some(m.cols);
        if (iq2_rx && !iq2_shape) || (q2k_rx && !q2k_shape) || (q4k_rx && !q4k_fits) {
            return Err(CudaError::Invalid(format!(
                "{name} does not take {} rows of {} columns",
                m.ty, m.cols
            )));
        }
        // Q8_0: warps per row (see matvec_q8_0_q8). Where one warp takes a row of the
        // early kernel, `q8_rows` / `q8_rows2` give it 4 rows (≤ 1,024 columns: q_b) or 2
        // (H200 2k decode 166.3 -> 168.2 tok/s; an older kernel lost with several rows
        // per warp, 74.6 -> 70.0, when it kept fewer loads in flight).
        let ks = if m.ty == GgmlType::Q8_0 {
            ks.unwrap_or_else(|| split_k_q8(m.rows, n_sel))
        } else {
            1
        };
        let early_ks1 = name == "matvec_q8_0_q8_early" && kernel.is_none() && ks == 1;
        let name = if early_ks1 && m.cols <= 1024 && self.on(Variant::Q8Rows) {
            "matvec_q8_0_q8_r4"
        } else if early_ks1 && m.cols > 1024 && self.on(Variant::Q8Rows2) {
            "matvec_q8_0_q8_r2"
        } else {
            name
        };
        let f = self.func(name)?;
        let rows_per_block = if name == "matvec_q8_0_q8_r4" {
            ROWS_PER_BLOCK * Q8_ROWS_PER_WARP
        } else if name == "matvec_q8_0_q8_r2" {
            ROWS_PER_BLOCK * 2
        } else if m.ty == GgmlType::Q8_0 {
            ROWS_PER_BLOCK / ks
        } else {
            ROWS_PER_BLOCK * EXP_ROWS_PER_WARP
        };
        let n_grid = if pair.is_some() { 2 * n_sel } else { n_sel };
        let cfg = if iq2_rx || q2k_rx || q4k_rx {
            // Warps walk row units of EXP_ROWS_PER_WARP (IQ2) / Q2K_RX_ROWS (Q2_K) rows;
            // the pipelined IQ2 kernels' units are smaller (see iq2_rx_units).
            let (unit_rows, per_sm, warps) = iq2_rx_units(name);
            let per_sm = exp_blocks_per_sm().unwrap_or(per_sm);
            let units = n_grid * m.rows.div_ceil(unit_rows);
            let blocks = units
                .div_ceil(warps as usize)
                .min(per_sm * self.info().multiprocessors.max(1) as usize);
            let smem = iq2_dyn_smem(name);
            if smem > 0 {
                self.allow_smem(name, smem)?;
            }
            LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (32, warps, 1),
                shared_mem_bytes: smem as u32,
            }
        } else {
            LaunchConfig {
                grid_dim: ((m.rows as u32).div_ceil(rows_per_block), n_grid as u32, 1),
                block_dim: (32, ROWS_PER_BLOCK, 1),
                shared_mem_bytes: smem,
            }
        };
        let mut b = self.launch_stream().launch_builder(&f);
        let grid = self.ptr(&self.iq2_grid);
        let (mat_q, mat_d, mat_blocks) = (elems / 256 * 64, elems / 256, elems / 256);
        let strides = match m.ty {
            GgmlType::Q8_0 => strides.unwrap_or((elems, elems / 32)),
            GgmlType::IQ2_XXS => (mat_q, mat_d),
            _ => (mat_blocks, 0),
        };
        push_weights(&mut b, m.ty, &p, &strides, &grid);
        b.arg(&xq_p)
            .arg(&xd_p)
            .arg(&y)
            .arg(&rows)
            .arg(&cols)
            .arg(&sel);
        let ks_arg = ks as i32;
        if m.ty == GgmlType::Q8_0 {
            b.arg(&ks_arg);
        }
        // The optional second stack (same selections, input and shape) of the IQ2_XXS and
        // Q4_K pair kernels: its weights (and IQ2_XXS scales) and output.
        let (qs2, dw2, y2) = match pair {
            Some((m2, y2)) if m.ty == GgmlType::IQ2_XXS => {
                (m2.part_ptr(self, 0), m2.part_ptr(self, 1), y2)
            }
            Some((m2, y2)) => (m2.part_ptr(self, 0), 0, y2),
            None => (0, 0, 0),
        };
        let n_pair = n_sel as i32;
        if m.ty == GgmlType::IQ2_XXS {
            b.arg(&qs2).arg(&dw2).arg(&y2).arg(&n_pair);
        }
        if q2k_rx {
            b.arg(&n_pair);
        }
        // Q4_K register-activation kernels: the optional second stack and its output.
        if q4k_rx {
            b.arg(&qs2).arg(&y2).arg(&n_pair);
        }
        // SAFETY: argument order matches matvec_q8act.cu; xq holds n_sel rows (or one
        // shared row) of m.cols values; y holds n_sel × m.rows floats (caller).
        unsafe { self.launch_timed(name, &mut b, cfg) }?;
        Ok(())
    }
}
