//! Prefill Q8_0 products on fp16 tensor cores (`Variant::Q8F16`, `kernels/matmul_f16.cu`).
//!
//! The int8 GEMM (`mm_q8_0_*`) pays three FP instructions per accumulator for every 32
//! values (the two block scales), which bounds it near a quarter of the tensor rate.
//! Here a call expands the weights to fp16 (`q8_0_to_f16`, once per call: ~2% of a
//! 2,048-token product's time) and the int8 activations to fp16 with one power-of-two
//! scale per token (`q8act_to_f16`), then runs a plain fp16 GEMM with f32 accumulators
//! (`mm_f16_128x128`) whose only epilogue is that token scale.
//!
//! The expanded copies live in an [`F16Work`]: one slot per launch lane, since the
//! prefill's side lane 1 (the kv projection, the shared expert) runs its products
//! beside the main lane's.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use ds4_gguf::GgmlType;

use crate::device::Gpu;
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

/// The expanded weights and activations of one lane's fp16 products.
pub struct F16Slot {
    w: CudaSlice<u16>,
    x: CudaSlice<u16>,
    scale: CudaSlice<f32>,
    /// Capacities: weight values (all groups of a matrix), activation values, tokens.
    pub w_elems: usize,
    pub x_elems: usize,
    pub tokens: usize,
}

/// The buffers of [`Launcher::matmul_q8act_auto`]: slot i serves launch lane i (0 = the
/// main stream); a lane without a slot runs the int8 GEMM.
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
                    w_elems,
                    x_elems,
                    tokens,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(F16Work { slots })
    }
}

fn invalid(msg: String) -> CudaError {
    CudaError::Invalid(msg)
}

/// Why `slot` cannot take the product, if it cannot: the kernel's shape rules (Q8_0,
/// rows a multiple of 128, cols of 64, tokens packed at the activation's width) and the
/// slot's capacities.
fn unfit(m: &DeviceMatrix, xq: &QuantAct, b: &Batch, slot: &F16Slot) -> Option<String> {
    if m.ty != GgmlType::Q8_0 {
        return Some(format!("{} is not Q8_0", m.ty));
    }
    if !m.rows.is_multiple_of(BM) || !m.cols.is_multiple_of(BK) {
        return Some(format!("{}×{} is not whole 128×64 tiles", m.rows, m.cols));
    }
    if b.x_tok != xq.cols || b.n_tok > xq.rows {
        return Some(format!(
            "tokens {} apart of {} (the fp16 copy is packed)",
            b.x_tok, xq.cols
        ));
    }
    let w = b.n_groups * m.rows * m.cols;
    let x = b.n_tok * xq.cols;
    if w > slot.w_elems || x > slot.x_elems || b.n_tok > slot.tokens {
        return Some(format!(
            "{w} weights / {x} activations / {} tokens exceed the slot ({} / {} / {})",
            b.n_tok, slot.w_elems, slot.x_elems, slot.tokens
        ));
    }
    None
}

impl Launcher<'_> {
    /// [`Launcher::matmul_q8act`], on fp16 tensor cores through `work` when `q8_f16` is
    /// on, this lane has a slot that fits, and the 128×128 tiles fill at least half the
    /// GPU's SMs (a 2,048-token chunk's q_a: 128 tiles); else the int8 GEMM.
    pub fn matmul_q8act_auto(
        &self,
        m: &DeviceMatrix,
        xq: &QuantAct,
        y: u64,
        b: Batch,
        work: Option<&F16Work>,
    ) -> Result<(), CudaError> {
        let sms = self.info().multiprocessors.max(1) as usize;
        let tiles = (m.rows / BM) * b.n_tok.div_ceil(BN) * b.n_groups;
        let slot = work
            .filter(|_| self.on(Variant::Q8F16) && 2 * tiles >= sms)
            .and_then(|w| w.slots.get(self.current_lane()))
            .filter(|s| unfit(m, xq, &b, s).is_none());
        match slot {
            Some(s) => self.matmul_q8act_f16(m, xq, y, b, s),
            None => self.matmul_q8act(m, xq, y, b),
        }
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
        if let Some(why) = unfit(m, xq, &b, slot) {
            return Err(invalid(format!("{what}: {why}")));
        }
        if (b.n_groups - 1) * b.x_grp + m.cols > xq.cols {
            return Err(invalid(format!(
                "{what}: groups read past the activation row"
            )));
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
        let cfg = LaunchConfig {
            grid_dim: (b.n_tok as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "q8act_to_f16", cfg; xqp, xdp, x16, ts, cols)?;
        // The product.
        let name = "mm_f16_128x128";
        self.allow_smem(name, SMEM)?;
        let cfg = LaunchConfig {
            grid_dim: (
                b.n_tok.div_ceil(BN) as u32,
                (m.rows / BM) as u32,
                b.n_groups as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: SMEM as u32,
        };
        let (rows, mcols, n_tok) = (m.rows as i32, m.cols as i32, b.n_tok as i32);
        let strides = [b.x_tok, b.y_tok, b.x_grp, b.y_grp].map(|v| v as i64);
        launch!(self, name, cfg; w16, x16, ts, y, rows, mcols, n_tok,
            strides[0], strides[1], strides[2], strides[3])
    }
}
