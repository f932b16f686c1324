//! CUDA device runtime and kernels for ds4.
//!
//! The CUDA driver is loaded dynamically: this crate builds without CUDA, and
//! [`driver_present`] / [`Gpu::open`] report a missing driver or device as an error
//! instead of panicking, so callers can fall back to the CPU backend.
//!
//! Kernels live in `kernels/*.cu`. `build.rs` compiles them to a fatbin (sm_90a + PTX)
//! when nvcc is found; otherwise they are compiled at run time with NVRTC for the
//! device's architecture and cached on disk.

/// Launches `name` with the listed arguments (each pushed by reference).
macro_rules! launch {
    ($gpu:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let f = $gpu.func($name)?;
        $gpu.timed($name, || {
            let mut b = $gpu.launch_stream().launch_builder(&f);
            $( b.arg(&$arg); )*
            // SAFETY: each launcher passes exactly the parameters of the kernel of the
            // same name in the layer*.cu kernels, in order and with the same types;
            // buffer sizes are the caller's contract (documented per launcher).
            unsafe { b.launch($cfg) }?;
            Ok::<(), CudaError>(())
        })
    }};
}

mod attention;
mod device;
mod error;
mod graph;
mod layer;
mod matmul;
mod ops;
pub mod plan;
mod probe;
pub mod trace;
mod upload;
mod weights;

pub use attention::{AttnInput, AttnTail, QNorm};
pub use device::{driver_present, DeviceBuf, Gpu, GpuInfo, KernelSource, SIDE_LANES};
pub use error::CudaError;
pub use graph::TokenGraph;
pub use layer::{Compressor, HcNorm, RopeP, WT_BF16, WT_F16, WT_F32, WT_Q8_0};
pub use matmul::{Batch, RoutePlan};
pub use ops::{MatSel, QuantAct};
pub use plan::{DecodePlan, Launcher, PlanError, Variant};
pub use weights::{repack, DeviceMatrix, Repacked};
