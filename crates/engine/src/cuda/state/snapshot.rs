//! Session snapshots on the device: export to / import from the host `KvCache` form
//! (the format shared with the CPU backend) and device-to-device duplicates.

use ds4_cuda::{CudaError, DeviceBuf, Gpu};

use super::DeviceState;
use crate::cuda::weights::CudaWeights;
use crate::error::Result;
use crate::kv::{Frontier, KvCache};

impl DeviceState {
    /// The state in host form (rows in logical order, frontiers as stored).
    pub fn export(&self, w: &CudaWeights) -> Result<KvCache> {
        let g = &*w.gpu;
        let c = &w.config;
        let mut kv = KvCache::new(c, self.ctx);
        kv.n_tokens = self.n_tokens;
        let hd = c.head_dim;
        for (il, (lc, st)) in kv.layers.iter_mut().zip(&self.layers).enumerate() {
            if !w.range.contains(&il) {
                // Another GPU's layer (a split model): its stage exports it.
                continue;
            }
            let ring = g.download(&st.ring)?;
            let n_raw = self.n_tokens.min(self.window);
            let first = self.n_tokens - n_raw;
            let rows: Vec<f32> = (first..self.n_tokens)
                .flat_map(|pos| {
                    ring[(pos % self.raw_cap) * hd..(pos % self.raw_cap + 1) * hd]
                        .iter()
                        .copied()
                })
                .collect();
            lc.set_raw(&rows);
            let r = c.compress_ratios[il];
            if let (Some(comp), Some(skv), Some(ssc)) = (&st.comp, &st.skv, &st.ssc) {
                let n = self.n_tokens / r;
                lc.comp = g.download(comp)?[..n * hd].to_vec();
                set_frontier(lc.comp_state.as_mut(), g.download(skv)?, g.download(ssc)?);
            }
            if let (Some(index), Some(iskv), Some(issc)) = (&st.index, &st.iskv, &st.issc) {
                let n = self.n_tokens / r;
                lc.index = g.download(index)?[..n * c.idx_head_dim].to_vec();
                set_frontier(
                    lc.index_state.as_mut(),
                    g.download(iskv)?,
                    g.download(issc)?,
                );
            }
        }
        Ok(kv)
    }

    /// Loads a host-form state.
    pub fn import(&mut self, w: &CudaWeights, kv: &KvCache) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        if kv.ctx > self.ctx || kv.layers.len() != self.layers.len() {
            return Err(crate::error::EngineError::Invalid(format!(
                "state for ctx {} / {} layers does not fit this session (ctx {})",
                kv.ctx,
                kv.layers.len(),
                self.ctx
            )));
        }
        let hd = c.head_dim;
        for (il, (lc, st)) in kv.layers.iter().zip(self.layers.iter_mut()).enumerate() {
            if !w.range.contains(&il) {
                continue;
            }
            let n_raw = lc.n_raw();
            let mut ring = vec![0.0f32; self.raw_cap * hd];
            for i in 0..n_raw {
                let pos = kv.n_tokens - n_raw + i;
                let slot = pos % self.raw_cap;
                ring[slot * hd..(slot + 1) * hd].copy_from_slice(lc.raw_row(i));
            }
            g.write(&mut st.ring, &ring)?;
            if let (Some(comp), Some(skv), Some(ssc), Some(f)) =
                (&mut st.comp, &mut st.skv, &mut st.ssc, &lc.comp_state)
            {
                write_prefix(g, comp, &lc.comp)?;
                g.write(skv, &f.kv)?;
                g.write(ssc, &f.score)?;
            }
            if let (Some(index), Some(iskv), Some(issc), Some(f)) =
                (&mut st.index, &mut st.iskv, &mut st.issc, &lc.index_state)
            {
                write_prefix(g, index, &lc.index)?;
                g.write(iskv, &f.kv)?;
                g.write(issc, &f.score)?;
            }
        }
        self.n_tokens = kv.n_tokens;
        Ok(())
    }

    /// Back to the state of a new session: every compressor and indexer frontier
    /// empty (kv 0, scores `NEG_INF`, as [`DeviceState::new`] leaves them) and no
    /// tokens. The first windows of the next prompt pool over these slots, so stale
    /// ones would change its compressed rows; rows past the counts are never read.
    pub fn clear(&mut self, w: &CudaWeights) -> Result<()> {
        let g = &*w.gpu;
        for st in &mut self.layers {
            for (kv, score) in [(&mut st.skv, &mut st.ssc), (&mut st.iskv, &mut st.issc)] {
                if let (Some(kv), Some(score)) = (kv, score) {
                    g.write(kv, &vec![0.0; kv.len()])?;
                    g.write(score, &vec![crate::kv::NEG_INF; score.len()])?;
                }
            }
        }
        self.n_tokens = 0;
        Ok(())
    }

    /// An independent copy (a snapshot of the session), copied on the device: only the
    /// compressed rows in use move, so a long session snapshots in milliseconds instead
    /// of a host round trip.
    pub fn duplicate(&self, w: &CudaWeights) -> Result<DeviceState> {
        let mut d = DeviceState::new(w, self.ctx, self.plan)?;
        if d.raw_cap != self.raw_cap || d.layers.len() != self.layers.len() {
            // The ring geometry changed (DS4_CUDA_PREFILL_CHUNK differs): go through the
            // host form, which is independent of it.
            d.import(w, &self.export(w)?)?;
            self.mtp_duplicate_into(w, &mut d)?;
            return Ok(d);
        }
        let g = &*w.gpu;
        let c = &w.config;
        let copy = |src: &DeviceBuf<f32>, dst: &mut DeviceBuf<f32>, n: usize| {
            let n = n.min(src.len()).min(dst.len());
            if n == 0 {
                return Ok::<(), CudaError>(());
            }
            Ok(g.stream()
                .memcpy_dtod(&src.slice(0..n), &mut dst.slice_mut(0..n))?)
        };
        for (il, (src, dst)) in self.layers.iter().zip(d.layers.iter_mut()).enumerate() {
            copy(&src.ring, &mut dst.ring, src.ring.len())?;
            let r = c.compress_ratios[il].max(1);
            let n_comp = self.n_tokens / r;
            let pairs = [
                (&src.comp, &mut dst.comp, n_comp * c.head_dim),
                (&src.skv, &mut dst.skv, usize::MAX),
                (&src.ssc, &mut dst.ssc, usize::MAX),
                (&src.index, &mut dst.index, n_comp * c.idx_head_dim),
                (&src.iskv, &mut dst.iskv, usize::MAX),
                (&src.issc, &mut dst.issc, usize::MAX),
            ];
            for (s, t, n) in pairs {
                if let (Some(s), Some(t)) = (s, t) {
                    copy(s, t, n)?;
                }
            }
        }
        d.n_tokens = self.n_tokens;
        d.chunk = self.chunk;
        self.mtp_duplicate_into(w, &mut d)?;
        g.synchronize()?;
        Ok(d)
    }
}

fn set_frontier(f: Option<&mut Frontier>, kv: Vec<f32>, score: Vec<f32>) {
    if let Some(f) = f {
        f.kv = kv;
        f.score = score;
    }
}

fn write_prefix(g: &Gpu, dst: &mut DeviceBuf<f32>, src: &[f32]) -> Result<(), CudaError> {
    if src.is_empty() {
        return Ok(());
    }
    let mut view = dst.slice_mut(0..src.len());
    Ok(g.stream().memcpy_htod(src, &mut view)?)
}
