//! Kernel launchers.

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use ds4_gguf::GgmlType;

use crate::device::Gpu;
use crate::error::CudaError;
use crate::weights::DeviceMatrix;

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

const ROWS_PER_BLOCK: u32 = 8;

impl Gpu {
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
        let rows = m.rows as i32;
        let cols = m.cols as i32;
        let cfg = LaunchConfig {
            grid_dim: ((m.rows as u32).div_ceil(ROWS_PER_BLOCK), n_sel as u32, 1),
            block_dim: (32, ROWS_PER_BLOCK, 1),
            shared_mem_bytes: 0,
        };
        let elems = (m.rows * m.cols) as i64;
        let p: Vec<u64> = m.parts.iter().map(|b| self.ptr(b)).collect();
        let f = self.func(match m.ty {
            GgmlType::Q8_0 => "matvec_q8_0",
            GgmlType::F16 => "matvec_f16",
            GgmlType::F32 => "matvec_f32",
            GgmlType::IQ2_XXS => "matvec_iq2_xxs",
            GgmlType::Q2_K => "matvec_q2_k",
            GgmlType::Q4_K => "matvec_q4_k",
            other => return Err(CudaError::Invalid(format!("no matvec kernel for {other}"))),
        })?;
        let mut b = self.stream.launch_builder(&f);
        let (mat_a, mat_b) = match m.ty {
            GgmlType::Q8_0 => (elems, elems / 32),
            GgmlType::IQ2_XXS => (elems / 256 * 64, elems / 256),
            GgmlType::Q2_K | GgmlType::Q4_K => (elems / 256, 0),
            _ => (elems, 0),
        };
        let grid = self.iq2_grid()?;
        match m.ty {
            GgmlType::Q8_0 => {
                b.arg(&p[0]).arg(&p[1]).arg(&mat_a).arg(&mat_b);
            }
            GgmlType::IQ2_XXS => {
                b.arg(&p[0]).arg(&p[1]).arg(&mat_a).arg(&mat_b).arg(&grid);
            }
            GgmlType::Q2_K => {
                b.arg(&p[0]).arg(&p[1]).arg(&p[2]).arg(&mat_a);
            }
            _ => {
                b.arg(&p[0]).arg(&mat_a);
            }
        }
        b.arg(&x).arg(&y).arg(&rows).arg(&cols).arg(&sel);
        // SAFETY: argument order and types match the kernel signatures in matvec.cu;
        // the caller passes buffers of at least n_sel × cols inputs and n_sel × rows
        // outputs (checked by the safe wrappers that use this).
        unsafe { b.launch(cfg) }?;
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
