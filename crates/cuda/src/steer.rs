//! The launcher of directional steering (kernels/steer.cu; the engine's `crate::steer`
//! and cuda/state/layers.rs).

use cudarc::driver::PushKernelArg;

use crate::error::CudaError;
use crate::layer::cfg;
use crate::plan::Launcher;

impl Launcher<'_> {
    /// For each of `n_rows` token rows of `n_embd` floats at `x`: with `parts` ≠ 0,
    /// first `x = Σ_k parts[k] + x` over the token's `n_parts` rows there (hc_post's sum
    /// of the FFN output, written back); then `x −= scale·(d·x)·d` with the `n_embd`
    /// floats at `dir`. Every buffer must hold what the counts say (caller).
    #[allow(clippy::too_many_arguments)]
    pub fn steer_rows(
        &self,
        n_rows: usize,
        x: u64,
        (parts, n_parts): (u64, usize),
        dir: u64,
        scale: f32,
        n_embd: usize,
    ) -> Result<(), CudaError> {
        if n_rows == 0 {
            return Ok(());
        }
        let (np, ne) = (n_parts as i32, n_embd as i32);
        let block = if n_embd >= 1024 { 1024 } else { 256 };
        launch!(self, "steer_rows", cfg(n_rows as u32, block); x, parts, np, dir, scale, ne)
    }
}
