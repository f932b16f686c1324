//! Weights kept in page-locked host memory that kernels read directly over PCIe
//! (`CU_MEMHOSTALLOC_DEVICEMAP`: "zero-copy"). Expert offload (architecture.md §4.1)
//! puts the routed experts of some layers here when the model does not fit the card:
//! a decode token then reads only its 6 selected experts of such a layer across the
//! bus (~42 MB at the Flash shape), with the same kernels and bit-identical results.

use cudarc::driver::{CudaSlice, PinnedHostSlice};

use crate::device::Gpu;
use crate::error::CudaError;
use crate::upload::{check_gather, gather_into};

/// Page-locked host bytes mapped into the device's address space.
pub struct HostMapped {
    buf: PinnedHostSlice<u8>,
    /// The device-side address of the first byte.
    dptr: u64,
}

impl HostMapped {
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }
}

/// Where one repacked part of a weight lives.
pub enum Part {
    Device(CudaSlice<u8>),
    Host(HostMapped),
}

impl Part {
    pub fn len(&self) -> usize {
        match self {
            Part::Device(b) => b.len(),
            Part::Host(h) => h.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn on_host(&self) -> bool {
        matches!(self, Part::Host(_))
    }

    /// The address kernels read the part at.
    pub fn ptr(&self, gpu: &Gpu) -> u64 {
        match self {
            Part::Device(b) => gpu.ptr(b),
            Part::Host(h) => h.dptr,
        }
    }
}

impl Gpu {
    /// New mapped host memory holding the `len` bytes at `off` of every `block`-byte
    /// block of `src` (the host twin of [`Gpu::upload_gather`]).
    pub fn host_gather(
        &self,
        src: &[u8],
        block: usize,
        off: usize,
        len: usize,
    ) -> Result<HostMapped, CudaError> {
        check_gather(src, block, off, len)?;
        let total = (src.len() / block * len).max(1);
        use cudarc::driver::sys::{CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE};
        // Cached (not write-combined) memory: the gather below writes it with plain
        // stores, and the GPU's reads over the bus are the same either way. PORTABLE:
        // every context of the process may map it (several GPUs, later).
        // SAFETY: every byte is written by the gather before any kernel reads it.
        let mut buf = unsafe {
            self.ctx.alloc_pinned_with_flags::<u8>(
                total,
                CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(|e| {
            CudaError::Invalid(format!(
                "cannot pin {:.2} GiB of host memory for offloaded weights ({e}); \
                 lower --offload-experts or free host memory",
                total as f64 / (1u64 << 30) as f64
            ))
        })?;
        let host = buf.as_mut_slice()?;
        gather_into(&mut host[..src.len() / block * len], src, block, off, len);
        let mut dptr = 0u64;
        // SAFETY: `host` is a live page-locked allocation made with DEVICEMAP in this
        // process; the driver writes the device address of its first byte.
        let r = unsafe {
            cudarc::driver::sys::cuMemHostGetDevicePointer_v2(
                &mut dptr,
                host.as_mut_ptr() as *mut std::ffi::c_void,
                0,
            )
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::Invalid(format!(
                "the device cannot map host memory ({r:?}): expert offload needs a GPU \
                 with unified addressing"
            )));
        }
        Ok(HostMapped { buf, dptr })
    }
}
