/// Why the GPU cannot be used (every variant is recoverable: fall back to the CPU).
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver library (libcuda) found on this machine")]
    NoDriver,
    #[error("no CUDA device {0} (found {1})")]
    NoDevice(usize, i32),
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("the kernels were not compiled ahead of time and NVRTC is not available: {0}")]
    NoCompiler(String),
    #[error("compiling the CUDA kernels with NVRTC failed: {0}")]
    Compile(String),
    #[error("kernel {0} is missing from the kernel module")]
    MissingKernel(String),
    #[error(
        "the weights need {need_gib:.2} GiB of GPU memory but {name} has {free_gib:.2} GiB free \
         (of {total_gib:.2}): use a GPU with more memory or the CPU backend (--backend cpu)"
    )]
    OutOfMemory {
        name: String,
        need_gib: f64,
        free_gib: f64,
        total_gib: f64,
    },
    #[error("{0}")]
    Invalid(String),
    /// `DS4_CUDA_FUSE` names no variant.
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
}

impl CudaError {
    /// Device memory ran out: the weights' pre-check, or the driver's
    /// `CUDA_ERROR_OUT_OF_MEMORY` from an allocation or launch.
    pub fn is_out_of_memory(&self) -> bool {
        use cudarc::driver::{sys::CUresult, DriverError};
        matches!(
            self,
            CudaError::OutOfMemory { .. }
                | CudaError::Driver(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))
        )
    }

    /// The driver's out-of-memory error, as an allocation returns it (tests of callers
    /// that sort errors by kind).
    pub fn driver_out_of_memory() -> CudaError {
        use cudarc::driver::{sys::CUresult, DriverError};
        CudaError::Driver(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_is_recognised_from_the_precheck_and_the_driver() {
        let pre = CudaError::OutOfMemory {
            name: "GPU".into(),
            need_gib: 81.0,
            free_gib: 79.0,
            total_gib: 80.0,
        };
        assert!(pre.is_out_of_memory());
        assert!(CudaError::driver_out_of_memory().is_out_of_memory());
        assert!(!CudaError::NoDriver.is_out_of_memory());
        assert!(!CudaError::Invalid("x".into()).is_out_of_memory());
    }
}
