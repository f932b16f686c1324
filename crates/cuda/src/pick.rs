//! Greedy picks made on the device (`kernels/pick.cu`): the pieces the engine's
//! pipelined greedy decode (`Session::greedy_run`) needs to launch a token's graph
//! before the host has seen the previous token.
//!
//! * [`Launcher::greedy_pick`] ends a decode graph: the argmax of the logits (one token
//!   left out, NaN flagged) becomes the next token in the step buffer and lands in a
//!   [`PickRing`] slot;
//! * [`PickRing`] is four `{token, nan}` pairs of mapped host memory, slot `pos % 4`;
//! * [`TokenEvent`] marks the end of a launched graph: the host waits on it, then reads
//!   the slot.

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice, PushKernelArg};

use crate::device::Gpu;
use crate::error::CudaError;
use crate::layer::cfg;
use crate::plan::Launcher;

/// Slots of a [`PickRing`]: more than the picks in flight (two with one graph ahead).
pub const PICK_SLOTS: usize = 4;

/// Blocks of a pick: each scans a share of the logits, the last to finish reduces the
/// shares (one block over a 129k row took 16.7 µs on an H200, one SM's L2 reads).
const PICK_BLOCKS: usize = 64;

/// Four `{token, nan}` pairs of page-locked host memory mapped into the device's
/// address space, written by `greedy_pick` (slot `pos % 4` for the token decoded at
/// `pos`) and read by the host once that graph's [`TokenEvent`] completed.
pub struct PickRing {
    _buf: PinnedHostSlice<i32>,
    host: *const i32,
    dptr: u64,
    /// The pick's device scratch: a counter of finished blocks (0 between launches)
    /// and `{best, index, nan}` per block.
    scratch: CudaSlice<i32>,
}

// SAFETY: the ring is plain page-locked memory; the host only reads it (volatile,
// after an event orders the device's writes before the read), the device only writes.
unsafe impl Send for PickRing {}

impl PickRing {
    /// The device address kernels write the ring at.
    pub fn dptr(&self) -> u64 {
        self.dptr
    }

    /// The pick of the token decoded at `pos`: `(token, nan)`. Call only after the
    /// [`TokenEvent`] recorded behind that token's launch completed.
    pub fn read(&self, pos: usize) -> (u32, bool) {
        let slot = 2 * (pos % PICK_SLOTS);
        // SAFETY: `host` points at 2·PICK_SLOTS live i32 of the pinned allocation held
        // by `_buf`; the device's writes completed before the caller's event wait.
        let (token, nan) = unsafe {
            (
                std::ptr::read_volatile(self.host.add(slot)),
                std::ptr::read_volatile(self.host.add(slot + 1)),
            )
        };
        (token as u32, nan != 0)
    }
}

/// An event recorded behind a launched graph on the GPU's main stream.
pub struct TokenEvent(CudaEvent);

impl TokenEvent {
    /// Marks everything queued on the main stream so far.
    pub fn record(&self, gpu: &Gpu) -> Result<(), CudaError> {
        Ok(self.0.record(&gpu.stream)?)
    }

    /// Waits until the work marked by the last [`TokenEvent::record`] completed (at
    /// once when never recorded).
    pub fn wait(&self) -> Result<(), CudaError> {
        Ok(self.0.synchronize()?)
    }
}

impl Gpu {
    /// A new [`PickRing`] (zeroed).
    pub fn pick_ring(&self) -> Result<PickRing, CudaError> {
        use cudarc::driver::sys::{CUresult, CU_MEMHOSTALLOC_DEVICEMAP};
        // SAFETY: zeroed below before any kernel can write it.
        let mut buf = unsafe {
            self.ctx
                .alloc_pinned_with_flags::<i32>(2 * PICK_SLOTS, CU_MEMHOSTALLOC_DEVICEMAP)
        }?;
        let host = buf.as_mut_slice()?;
        host.fill(0);
        let ptr = host.as_mut_ptr();
        let mut dptr = 0u64;
        // SAFETY: `ptr` is a live page-locked allocation made with DEVICEMAP in this
        // process; the driver writes the device address of its first byte.
        let r = unsafe {
            cudarc::driver::sys::cuMemHostGetDevicePointer_v2(
                &mut dptr,
                ptr as *mut std::ffi::c_void,
                0,
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            return Err(CudaError::Invalid(format!(
                "the device cannot map host memory ({r:?}) for its greedy picks"
            )));
        }
        Ok(PickRing {
            _buf: buf,
            host: ptr,
            dptr,
            scratch: self.zeros::<i32>(1 + 3 * PICK_BLOCKS)?,
        })
    }

    /// A new [`TokenEvent`] (blocking-sync off: the host spins, the wait is short).
    pub fn token_event(&self) -> Result<TokenEvent, CudaError> {
        Ok(TokenEvent(self.ctx.new_event(None)?))
    }
}

impl Launcher<'_> {
    /// The greedy pick of the `n` logits at `logits` (index `skip` left out; -1: none)
    /// into the step buffer `step` (`{pos, token}` → `{pos + 1, pick}`) and slot
    /// `pos % 4` of `ring`.
    pub fn greedy_pick(
        &self,
        step: u64,
        logits: u64,
        n: usize,
        skip: i32,
        ring: &PickRing,
    ) -> Result<(), CudaError> {
        let (n, r, s) = (n as i32, ring.dptr, self.ptr(&ring.scratch));
        launch!(self, "greedy_pick", cfg(PICK_BLOCKS as u32, 256); step, logits, n, skip, r, s)
    }
}
