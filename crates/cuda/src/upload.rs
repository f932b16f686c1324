//! Bulk host→device upload of weights through pinned staging buffers.
//!
//! A plain copy from pageable memory goes through the driver's own small staging at a
//! fraction of the bus speed, and repacking whole matrices into fresh host vectors first
//! costs a page fault per 4 KiB of an 80 GiB model. Here each repacked part is gathered
//! from the GGUF blocks straight into one of two pinned buffers (by every core), and
//! that buffer's DMA runs while the other one is being filled.

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};
use rayon::prelude::*;

use crate::device::Gpu;
use crate::error::CudaError;

/// Bytes of one pinned staging buffer.
const STAGE_BYTES: usize = 64 << 20;
/// Staging buffers in turn: one filling while the other's copy runs.
const STAGES: usize = 2;
/// Parts smaller than this take the plain (pageable) copy.
const SMALL_BYTES: usize = 1 << 20;
/// Output bytes per parallel fill task.
const TASK_BYTES: usize = 1 << 20;

struct Stage {
    /// Owns the pinned memory `ptr` points into.
    _buf: PinnedHostSlice<u8>,
    ptr: *mut u8,
    /// The copy out of this buffer last issued, if any.
    pending: Option<CudaEvent>,
}

/// The pinned buffers, allocated on the first large upload and freed by
/// [`Gpu::release_staging`] (or with the [`Gpu`]).
pub(crate) struct Staging {
    stages: Vec<Stage>,
    next: usize,
}

// SAFETY: the raw pointers address the pinned allocations owned by `_buf` in the same
// Stage; Staging lives behind the Gpu's mutex, so one thread fills a buffer at a time.
unsafe impl Send for Staging {}

impl Staging {
    fn wait_all(&mut self) -> Result<(), CudaError> {
        for s in &mut self.stages {
            if let Some(e) = s.pending.take() {
                e.synchronize()?;
            }
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // A DMA may still read a buffer: it must end before the memory is freed.
        let _ = self.wait_all();
    }
}

/// A gather of the `len` bytes at `off` of every `block`-byte block of `src` is well
/// formed (device and mapped-host uploads alike).
pub(crate) fn check_gather(
    src: &[u8],
    block: usize,
    off: usize,
    len: usize,
) -> Result<(), CudaError> {
    if block == 0 || len == 0 || off + len > block || !src.len().is_multiple_of(block) {
        return Err(CudaError::Invalid(format!(
            "gather of {len} bytes at {off} of {block}-byte blocks from {} bytes",
            src.len()
        )));
    }
    Ok(())
}

/// Gathers the `len` bytes at `off` of every `block`-byte block of `src` into `out`
/// (`out.len() = src.len() / block · len`), in parallel.
pub(crate) fn gather_into(out: &mut [u8], src: &[u8], block: usize, off: usize, len: usize) {
    let per_task = (TASK_BYTES / len).max(1);
    out.par_chunks_mut(per_task * len)
        .zip(src.par_chunks(per_task * block))
        .for_each(|(o, s)| {
            if len == block {
                o.copy_from_slice(s);
            } else {
                for (ob, sb) in o.chunks_exact_mut(len).zip(s.chunks_exact(block)) {
                    ob.copy_from_slice(&sb[off..off + len]);
                }
            }
        });
}

impl Gpu {
    /// A new device buffer holding the `len` bytes at `off` of every `block`-byte block
    /// of `src`, in order (one repacked part of a weight; `block = len` copies `src`).
    pub fn upload_gather(
        &self,
        src: &[u8],
        block: usize,
        off: usize,
        len: usize,
    ) -> Result<CudaSlice<u8>, CudaError> {
        check_gather(src, block, off, len)?;
        let n_blocks = src.len() / block;
        let total = n_blocks * len;
        if total < SMALL_BYTES {
            let mut v = vec![0u8; total];
            gather_into(&mut v, src, block, off, len);
            return self.upload(&v);
        }
        // SAFETY: every byte is written by the copies below before any kernel reads it
        // (same stream).
        let mut dst = unsafe { self.stream.alloc::<u8>(total) }?;
        let mut guard = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let mut stages = Vec::with_capacity(STAGES);
            for _ in 0..STAGES {
                // SAFETY: plain bytes; written before each copy reads them.
                let mut buf = unsafe { self.ctx.alloc_pinned::<u8>(STAGE_BYTES) }?;
                let ptr = buf.as_mut_ptr()?;
                stages.push(Stage {
                    _buf: buf,
                    ptr,
                    pending: None,
                });
            }
            *guard = Some(Staging { stages, next: 0 });
        }
        let staging = guard.as_mut().expect("staging allocated above");
        let per_stage = (STAGE_BYTES / len).max(1);
        let mut b0 = 0;
        while b0 < n_blocks {
            let b1 = (b0 + per_stage).min(n_blocks);
            let n = (b1 - b0) * len;
            let k = staging.next;
            staging.next = (k + 1) % STAGES;
            let stage = &mut staging.stages[k];
            if let Some(e) = stage.pending.take() {
                e.synchronize()?;
            }
            // SAFETY: the buffer holds STAGE_BYTES ≥ n bytes and its last copy is done.
            let out = unsafe { std::slice::from_raw_parts_mut(stage.ptr, n) };
            gather_into(out, &src[b0 * block..b1 * block], block, off, len);
            let mut view = dst.slice_mut(b0 * len..b1 * len);
            // Pinned memory: the driver starts the DMA and returns; the event says when
            // the buffer may be refilled.
            self.stream.memcpy_htod(&out[..], &mut view)?;
            stage.pending = Some(self.stream.record_event(None)?);
            b0 = b1;
        }
        Ok(dst)
    }

    /// A new device buffer holding `src` (a weight kept in its GGUF layout), through
    /// the staging buffers.
    pub fn upload_bulk(&self, src: &[u8]) -> Result<CudaSlice<u8>, CudaError> {
        self.upload_gather(src, 1, 0, 1)
    }

    /// Waits for the staged copies and frees the pinned buffers (after a model load).
    pub fn release_staging(&self) -> Result<(), CudaError> {
        let mut guard = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut s) = guard.take() {
            s.wait_all()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::gather_into;

    #[test]
    fn gathering_matches_a_serial_walk() {
        // Blocks that straddle the parallel tasks' boundaries, and a plain copy.
        let src: Vec<u8> = (0..34 * 70_001u32).map(|i| (i * 7 % 251) as u8).collect();
        for (block, off, len) in [(34, 2, 32), (34, 0, 2), (1, 0, 1), (17, 5, 3)] {
            let want: Vec<u8> = src
                .chunks_exact(block)
                .flat_map(|b| &b[off..off + len])
                .copied()
                .collect();
            let mut got = vec![0u8; want.len()];
            gather_into(&mut got, &src, block, off, len);
            assert_eq!(got, want, "block {block} off {off} len {len}");
        }
    }
}
