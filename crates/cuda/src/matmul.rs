//! Batched (prefill) matrix-matrix products: launchers of `kernels/matmul.cu` and
//! `kernels/matmul_f32.cu`.
//!
//! Every launcher validates its sizes (returning [`CudaError::Invalid`]), enqueues on the
//! GPU's stream without synchronising, and allocates nothing: the route plan is allocated
//! once by [`Gpu::alloc_route_plan`].

use cudarc::driver::{CudaSlice, LaunchArgs, LaunchConfig, PushKernelArg};
use ds4_gguf::GgmlType;

use crate::device::Gpu;
use crate::error::CudaError;
use crate::hostmem::Part;
use crate::layer::cfg;
use crate::ops::QuantAct;
use crate::plan::{Launcher, Variant};
use crate::weights::DeviceMatrix;

/// How the rows of a batched product are laid out (element strides).
#[derive(Clone, Copy, Debug)]
pub struct Batch {
    pub n_tok: usize,
    /// Input elements between consecutive tokens / output floats between consecutive tokens.
    pub x_tok: usize,
    pub y_tok: usize,
    /// Grouped matrices (the attention output's o_groups matrices of m.rows rows each,
    /// matrix g reads input columns at g·x_grp and writes at g·y_grp); 1 = plain.
    pub n_groups: usize,
    pub x_grp: usize,
    pub y_grp: usize,
}

impl Batch {
    /// `n_tok` tokens of one matrix, inputs `cols` and outputs `rows` apart (packed rows).
    pub fn plain(n_tok: usize, cols: usize, rows: usize) -> Batch {
        Batch {
            n_tok,
            x_tok: cols,
            y_tok: rows,
            n_groups: 1,
            x_grp: 0,
            y_grp: 0,
        }
    }

    /// `n_tok` tokens of `groups` matrices side by side: matrix g reads columns
    /// g·cols… of a token's `groups`·cols inputs and writes rows g·rows… of its
    /// `groups`·rows outputs (the attention's grouped output projection).
    pub fn grouped(n_tok: usize, groups: usize, cols: usize, rows: usize) -> Batch {
        Batch {
            n_tok,
            x_tok: groups * cols,
            y_tok: groups * rows,
            n_groups: groups,
            x_grp: cols,
            y_grp: rows,
        }
    }
}

/// Pairs per work item of the expert GEMM (`mm_exp_*_b*`: 4 warps of 32 rows × 32 pairs).
const EXP_TILE: usize = 32;
/// Pairs per work item of the wide expert GEMM (`mm_exp_*_w`: 8 warps of 16 rows × 64
/// pairs), for plans whose experts average at least EXP_TILE pairs (Variant::ExpWide).
const EXP_TILE_WIDE: usize = 64;
/// Rows per block of the expert GEMM (either tile).
const EXP_ROWS: usize = 128;
/// `matmul_experts_q8act`'s `variant` that forces the wide kernel (0..=2 force the
/// 32-pair kernel at minimum 2, 3, 4 blocks per SM).
pub const EXP_VARIANT_WIDE: usize = 3;

/// A per-call plan of the routed-expert GEMM, built on the device by [`Launcher::route_plan`].
pub struct RoutePlan {
    pub n_expert: usize,
    pub max_pairs: usize,
    max_items: usize,
    /// Pairs of the last [`Launcher::route_plan`] call.
    n_pairs: usize,
    /// Pairs per work item of the last [`Launcher::route_plan`] call (EXP_TILE or
    /// EXP_TILE_WIDE).
    pub(crate) tile: usize,
    /// `[n_expert + 1]`: first slot of each expert in `pairs`; the last entry is the
    /// number of valid pairs.
    pub offsets: CudaSlice<i32>,
    /// `[max_pairs]`: pair indices grouped by expert (order within an expert unspecified).
    pub pairs: CudaSlice<i32>,
    /// `[max_items][4]`: {expert, first slot, pairs ≤ tile, 0}.
    pub(crate) items: CudaSlice<i32>,
    pub(crate) n_items: CudaSlice<i32>,
}

impl RoutePlan {
    /// Pairs planned by the last [`Launcher::route_plan`] call.
    pub fn n_pairs(&self) -> usize {
        self.n_pairs
    }

    /// Pairs per work item of the last [`Launcher::route_plan`] call.
    pub fn tile(&self) -> usize {
        self.tile
    }
}

/// Upper bound on work items for `n_pairs` pairs over `n_expert` experts, `tile` pairs
/// an item at most.
pub(crate) fn max_items(n_pairs: usize, n_expert: usize, tile: usize) -> usize {
    n_pairs / tile + n_pairs.min(n_expert)
}

/// Tile shapes of the dense Q8_0 kernel (rows × tokens).
const Q8_TILES: [(usize, usize, &str); 3] = [
    (128, 128, "mm_q8_0_128x128"),
    (128, 64, "mm_q8_0_128x64"),
    (64, 64, "mm_q8_0_64x64"),
];

fn q8_stage_bytes(bm: usize, bn: usize) -> usize {
    (bm + bn) * 144 + bm * 8 + 4 * bn * 4
}

/// Stage bytes of the expert GEMM over `pairs` pairs a block: weights (`exp_w_bytes`) +
/// activations (`exp_x_bytes`) in matmul.cu.
fn exp_stage_bytes(ty: GgmlType, pairs: usize) -> usize {
    let w = match ty {
        GgmlType::Q8_0 => 128 * 272 + 128 * 16,
        GgmlType::IQ2_XXS => 128 * 96 + 128 * 4,
        GgmlType::Q2_K => 128 * 96 + 128 * 16 + 128 * 4,
        _ => 128 * 160,
    };
    let x_pitch = if ty == GgmlType::Q8_0 { 272 } else { 288 };
    w + pairs * x_pitch + 8 * pairs * 4
}

/// The arguments that end every GEMM kernel's signature: `n_tok` (i32), then the token
/// and group strides of x and y (i64).
struct BatchTail {
    n_tok: i32,
    strides: [i64; 4],
}

impl BatchTail {
    fn of(b: &Batch) -> BatchTail {
        BatchTail {
            n_tok: b.n_tok as i32,
            strides: [b.x_tok, b.x_grp, b.y_tok, b.y_grp].map(|v| v as i64),
        }
    }

    fn push<'a>(&'a self, l: &mut LaunchArgs<'a>) {
        l.arg(&self.n_tok);
        for s in &self.strides {
            l.arg(s);
        }
    }
}

/// The four split-K kernels `PREFIX_s1` … `PREFIX_s8` of a `matmul_f32` format.
macro_rules! split_k_names {
    ($prefix:literal) => {
        [
            concat!($prefix, "_s1"),
            concat!($prefix, "_s2"),
            concat!($prefix, "_s4"),
            concat!($prefix, "_s8"),
        ]
    };
}

/// The expert GEMM of a format at minimum 2, 3 and 4 blocks per SM (`PREFIX_b2` …), then
/// its 64-pair tile (`PREFIX_w`, index EXP_VARIANT_WIDE).
macro_rules! occupancy_names {
    ($prefix:literal) => {
        [
            concat!($prefix, "_b2"),
            concat!($prefix, "_b3"),
            concat!($prefix, "_b4"),
            concat!($prefix, "_w"),
        ]
    };
}

pub(crate) fn invalid(msg: String) -> CudaError {
    CudaError::Invalid(msg)
}

impl DeviceMatrix {
    /// Uploads raw BF16 matrices (`n_mats × rows × cols`, little-endian, no repacking).
    pub fn upload_bf16(
        gpu: &Gpu,
        src: &[u8],
        rows: usize,
        cols: usize,
        n_mats: usize,
    ) -> Result<DeviceMatrix, CudaError> {
        if src.len() != rows * cols * n_mats * 2 {
            return Err(invalid(format!(
                "BF16: {} bytes for {n_mats}×{rows}×{cols}",
                src.len()
            )));
        }
        Ok(DeviceMatrix {
            ty: GgmlType::BF16,
            rows,
            cols,
            n_mats,
            parts: vec![Part::Device(gpu.upload_bulk(src)?)],
        })
    }
}

impl Gpu {
    /// A route plan for up to `max_pairs` (token, expert) pairs over `n_expert ≤ 1024`
    /// experts.
    pub fn alloc_route_plan(
        &self,
        max_pairs: usize,
        n_expert: usize,
    ) -> Result<RoutePlan, CudaError> {
        if n_expert == 0 || n_expert > 1024 || max_pairs > i32::MAX as usize / 2 {
            return Err(invalid(format!(
                "route plan: {n_expert} experts (1..=1024), {max_pairs} pairs"
            )));
        }
        let mi = max_items(max_pairs, n_expert, EXP_TILE).max(1);
        Ok(RoutePlan {
            n_expert,
            max_pairs,
            max_items: mi,
            n_pairs: 0,
            tile: EXP_TILE,
            offsets: self.zeros(n_expert + 1)?,
            pairs: self.zeros(max_pairs.max(1))?,
            items: self.zeros(4 * mi)?,
            n_items: self.zeros(1)?,
        })
    }
}

impl Launcher<'_> {
    /// Checks a batch layout against a matrix of `cols` inputs and `in_elems` input
    /// elements; returns the elements read.
    fn check_batch(
        &self,
        what: &str,
        m: &DeviceMatrix,
        b: &Batch,
        in_elems: Option<usize>,
    ) -> Result<(), CudaError> {
        if b.n_groups == 0 || b.n_groups > m.n_mats || b.n_groups > 65535 {
            return Err(invalid(format!(
                "{what}: {} groups of a stack of {} matrices",
                b.n_groups, m.n_mats
            )));
        }
        if b.n_groups > 1 && (b.x_grp == 0 && b.y_grp == 0) {
            return Err(invalid(format!("{what}: groups need x_grp/y_grp")));
        }
        if b.y_tok < m.rows && b.n_tok > 1 && b.n_groups == 1 {
            return Err(invalid(format!(
                "{what}: output rows of {} overlap ({} apart)",
                m.rows, b.y_tok
            )));
        }
        if m.rows.div_ceil(64) > 65535 || b.n_tok > i32::MAX as usize {
            return Err(invalid(format!("{what}: {} rows is too many", m.rows)));
        }
        if let Some(have) = in_elems {
            let need = (b.n_tok - 1) * b.x_tok + (b.n_groups - 1) * b.x_grp + m.cols;
            if need > have {
                return Err(invalid(format!(
                    "{what}: the batch reads {need} input elements of {have}"
                )));
            }
        }
        Ok(())
    }

    /// `Y[t·y_tok + g·y_grp + r] = Σ_c W_g[r][c]·(xq.q·xq.d)[t·x_tok + g·x_grp + c]` with
    /// int8 tensor cores (mma m16n8k32: one k-step per 32-block, int32 partials scaled by
    /// weight × activation scale in f32). Q8_0 (any cols multiple of 32), IQ2_XXS, Q2_K,
    /// Q4_K (cols multiple of 256). `y` must hold the addressed floats.
    pub fn matmul_q8act(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        b: Batch,
    ) -> Result<(), CudaError> {
        // A prefill chunk's launcher may take fp16 tensor cores (matmul_f16.rs).
        if let Some(slot) = self.q8_f16_slot(m, xq, &b) {
            return self.matmul_q8act_f16(m, xq, y, b, slot);
        }
        self.matmul_q8act_tiled(m, xq, y, b, None)
    }

    /// [`Launcher::matmul_q8act`] with a forced Q8_0 tile (index into 128×128, 128×64, 64×64;
    /// `None` = chosen by size). For the checks.
    #[doc(hidden)]
    pub fn matmul_q8act_tiled(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        b: Batch,
        tile: Option<usize>,
    ) -> Result<(), CudaError> {
        if b.n_tok == 0 {
            return Ok(());
        }
        let what = format!("matmul_q8act {} {}×{}", m.ty, m.rows, m.cols);
        self.check_batch(&what, m, &b, Some(xq.rows * xq.cols))?;
        if !b.x_tok.is_multiple_of(32) || !b.x_grp.is_multiple_of(32) {
            return Err(invalid(format!(
                "{what}: input strides {} / {} are not whole 32-blocks",
                b.x_tok, b.x_grp
            )));
        }
        if m.ty != GgmlType::Q8_0 {
            return self.launch_exp(m, xq, y, None, 1, &b, None);
        }
        if !m.cols.is_multiple_of(32) {
            return Err(invalid(format!("{what}: cols not whole blocks")));
        }
        let sms = self.info().multiprocessors.max(1) as usize;
        let blocks = |bm: usize, bn: usize| m.rows.div_ceil(bm) * b.n_tok.div_ceil(bn) * b.n_groups;
        let pick = match tile {
            Some(t) if t < Q8_TILES.len() => t,
            Some(t) => return Err(invalid(format!("{what}: no tile {t}"))),
            // Measured on the H200 at 512 tokens (NOTES.md): the large tiles win once the
            // grid fills the GPU, 64×64 below that.
            None if blocks(128, 128) >= 2 * sms => 0,
            None if 10 * blocks(128, 64) >= 9 * sms => 1,
            None => 2,
        };
        let (bm, bn, name) = Q8_TILES[pick];
        let smem = 2 * q8_stage_bytes(bm, bn);
        self.allow_smem(name, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (
                b.n_tok.div_ceil(bn) as u32,
                m.rows.div_ceil(bm) as u32,
                b.n_groups as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (qs, dw) = (m.part_ptr(self, 0), m.part_ptr(self, 1));
        let mat_q = (m.rows * m.cols) as i64;
        let mat_d = mat_q / 32;
        let (xqp, xdp) = (self.ptr(&xq.q), self.ptr(&xq.d));
        let (rows, cols) = (m.rows as i32, m.cols as i32);
        let tail = BatchTail::of(&b);
        // The input extent was checked above, the output extent is the caller's contract.
        launch!(self, name, cfg; qs, dw, mat_q, mat_d, xqp, xdp, y, rows, cols; tail)
    }

    /// The expert-layout GEMM (`mm_exp_*`): with `plan` over its work items (a kernel of
    /// fewer pairs than the plan's items takes each item in slices, grid z), otherwise
    /// dense over `b` (tokens in tiles of 32, groups in grid z).
    #[allow(clippy::too_many_arguments)]
    fn launch_exp(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        plan: Option<&RoutePlan>,
        k_div: usize,
        b: &Batch,
        variant: Option<usize>,
    ) -> Result<(), CudaError> {
        // Kernels per format with minimum 2, 3, 4 blocks per SM (register caps), then the
        // wide one; the default of a 32-pair plan, then of a 64-pair plan. Only IQ2_XXS
        // gains from the wide kernel (its grid lookups, conflict-free there); Q2_K's lost
        // (1,098 against 984 µs a 2,048-token launch: 128 registers, 24 bytes spilled,
        // against 163 at three 4-warp blocks), so its 64-pair items run in two slices.
        let (names, default, default_wide) = match m.ty {
            GgmlType::Q8_0 => (occupancy_names!("mm_exp_q8_0"), 2, 2),
            GgmlType::IQ2_XXS => (occupancy_names!("mm_exp_iq2_xxs"), 2, EXP_VARIANT_WIDE),
            GgmlType::Q2_K => (occupancy_names!("mm_exp_q2_k"), 1, 1),
            GgmlType::Q4_K => (occupancy_names!("mm_exp_q4_k"), 0, 0),
            other => {
                return Err(invalid(format!(
                    "no int8 tensor-core GEMM for {other} weights"
                )))
            }
        };
        let pick = match (variant, plan) {
            // The dense mode's grid is in 32-token tiles.
            (Some(EXP_VARIANT_WIDE), None) => {
                return Err(invalid("the wide expert GEMM takes a route plan".into()))
            }
            (Some(v), _) if v < names.len() => v,
            (Some(v), _) => return Err(invalid(format!("no expert GEMM variant {v}"))),
            (None, Some(pl)) if pl.tile == EXP_TILE_WIDE => default_wide,
            (None, _) => default,
        };
        let name = names[pick];
        let kernel_pairs = if pick == EXP_VARIANT_WIDE {
            EXP_TILE_WIDE
        } else {
            EXP_TILE
        };
        if !m.cols.is_multiple_of(256) {
            return Err(invalid(format!(
                "{name}: {} columns are not whole 256-blocks",
                m.cols
            )));
        }
        let stage = exp_stage_bytes(m.ty, kernel_pairs);
        // The IQ2_XXS grid table: 16 copies in the wide kernel (exp_grid_copies).
        let table = match (m.ty, kernel_pairs) {
            (GgmlType::IQ2_XXS, EXP_TILE_WIDE) => 16 * 2048,
            (GgmlType::IQ2_XXS, _) => 2048,
            _ => 0,
        };
        let smem = 2 * stage + table;
        self.allow_smem(name, smem)?;
        let (w, mats) = self.exp_parts(m);
        let grid_tab = self.ptr(&self.iq2_grid);
        let (xqp, xdp) = (self.ptr(&xq.q), self.ptr(&xq.d));
        let (rows, cols) = (m.rows as i32, m.cols as i32);
        let (items, n_items, pairs, grid_y, grid_z) = match plan {
            Some(pl) => (
                self.ptr(&pl.items),
                self.ptr(&pl.n_items),
                self.ptr(&pl.pairs),
                max_items(pl.n_pairs, pl.n_expert, pl.tile),
                pl.tile.div_ceil(kernel_pairs),
            ),
            None => (0, 0, 0, b.n_tok.div_ceil(EXP_TILE), b.n_groups),
        };
        let k_div = k_div as i32;
        let tail = BatchTail::of(b);
        let cfg = LaunchConfig {
            grid_dim: (
                m.rows.div_ceil(EXP_ROWS) as u32,
                grid_y as u32,
                grid_z as u32,
            ),
            block_dim: (4 * kernel_pairs as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // Inputs were checked by the callers, the plan's items index pairs < n_pairs.
        let [w0, w1, w2] = w;
        let [m0, m1, m2] = mats;
        launch!(self, name, cfg;
            w0, w1, w2, m0, m1, m2, grid_tab, xqp, xdp, y, rows, cols, items, n_items, pairs, k_div; tail
        )
    }

    /// An expert stack's weight parts as the expert GEMMs (`mm_exp_*`, `mm_exp_f16_*`)
    /// take them: three device addresses and each one's bytes per matrix (see weights.rs
    /// `part_layout`; unused slots repeat part 0 with stride 0).
    pub(crate) fn exp_parts(&self, m: &DeviceMatrix) -> ([u64; 3], [i64; 3]) {
        let elems = m.rows * m.cols;
        let nb = (elems / 256) as i64;
        let p: Vec<u64> = m.parts.iter().map(|b| b.ptr(self)).collect();
        match m.ty {
            GgmlType::Q8_0 => ([p[0], p[1], p[0]], [elems as i64, elems as i64 / 16, 0]),
            GgmlType::IQ2_XXS => ([p[0], p[1], p[0]], [nb * 64, nb * 2, 0]),
            GgmlType::Q2_K => ([p[0], p[1], p[2]], [nb * 64, nb * 16, nb * 4]),
            _ => ([p[0], p[0], p[0]], [nb * 144, 0, 0]),
        }
    }

    /// f32 activations × F32/F16/BF16/Q8_0 weights with f32 accumulation per 32-wide
    /// k-tile, then across tiles (the numerics of the decode matvecs up to summation order). `x` holds the
    /// addressed floats (x_tok, x_grp multiples of 4), `y` the outputs.
    pub fn matmul_f32(&self, m: &DeviceMatrix, x: u64, y: u64, b: Batch) -> Result<(), CudaError> {
        // A prefill chunk's launcher may take fp16 tensor cores for F16 weights
        // (matmul_f16.rs: the activation as fp16 hi + lo, the tf32 split's precision).
        if let Some(slot) = self.f16_split_slot(m, &b) {
            return self.matmul_f16_split(m, x, y, b, slot);
        }
        self.matmul_f32_opts(m, x, y, b, None, None)
    }

    /// [`Launcher::matmul_f32`] with a forced split-K factor (1, 2, 4 or 8 blocks of a
    /// cluster share an output tile; `None` = chosen by size) and a choice between the
    /// tensor-core kernels (F16 / BF16 weights: tf32 products of the weight with the
    /// activation's tf32 part and remainder) and the f32 SIMT ones (`None` = tensor
    /// cores unless `DS4_CUDA_TF32=0`). For the checks.
    #[doc(hidden)]
    pub fn matmul_f32_opts(
        &self,
        m: &DeviceMatrix,
        x: u64,
        y: u64,
        b: Batch,
        split: Option<usize>,
        tensor_cores: Option<bool>,
    ) -> Result<(), CudaError> {
        if b.n_tok == 0 {
            return Ok(());
        }
        let what = format!("matmul_f32 {} {}×{}", m.ty, m.rows, m.cols);
        self.check_batch(&what, m, &b, None)?;
        static TF32: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let tc = tensor_cores.unwrap_or_else(|| {
            *TF32.get_or_init(|| std::env::var("DS4_CUDA_TF32").map_or(true, |v| v != "0"))
        });
        let spread = tc && self.on(Variant::MmPitch);
        let names = match m.ty {
            GgmlType::F16 if spread => split_k_names!("mm_tc_f16_p"),
            GgmlType::BF16 if spread => split_k_names!("mm_tc_bf16_p"),
            GgmlType::F16 if tc => split_k_names!("mm_tc_f16"),
            GgmlType::BF16 if tc => split_k_names!("mm_tc_bf16"),
            GgmlType::F32 => split_k_names!("mm_f32_f32"),
            GgmlType::F16 => split_k_names!("mm_f32_f16"),
            GgmlType::BF16 => split_k_names!("mm_f32_bf16"),
            GgmlType::Q8_0 => split_k_names!("mm_f32_q8_0"),
            other => return Err(invalid(format!("{what}: no kernel for {other}"))),
        };
        // Split K until the grid covers the GPU once (at least 4 k-tiles per split):
        // measured best on the H200 for 8, 32 and 128 tiles of 64×64 (NOTES.md).
        let blocks = b.n_tok.div_ceil(64) * m.rows.div_ceil(64) * b.n_groups;
        let sms = self.info().multiprocessors.max(1) as usize;
        let nkt = m.cols.div_ceil(32);
        let sk = match split {
            Some(s @ (1 | 2 | 4 | 8)) => s,
            Some(s) => return Err(invalid(format!("{what}: split-K {s}"))),
            None => {
                let mut s = 1;
                while s < 8 && blocks * s < sms && nkt >= 8 * s {
                    s *= 2;
                }
                s
            }
        };
        if b.n_groups * sk > 65535 {
            return Err(invalid(format!("{what}: too many groups")));
        }
        let name = names[sk.trailing_zeros() as usize];
        let unit = if m.ty == GgmlType::Q8_0 { 32 } else { 8 };
        if !m.cols.is_multiple_of(unit)
            || !b.x_tok.is_multiple_of(4)
            || !b.x_grp.is_multiple_of(4)
            || !x.is_multiple_of(16)
        {
            return Err(invalid(format!(
                "{what}: cols must be a multiple of {unit}, input strides of 4 floats"
            )));
        }
        let elems = (m.rows * m.cols) as i64;
        let (w, wd, mat_w, mat_d) = match m.ty {
            GgmlType::Q8_0 => (m.part_ptr(self, 0), m.part_ptr(self, 1), elems, elems / 32),
            GgmlType::F32 => (m.part_ptr(self, 0), 0, elems * 4, 0),
            _ => (m.part_ptr(self, 0), 0, elems * 2, 0),
        };
        let (rows, cols) = (m.rows as i32, m.cols as i32);
        let tail = BatchTail::of(&b);
        let cfg = LaunchConfig {
            grid_dim: (
                b.n_tok.div_ceil(64) as u32,
                m.rows.div_ceil(64) as u32,
                (b.n_groups * sk) as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // x and y extents are the caller's contract (raw addresses).
        launch!(self, name, cfg; w, wd, mat_w, mat_d, x, y, rows, cols; tail)
    }

    /// Builds on the device, without a host sync, the per-expert pair lists of `n_pairs`
    /// pairs whose expert ids (device `i32 [n_pairs]`, pair p = t·k + j) are at `ids`.
    /// Ids outside `0..n_expert` are dropped (their outputs are not written). Work items
    /// of 64 pairs (the wide kernels) where the experts average at least 32 pairs and
    /// `exp_wide` is on, else of 32.
    pub fn route_plan(
        &self,
        ids: u64,
        n_pairs: usize,
        n_expert: usize,
        plan: &mut RoutePlan,
    ) -> Result<(), CudaError> {
        let wide = self.on(Variant::ExpWide) && n_pairs >= EXP_TILE * n_expert;
        let tile = if wide { EXP_TILE_WIDE } else { EXP_TILE };
        self.route_plan_tile(ids, n_pairs, n_expert, plan, tile)
    }

    /// [`Launcher::route_plan`] with work items of `tile` (32 or 64) pairs. For the checks.
    #[doc(hidden)]
    pub fn route_plan_tile(
        &self,
        ids: u64,
        n_pairs: usize,
        n_expert: usize,
        plan: &mut RoutePlan,
        tile: usize,
    ) -> Result<(), CudaError> {
        if tile != EXP_TILE && tile != EXP_TILE_WIDE {
            return Err(invalid(format!("route_plan: items of {tile} pairs")));
        }
        if n_expert != plan.n_expert || n_pairs > plan.max_pairs {
            return Err(invalid(format!(
                "route_plan: {n_pairs} pairs over {n_expert} experts into a plan for {} over {}",
                plan.max_pairs, plan.n_expert
            )));
        }
        debug_assert!(max_items(n_pairs, n_expert, tile) <= plan.max_items);
        plan.n_pairs = n_pairs;
        plan.tile = tile;
        let (np, ne, tile) = (n_pairs as i32, n_expert as i32, tile as i32);
        let (off, pairs, items, n_items) = (
            self.ptr(&plan.offsets),
            self.ptr(&plan.pairs),
            self.ptr(&plan.items),
            self.ptr(&plan.n_items),
        );
        // The plan's buffers are sized for max_pairs ≥ n_pairs and n_expert; ids holds
        // n_pairs values (caller).
        launch!(self, "route_plan_build", cfg(1, 1024);
            ids, np, ne, tile, off, pairs, items, n_items
        )
    }

    /// Routed experts: `Y[p][r] = W_{ids[p]}·X[row(p)]` for the pairs of the last
    /// [`Launcher::route_plan`], `row(p) = p / k` when `shared_input` (gate/up) else `p`
    /// (down). Activation rows are `xq.cols` apart; `y` holds `n_pairs × m.rows` floats.
    /// `variant` forces a kernel (the 32-pair tile at minimum 2, 3 or 4 blocks per SM for
    /// 0, 1, 2, the 64-pair tile for EXP_VARIANT_WIDE; the checks use it); `None` is the
    /// plan's tile with the default per format.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_experts_q8act(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        plan: &RoutePlan,
        k: usize,
        shared_input: bool,
        y: u64,
        variant: Option<usize>,
    ) -> Result<(), CudaError> {
        let n = plan.n_pairs;
        if n == 0 {
            return Ok(());
        }
        let in_rows = if shared_input {
            if k == 0 {
                return Err(invalid("matmul_experts_q8act: k = 0".into()));
            }
            n.div_ceil(k)
        } else {
            n
        };
        if plan.n_expert > m.n_mats || xq.cols < m.cols || xq.rows < in_rows {
            return Err(invalid(format!(
                "matmul_experts_q8act: {} experts of a stack of {}, activations {}×{} for {in_rows}×{}",
                plan.n_expert, m.n_mats, xq.rows, xq.cols, m.cols
            )));
        }
        let b = Batch {
            n_tok: 0,
            x_tok: xq.cols,
            y_tok: m.rows,
            n_groups: 1,
            x_grp: 0,
            y_grp: 0,
        };
        let k_div = if shared_input { k } else { 1 };
        // A prefill chunk's launcher takes fp16 warpgroup MMA for IQ2_XXS / Q2_K where it
        // can (matmul_f16_exp.rs); a forced variant is always the int8 kernel.
        if variant.is_none() {
            if let Some(slot) = self.exp_f16_slot(m, xq, in_rows) {
                return self.matmul_experts_f16(m, xq, plan, k, shared_input, y, slot);
            }
        }
        self.launch_exp(m, xq, y, Some(plan), k_div, &b, variant)
    }

    /// The routed experts' gate and up ([`Launcher::matmul_experts_q8act`] with one input
    /// row per token) into `y_gate` and `y_up`: on fp16 warpgroup MMA with one conversion
    /// of the activations where the launcher takes that path, else two int8 GEMMs.
    pub fn matmul_experts_gate_up(
        &self,
        (gate, y_gate): (&DeviceMatrix, u64),
        (up, y_up): (&DeviceMatrix, u64),
        xq: &QuantAct,
        plan: &RoutePlan,
        k: usize,
    ) -> Result<(), CudaError> {
        let in_rows = plan.n_pairs.div_ceil(k.max(1));
        if k > 0 && gate.ty == up.ty && self.exp_f16_slot(up, xq, in_rows).is_some() {
            if let Some(slot) = self.exp_f16_slot(gate, xq, in_rows) {
                return self.matmul_experts_f16_pair((gate, y_gate), (up, y_up), xq, plan, k, slot);
            }
        }
        self.matmul_experts_q8act(gate, xq, plan, k, true, y_gate, None)?;
        self.matmul_experts_q8act(up, xq, plan, k, true, y_up, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn item_bound_covers_every_split() {
        // Σ ceil(c_e / 32) ≤ n/32 + nonempty experts for any split of n pairs.
        for (n, e) in [
            (0usize, 4usize),
            (1, 256),
            (3072, 256),
            (31, 1),
            (33, 1),
            (64, 2),
        ] {
            let nonempty = n.min(e);
            for tile in [EXP_TILE, EXP_TILE_WIDE] {
                let worst: usize = (0..nonempty)
                    .map(|i| {
                        let c = n / nonempty.max(1) + usize::from(i < n % nonempty.max(1));
                        c.div_ceil(tile)
                    })
                    .sum();
                assert!(worst <= max_items(n, e, tile), "{n} pairs, {e} experts");
                // A plan is allocated for 32-pair items: wider items need no more.
                assert!(max_items(n, e, tile) <= max_items(n, e, EXP_TILE));
            }
        }
    }

    #[test]
    fn stage_sizes_match_the_kernels() {
        assert_eq!(q8_stage_bytes(128, 128) % 16, 0);
        for ty in [
            GgmlType::Q8_0,
            GgmlType::IQ2_XXS,
            GgmlType::Q2_K,
            GgmlType::Q4_K,
        ] {
            for pairs in [EXP_TILE, EXP_TILE_WIDE] {
                assert_eq!(exp_stage_bytes(ty, pairs) % 16, 0);
                assert!(2 * exp_stage_bytes(ty, pairs) + 2048 <= 227 << 10);
            }
        }
        // The wide IQ2_XXS kernel's two stages and 16 table copies: two blocks an SM
        // (228 KB, 1 KB reserved a block), its register-bound occupancy.
        let wide = 2 * exp_stage_bytes(GgmlType::IQ2_XXS, EXP_TILE_WIDE) + 16 * 2048;
        assert!(2 * (wide + 1024) <= 228 << 10);
    }
}
