//! The read-bandwidth probe (`kernels/probe.cu`): the ceiling that the decode matvecs
//! are measured against by `gpu-selftest --probe-q8`.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::device::Gpu;
use crate::error::CudaError;
use crate::plan::DecodePlan;

impl Gpu {
    /// Reads every byte of `buf` once (16-byte loads, grid-stride); time it for the
    /// GPU's read-bandwidth ceiling.
    pub fn probe_stream_read(
        &self,
        buf: &cudarc::driver::CudaSlice<u8>,
        sink: &cudarc::driver::CudaSlice<u32>,
    ) -> Result<(), CudaError> {
        let n16 = (buf.len() / 16) as i64;
        let f = self.func("probe_stream_read")?;
        let sms = self.info().multiprocessors.max(1) as u32;
        let cfg = LaunchConfig {
            grid_dim: (sms * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (p, out) = (self.ptr(buf), self.ptr(sink));
        let mut b = self.launch_stream().launch_builder(&f);
        b.arg(&p).arg(&n16).arg(&out);
        // SAFETY: p holds n16 16-byte words; out holds one u32.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Reads every byte of `buf` once by bulk copies of `chunk` bytes into a ring of
    /// `stages` shared-memory buffers, `blocks_per_sm` blocks an SM; time it against
    /// [`Gpu::probe_stream_read`] at a matrix's size.
    pub fn probe_bulk_read(
        &self,
        buf: &cudarc::driver::CudaSlice<u8>,
        sink: &cudarc::driver::CudaSlice<u32>,
        (chunk, stages, blocks_per_sm): (usize, usize, u32),
    ) -> Result<(), CudaError> {
        assert!(chunk % 16 == 0 && chunk >= 512 && (1..=16).contains(&stages));
        let n_chunks = (buf.len() / chunk) as i64;
        let smem = chunk * stages;
        self.allow_smem("probe_bulk_read", smem)?;
        let f = self.func("probe_bulk_read")?;
        let sms = self.info().multiprocessors.max(1) as u32;
        let cfg = LaunchConfig {
            grid_dim: (sms * blocks_per_sm, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (p, out) = (self.ptr(buf), self.ptr(sink));
        let (chunk, stages) = (chunk as i32, stages as i32);
        let mut b = self.launch_stream().launch_builder(&f);
        b.arg(&p).arg(&n_chunks).arg(&chunk).arg(&stages).arg(&out);
        // SAFETY: p holds n_chunks chunks of `chunk` bytes; the ring is chunk · stages
        // bytes of dynamic shared memory; out holds one u32.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Mean µs per node of a captured graph of `n` empty kernels of `blocks` × 256
    /// threads, replayed `reps` times: the launch cost each decode kernel pays.
    pub fn probe_graph_node_us(
        &self,
        n: usize,
        blocks: u32,
        reps: usize,
    ) -> Result<f64, CudaError> {
        let f = self.func("probe_empty")?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let zero = 0i32;
        let launch_all = || -> Result<(), CudaError> {
            for _ in 0..n {
                let mut b = self.launch_stream().launch_builder(&f);
                b.arg(&zero);
                // SAFETY: probe_empty reads nothing.
                unsafe { b.launch(cfg) }?;
            }
            Ok(())
        };
        // Instantiated as the decode graphs are under the default plan.
        let graph = self.launcher(DecodePlan::default()).capture(launch_all)?;
        let ms = self.time_ms(2, reps, |_| graph.launch())?;
        Ok(ms * 1e3 / n.max(1) as f64)
    }

    /// Holds the launch stream for `ns` nanoseconds of device time.
    pub(crate) fn spin(&self, ns: u64) -> Result<(), CudaError> {
        let f = self.func("probe_spin")?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.launch_stream().launch_builder(&f);
        b.arg(&ns);
        // SAFETY: probe_spin reads and writes no memory.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
