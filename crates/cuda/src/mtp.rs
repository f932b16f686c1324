//! Launchers of the MTP draft block's own kernel (kernels/mtp.cu); the block's layer
//! and head run on the layer kernels.

use cudarc::driver::PushKernelArg;

use crate::error::CudaError;
use crate::layer::cfg2;
use crate::plan::Launcher;

impl Launcher<'_> {
    /// `out[r][i] = x[r][i] + e[i]` for `rows` rows of `n` values (`e` = 0: a copy;
    /// `out` may be `x`): the block's input, each stream's projected HC state plus the
    /// projected embedding.
    pub fn mtp_add_rows(
        &self,
        out: u64,
        x: u64,
        e: u64,
        rows: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let ni = n as i32;
        launch!(self, "mtp_add_rows", cfg2((n as u32).div_ceil(256), rows, 256); out, x, e, ni)
    }
}
