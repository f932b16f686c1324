//! Prefill products on fp16 tensor cores (`kernels/matmul_f16.cu`): Q8_0 weights
//! (`Variant::Q8F16`) and F16 weights (`Variant::F16Split`).
//!
//! The int8 GEMM (`mm_q8_0_*`) pays three FP instructions per accumulator for every 32
//! values (the two block scales), which bounds it near a quarter of the tensor rate.
//! Here a call expands the weights to fp16 (`q8_0_to_f16`, once per call: ~2% of a
//! 2,048-token product's time) and the int8 activations to fp16 with one power-of-two
//! scale per token (`q8act_to_f16`), then runs a plain fp16 GEMM with f32 accumulators
//! (`mm_f16_128x128`) whose only epilogue is that token scale. F16 weights need no
//! expansion; their f32 activations become fp16 hi and lo halves (`f32_to_f16x2`: the
//! precision of the tf32 split the `mm_tc_*` kernels use) and the GEMM runs over both.
//!
//! The expanded copies live in an [`F16Work`] that a prefill chunk's [`Launcher`]
//! carries (`Launcher::with_f16`): one slot per launch lane, since the prefill's side
//! lanes (the kv projection and the shared expert on lane 1, the indexer on lane 2) run
//! their products beside the main lane's. `matmul_q8act` and `matmul_f32` take this path
//! by themselves where it applies.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use ds4_gguf::GgmlType;

use crate::device::{Gpu, KernelSource};
use crate::error::CudaError;
use crate::matmul::Batch;
use crate::ops::QuantAct;
use crate::plan::{Launcher, Variant};
use crate::weights::DeviceMatrix;

/// Rows and tokens of one block of `mm_f16_128x128`; its k-tile.
const BM: usize = 128;
const BN: usize = 128;
const BK: usize = 64;
/// Its shared memory: 3 stages of (128 + 128) rows × 72 halves.
const SMEM: usize = 3 * (BM + BN) * 72 * 2;
/// `mm_f16_wg_128x128`'s: 3 stages of (128 + 128) rows × 128 bytes, 1 KB for alignment.
const SMEM_WG: usize = 3 * (BM + BN) * 128 + 1024;

/// The expanded weights and activations of one lane's fp16 products.
pub struct F16Slot {
    pub(crate) w: CudaSlice<u16>,
    pub(crate) x: CudaSlice<u16>,
    pub(crate) scale: CudaSlice<f32>,
}

/// The buffers of the fp16 products: slot i serves launch lane i (0 = the main stream);
/// a lane without a slot (or one too small) runs the int8 / tf32 GEMMs.
pub struct F16Work {
    slots: Vec<F16Slot>,
}

impl F16Work {
    /// The slots, by lane.
    pub fn slots(&self) -> &[F16Slot] {
        &self.slots
    }

    /// Device bytes of slots sized `(w_elems, x_elems, tokens)`.
    pub fn bytes(sizes: &[(usize, usize, usize)]) -> usize {
        sizes.iter().map(|&(w, x, t)| 2 * w + 2 * x + 4 * t).sum()
    }
}

impl Gpu {
    /// One [`F16Slot`] per `(w_elems, x_elems, tokens)`, for lanes 0, 1, ….
    pub fn alloc_f16_work(&self, sizes: &[(usize, usize, usize)]) -> Result<F16Work, CudaError> {
        let slots = sizes
            .iter()
            .map(|&(w_elems, x_elems, tokens)| {
                Ok(F16Slot {
                    w: self.zeros(w_elems.max(8))?,
                    x: self.zeros(x_elems.max(8))?,
                    scale: self.zeros(tokens.max(1))?,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(F16Work { slots })
    }
}

fn invalid(msg: String) -> CudaError {
    CudaError::Invalid(msg)
}

/// Why `slot` cannot take a product of `m` over `n_tok` tokens whose fp16 rows are
/// `x_cols` wide (Q8_0: the activation's width; F16: twice the matrix's columns), if it
/// cannot: the kernel's shape rules (rows a multiple of 128, columns of 64) and the
/// slot's capacities.
fn unfit(m: &DeviceMatrix, b: &Batch, x_cols: usize, slot: &F16Slot) -> Option<String> {
    if !m.rows.is_multiple_of(BM) || !m.cols.is_multiple_of(BK) {
        return Some(format!("{}×{} is not whole 128×64 tiles", m.rows, m.cols));
    }
    let w = if m.ty == GgmlType::F16 {
        0
    } else {
        b.n_groups * m.rows * m.cols
    };
    let x = b.n_tok * x_cols;
    // The buffers' lengths are the slot's capacities.
    let (cw, cx, ct) = (slot.w.len(), slot.x.len(), slot.scale.len());
    if w > cw || x > cx || b.n_tok > ct {
        return Some(format!(
            "{w} weights / {x} activations / {} tokens exceed the slot ({cw} / {cx} / {ct})",
            b.n_tok
        ));
    }
    None
}

/// Why a Q8_0 product cannot run through `slot`, if it cannot.
fn unfit_q8(m: &DeviceMatrix, xq: &QuantAct, b: &Batch, slot: &F16Slot) -> Option<String> {
    if m.ty != GgmlType::Q8_0 {
        return Some(format!("{} is not Q8_0", m.ty));
    }
    if b.x_tok != xq.cols || b.n_tok > xq.rows {
        return Some(format!(
            "tokens {} apart of {} (the fp16 copy is packed)",
            b.x_tok, xq.cols
        ));
    }
    if (b.n_groups - 1) * b.x_grp + m.cols > xq.cols {
        return Some("groups read past the activation row".into());
    }
    unfit(m, b, xq.cols, slot)
}

/// Why an F16 product cannot run through `slot`, if it cannot.
/// `w` is the weights' device address, which cp.async reads 16 bytes at a time.
fn unfit_split(m: &DeviceMatrix, w: u64, b: &Batch, slot: &F16Slot) -> Option<String> {
    if m.ty != GgmlType::F16 {
        return Some(format!("{} is not F16", m.ty));
    }
    if !w.is_multiple_of(16) {
        return Some("weights not 16-byte aligned".into());
    }
    if b.n_groups != 1 {
        return Some("grouped".into());
    }
    unfit(m, b, 2 * m.cols, slot)
}

impl Launcher<'_> {
    /// Whether the sm_90a kernels (wgmma) can run: machine code from the fatbin on a 9.0
    /// GPU (the fatbin's compute_90 PTX and NVRTC builds trap in them).
    pub fn has_wgmma(&self) -> bool {
        let info = self.info();
        matches!(info.kernels, KernelSource::Fatbin) && info.compute_capability == (9, 0)
    }

    /// The slot of this lane that takes a product of `m` over `b` in fp16 (`v` on, the
    /// 128×128 tiles fill at least 1/`share` of the GPU's SMs, and `fits`), if any.
    /// Q8_0 takes share 2 (a 2,048-token chunk's q_a is 128 tiles; the kv projection's
    /// 64 tiles lose to the int8 128×64 tile), F16 share 4 (the 512-row compressors'
    /// 64 tiles still beat two tf32 mma a product).
    fn f16_slot(
        &self,
        (v, share): (Variant, usize),
        m: &DeviceMatrix,
        b: &Batch,
        fits: impl Fn(&F16Slot) -> bool,
    ) -> Option<&F16Slot> {
        let sms = self.info().multiprocessors.max(1) as usize;
        let tiles = (m.rows / BM) * b.n_tok.div_ceil(BN) * b.n_groups;
        self.f16_work()
            .filter(|_| self.on(v) && share * tiles >= sms)
            .and_then(|w| w.slots.get(self.current_lane()))
            .filter(|s| fits(s))
    }

    /// The slot that takes a Q8_0 product (`matmul_q8act`), if any.
    pub(crate) fn q8_f16_slot(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        b: &Batch,
    ) -> Option<&F16Slot> {
        self.f16_slot((Variant::Q8F16, 2), m, b, |s| {
            unfit_q8(m, xq, b, s).is_none()
        })
    }

    /// The slot that takes an F16 product (`matmul_f32`), if any.
    pub(crate) fn f16_split_slot(&self, m: &DeviceMatrix, b: &Batch) -> Option<&F16Slot> {
        let w = m.part_ptr(self, 0);
        self.f16_slot((Variant::F16Split, 4), m, b, |s| {
            unfit_split(m, w, b, s).is_none()
        })
    }

    /// The fp16 form of [`Launcher::matmul_q8act`] through `slot` (any token count; for
    /// the checks). `y` must hold the addressed floats.
    pub fn matmul_q8act_f16(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        b: Batch,
        slot: &F16Slot,
    ) -> Result<(), CudaError> {
        if b.n_tok == 0 {
            return Ok(());
        }
        let what = format!("matmul_q8act_f16 {}×{}", m.rows, m.cols);
        if b.n_groups == 0 || b.n_groups > m.n_mats || b.n_groups > 65535 {
            return Err(invalid(format!(
                "{what}: {} groups of {}",
                b.n_groups, m.n_mats
            )));
        }
        if let Some(why) = unfit_q8(m, xq, &b, slot) {
            return Err(invalid(format!("{what}: {why}")));
        }
        // The weights: every group's matrix, 8 values a thread.
        let n_vals = (b.n_groups * m.rows * m.cols) as i64;
        let (qs, dw) = (m.part_ptr(self, 0), m.part_ptr(self, 1));
        let w16 = self.ptr(&slot.w);
        let blocks = (n_vals as usize / 8).div_ceil(256).min(65535 * 16) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "q8_0_to_f16", cfg; qs, dw, w16, n_vals)?;
        // The activations: a block a token.
        let (x16, ts) = (self.ptr(&slot.x), self.ptr(&slot.scale));
        let (xqp, xdp) = (self.ptr(&xq.q), self.ptr(&xq.d));
        let cols = xq.cols as i32;
        launch!(self, "q8act_to_f16", per_token(b.n_tok); xqp, xdp, x16, ts, cols)?;
        self.mm_f16(w16, (x16, ts), y, m, &b, m.cols)
    }

    /// The fp16 form of [`Launcher::matmul_f32`] for F16 weights through `slot`: each
    /// token's activations as fp16 hi + lo (any token count; for the checks). `x` holds
    /// `n_tok` rows of m.cols floats, x_tok apart; `y` must hold the addressed floats.
    pub fn matmul_f16_split(
        &self,
        m: &DeviceMatrix,
        x: u64,
        y: u64,
        b: Batch,
        slot: &F16Slot,
    ) -> Result<(), CudaError> {
        if b.n_tok == 0 {
            return Ok(());
        }
        let what = format!("matmul_f16_split {}×{}", m.rows, m.cols);
        let w = m.part_ptr(self, 0);
        if let Some(why) = unfit_split(m, w, &b, slot) {
            return Err(invalid(format!("{what}: {why}")));
        }
        let (x16, ts) = (self.ptr(&slot.x), self.ptr(&slot.scale));
        let (x_tok, cols) = (b.x_tok as i64, m.cols as i32);
        launch!(self, "f32_to_f16x2", per_token(b.n_tok); x, x_tok, x16, ts, cols)?;
        let packed = Batch {
            x_tok: 2 * m.cols,
            ..b
        };
        self.mm_f16(w, (x16, ts), y, m, &packed, 2 * m.cols)
    }

    /// `mm_f16_128x128` over fp16 weights `w16` (m's shape) and fp16 token rows `x16` of
    /// `k` values (x_tok apart in `b`) with their token scales `ts`.
    fn mm_f16(
        &self,
        w16: u64,
        (x16, ts): (u64, u64),
        y: u64,
        m: &DeviceMatrix,
        b: &Batch,
        k: usize,
    ) -> Result<(), CudaError> {
        let wgmma = self.on(Variant::F16Wgmma) && self.has_wgmma();
        let (name, smem) = if wgmma {
            ("mm_f16_wg_128x128", SMEM_WG)
        } else {
            ("mm_f16_128x128", SMEM)
        };
        self.allow_smem(name, smem)?;
        let cfg = LaunchConfig {
            grid_dim: (
                b.n_tok.div_ceil(BN) as u32,
                (m.rows / BM) as u32,
                b.n_groups as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (rows, k, a_cols, n_tok) = (m.rows as i32, k as i32, m.cols as i32, b.n_tok as i32);
        let strides = [b.x_tok, b.y_tok, b.x_grp, b.y_grp].map(|v| v as i64);
        launch!(self, name, cfg; w16, x16, ts, y, rows, k, a_cols, n_tok,
            strides[0], strides[1], strides[2], strides[3])
    }
}

/// A block of 256 threads a token.
pub(crate) fn per_token(n_tok: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n_tok as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
