//! Sampled picks made on the device (`kernels/sample.cu`): temperature, top-k, top-p
//! and min-p as the engine's sampler defines them in integer weights
//! (`ds4-engine` `sampling/fixed.rs`), so that a sampled decode, like a greedy one,
//! launches token k + 1's graph before the host has seen token k.
//!
//! * [`SampleRing`]: mapped host memory with the settings and, per slot `pos % 4`, the
//!   host's uniform draw for the token decoded at `pos` (written before its launch)
//!   and the device's pick `{token, nan}`; plus the pick's device scratch;
//! * [`Launcher::sample_pick`] ends a decode graph: the row's maximum (`sample_max`),
//!   then the pick (`sample_pick`) into the step buffer and the ring.

use cudarc::driver::{CudaSlice, PinnedHostSlice, PushKernelArg};

use crate::device::Gpu;
use crate::error::CudaError;
use crate::layer::cfg;
use crate::pick::PICK_BLOCKS;
use crate::plan::Launcher;

/// Slots of a [`SampleRing`]: more than the picks in flight (two with one graph ahead).
pub const SAMPLE_SLOTS: usize = 4;
/// Ring words before the slots (the settings: `sample.cu` SAMPLE_SLOT0).
const SLOT0: usize = 8;
/// Threads of a `sample_pick` block (`sample.cu` SAMPLE_THREADS).
const SAMPLE_THREADS: u32 = 1024;
/// The largest vocabulary the device's keys hold (17 bits of token id).
pub const SAMPLE_MAX_VOCAB: usize = 1 << 17;

/// A sampled pick's settings as the device takes them (the engine's `PickParams`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleSettings {
    /// Temperature (> 0).
    pub t: f64,
    /// 1: off.
    pub top_p: f64,
    /// The least integer weight min-p keeps (1: off).
    pub w_min: u64,
    /// 0: off.
    pub top_k: u32,
}

/// The mapped ring and device scratch of sampled picks over a vocabulary of `vocab`.
pub struct SampleRing {
    _buf: PinnedHostSlice<i32>,
    host: *mut i32,
    dptr: u64,
    vocab: usize,
    /// `sample_max`'s pick_grid scratch (a counter, `{best, index, nan}` per block).
    max_scratch: CudaSlice<i32>,
    /// `sample_max`'s result `{argmax, nan, max bits}` and its copy of the settings and
    /// the draw (16 words, `sample.cu` sample_params).
    res: CudaSlice<i32>,
    /// `{entries, finished blocks}`, zero between launches.
    cnt: CudaSlice<u32>,
    /// `{total weight, least key, largest key}` of the list, `{0, !0, 0}` between launches.
    acc: CudaSlice<u64>,
    /// The candidate list: keys and weights, `vocab` each.
    keys: CudaSlice<u64>,
    ws: CudaSlice<u64>,
}

// SAFETY: plain page-locked memory. The host writes the settings and a slot's draw only
// while no launch that reads them is queued, and reads a slot's pick only after the
// event behind the launch that wrote it completed (volatile accesses both ways).
unsafe impl Send for SampleRing {}

impl SampleRing {
    /// Sets the settings. Call only while no sampled pick is queued.
    pub fn set(&self, s: &SampleSettings) {
        let w = [s.t.to_bits(), s.top_p.to_bits(), s.w_min];
        // SAFETY: words 0..7 of the live allocation (8-byte aligned: pinned memory is
        // page-aligned); no device access is in flight.
        unsafe {
            let p = self.host as *mut u64;
            for (i, v) in w.iter().enumerate() {
                std::ptr::write_volatile(p.add(i), *v);
            }
            std::ptr::write_volatile(self.host.add(6), s.top_k.min(i32::MAX as u32) as i32);
        }
    }

    /// The uniform draw `u ∈ [0, 1)` of the token decoded at `pos`. Call before that
    /// token's launch, while no launch reading slot `pos % 4` is queued.
    pub fn set_draw(&self, pos: usize, u: f64) {
        let at = SLOT0 + 4 * (pos % SAMPLE_SLOTS);
        // SAFETY: in bounds, 8-byte aligned (SLOT0 and the slot stride are even).
        unsafe { std::ptr::write_volatile(self.host.add(at) as *mut u64, u.to_bits()) }
    }

    /// The pick of the token decoded at `pos`: `(token, nan)`, after its event.
    pub fn read(&self, pos: usize) -> (u32, bool) {
        let at = SLOT0 + 4 * (pos % SAMPLE_SLOTS) + 2;
        // SAFETY: in bounds; the device's writes completed before the caller's wait.
        let w = |i: usize| unsafe { std::ptr::read_volatile(self.host.add(at + i)) };
        (w(0) as u32, w(1) != 0)
    }
}

impl Gpu {
    /// A new [`SampleRing`] for rows of `vocab` logits (at most [`SAMPLE_MAX_VOCAB`]).
    pub fn sample_ring(&self, vocab: usize) -> Result<SampleRing, CudaError> {
        if vocab == 0 || vocab > SAMPLE_MAX_VOCAB {
            return Err(CudaError::Invalid(format!(
                "device sampling takes 1 to {SAMPLE_MAX_VOCAB} logits a row, not {vocab}"
            )));
        }
        let (buf, host, dptr) = self.mapped_i32(SLOT0 + 4 * SAMPLE_SLOTS)?;
        Ok(SampleRing {
            _buf: buf,
            host,
            dptr,
            vocab,
            max_scratch: self.zeros::<i32>(1 + 3 * PICK_BLOCKS)?,
            res: self.zeros::<i32>(16)?,
            cnt: self.zeros::<u32>(2)?,
            acc: self.upload(&[0, u64::MAX, 0])?,
            keys: self.zeros::<u64>(vocab)?,
            ws: self.zeros::<u64>(vocab)?,
        })
    }
}

impl Launcher<'_> {
    /// The sampled pick of the `n` logits at `logits` (settings and draw from `ring`)
    /// into the step buffer `step` (`{pos, token}` → `{pos + 1, pick}`) and slot
    /// `pos % 4` of `ring`.
    pub fn sample_pick(
        &self,
        step: u64,
        logits: u64,
        n: usize,
        ring: &SampleRing,
    ) -> Result<(), CudaError> {
        if n == 0 || n > ring.vocab {
            return Err(CudaError::Invalid(format!(
                "sample_pick: {n} logits on a ring for {}",
                ring.vocab
            )));
        }
        let (n, s, res) = (n as i32, self.ptr(&ring.max_scratch), self.ptr(&ring.res));
        let r = ring.dptr;
        launch!(self, "sample_max", cfg(PICK_BLOCKS as u32, 256); logits, n, step, r, s, res)?;
        let (cnt, acc) = (self.ptr(&ring.cnt), self.ptr(&ring.acc));
        let (keys, ws) = (self.ptr(&ring.keys), self.ptr(&ring.ws));
        let grid = cfg(PICK_BLOCKS as u32, SAMPLE_THREADS);
        launch!(self, "sample_pick", grid; step, logits, n, r, res, cnt, acc, keys, ws)
    }
}
