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
use crate::layer::{cfg, cfg2};
use crate::plan::Launcher;

/// Slots of a [`PickRing`]: more than the picks in flight (two with one graph ahead).
pub const PICK_SLOTS: usize = 4;

/// Blocks of a pick: each scans a share of the logits, the last to finish reduces the
/// shares (one block over a 129k row took 16.7 µs on an H200, one SM's L2 reads).
pub(crate) const PICK_BLOCKS: usize = 64;

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

/// Draft slots of a [`SpecRing`]: a cycle's drafts at most (15) and one more.
pub const SPEC_SLOTS: usize = 16;
/// Row slots of a [`SpecRing`]: a verify step's rows at most.
pub const SPEC_ROWS: usize = 16;
/// Where a [`SpecRing`]'s row slots start (in i32): after the draft slots.
const SPEC_ROWS_AT: usize = 4 * SPEC_SLOTS;

/// A greedy speculative cycle's mapped host memory (`draft_pick`, `rows_pick`):
/// per draft position `pos` (slot `pos % 16`) `{override, used, nan, margin bits}` —
/// the host writes the override before the draft's launch, the device the rest — and
/// per verify row `{pick, nan}`.
pub struct SpecRing {
    _buf: PinnedHostSlice<i32>,
    host: *mut i32,
    dptr: u64,
    /// `draft_pick`'s scratch (a counter, `{best, index, second, nan}` per block) and
    /// `rows_pick`'s (per row a counter and `{best, index, nan}` per block).
    draft_scratch: CudaSlice<i32>,
    rows_scratch: CudaSlice<i32>,
}

// SAFETY: plain page-locked memory. The host writes an override only while no launch
// that reads it is queued, and reads the device's words only after the event behind
// the launch that wrote them completed (volatile accesses both ways).
unsafe impl Send for SpecRing {}

/// What [`SpecRing::draft`] reads back of one draft's pick.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftPick {
    /// The override when one was set, else the first maximum of the draft's logits.
    pub token: u32,
    /// Whether the draft's logits held a NaN.
    pub nan: bool,
    /// Top-1 − top-2 of the draft's logits (`+inf` without a second value).
    pub margin: f32,
}

impl SpecRing {
    /// The device address of the draft slots (the row slots follow them).
    pub fn dptr(&self) -> u64 {
        self.dptr
    }

    /// The token the draft at `pos` proposes instead of its pick (`None`: its pick).
    /// Call only while no launch of a draft at `pos` is queued.
    pub fn set_override(&self, pos: usize, token: Option<u32>) {
        let v = token.map_or(-1, |t| t as i32);
        // SAFETY: in bounds of the live allocation; no device access is in flight.
        unsafe { std::ptr::write_volatile(self.host.add(4 * (pos % SPEC_SLOTS)), v) }
    }

    /// The pick of the draft at `pos`, after its launch's event completed.
    pub fn draft(&self, pos: usize) -> DraftPick {
        let s = 4 * (pos % SPEC_SLOTS);
        // SAFETY: in bounds; the device's writes completed before the caller's wait.
        let w = |i: usize| unsafe { std::ptr::read_volatile(self.host.add(s + i)) };
        DraftPick {
            token: w(1) as u32,
            nan: w(2) != 0,
            margin: f32::from_bits(w(3) as u32),
        }
    }

    /// Row `r`'s pick of the last verify step: `(token, nan)`, after its event.
    pub fn row(&self, r: usize) -> (u32, bool) {
        let s = SPEC_ROWS_AT + 2 * (r % SPEC_ROWS);
        // SAFETY: in bounds; the device's writes completed before the caller's wait.
        let w = |i: usize| unsafe { std::ptr::read_volatile(self.host.add(s + i)) };
        (w(0) as u32, w(1) != 0)
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
    /// `n` zeroed i32 of page-locked host memory mapped into the device's address
    /// space: the allocation, its host address and its device address.
    pub(crate) fn mapped_i32(
        &self,
        n: usize,
    ) -> Result<(PinnedHostSlice<i32>, *mut i32, u64), CudaError> {
        use cudarc::driver::sys::{CUresult, CU_MEMHOSTALLOC_DEVICEMAP};
        // SAFETY: zeroed below before any kernel can write it.
        let mut buf = unsafe {
            self.ctx
                .alloc_pinned_with_flags::<i32>(n, CU_MEMHOSTALLOC_DEVICEMAP)
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
        Ok((buf, ptr, dptr))
    }

    /// A new [`PickRing`] (zeroed).
    pub fn pick_ring(&self) -> Result<PickRing, CudaError> {
        let (buf, host, dptr) = self.mapped_i32(2 * PICK_SLOTS)?;
        Ok(PickRing {
            _buf: buf,
            host,
            dptr,
            scratch: self.zeros::<i32>(1 + 3 * PICK_BLOCKS)?,
        })
    }

    /// A new [`SpecRing`] (every override cleared).
    pub fn spec_ring(&self) -> Result<SpecRing, CudaError> {
        let (buf, host, dptr) = self.mapped_i32(SPEC_ROWS_AT + 2 * SPEC_ROWS)?;
        let ring = SpecRing {
            _buf: buf,
            host,
            dptr,
            draft_scratch: self.zeros::<i32>(1 + 4 * PICK_BLOCKS)?,
            rows_scratch: self.zeros::<i32>(SPEC_ROWS * (1 + 3 * PICK_BLOCKS))?,
        };
        for pos in 0..SPEC_SLOTS {
            ring.set_override(pos, None);
        }
        Ok(ring)
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

    /// An MTP draft's pick of its `n` logits (`kernels/pick.cu` `draft_pick`): the
    /// override of its slot or the first maximum becomes the next token of the draft's
    /// step buffer `step` and the token of the verify step's row for `pos + 1` in
    /// `vstep`; slot `pos % 16` of `ring` gets it with the NaN flag and the top-2 gap.
    pub fn draft_pick(
        &self,
        logits: u64,
        n: usize,
        step: u64,
        vstep: u64,
        ring: &SpecRing,
    ) -> Result<(), CudaError> {
        let (n, r, s) = (n as i32, ring.dptr, self.ptr(&ring.draft_scratch));
        launch!(self, "draft_pick", cfg(PICK_BLOCKS as u32, 256); logits, n, step, vstep, r, s)
    }

    /// The first maximum and NaN flag of each of `rows` logits rows of `n` values into
    /// the row slots of `ring` (`rows_pick`).
    pub fn rows_pick(
        &self,
        logits: u64,
        n: usize,
        rows: usize,
        ring: &SpecRing,
    ) -> Result<(), CudaError> {
        if rows == 0 || rows > SPEC_ROWS {
            return Err(CudaError::Invalid(format!(
                "rows_pick: 1 to {SPEC_ROWS} rows, not {rows}"
            )));
        }
        let out = ring.dptr + (SPEC_ROWS_AT * std::mem::size_of::<i32>()) as u64;
        let (n, s) = (n as i32, self.ptr(&ring.rows_scratch));
        let grid = cfg2(PICK_BLOCKS as u32, rows, 256);
        launch!(self, "rows_pick", grid; logits, n, out, s)
    }
}
