//! Directional steering on the device (`crate::steer`): the directions uploaded once per
//! session, and what the layer launches ask of them (state/layers.rs runs `steer_rows`
//! after the attention output and on the summed FFN output when a scale is nonzero).

use ds4_cuda::{DeviceBuf, Launcher};

use super::DeviceState;
use crate::cuda::weights::CudaWeights;
use crate::error::Result;
use crate::steer::{Component, Steering};

/// A session's steering directions (`[n_layer][n_embd]`) and scales.
pub(in crate::cuda) struct SteerDev {
    dirs: DeviceBuf<f32>,
    n_layer: usize,
    n_embd: usize,
    ffn: f32,
    attn: f32,
}

impl SteerDev {
    /// Layer `il`'s direction (device address) and the scale of `c`, when that edit
    /// runs: never at scale 0, nor past the file's layers (the MTP block).
    pub(super) fn at(&self, g: &Launcher, il: usize, c: Component) -> Option<(u64, f32)> {
        let scale = match c {
            Component::AttnOut => self.attn,
            Component::FfnOut => self.ffn,
        };
        (scale != 0.0 && il < self.n_layer)
            .then(|| (g.ptr(&self.dirs) + (il * self.n_embd * 4) as u64, scale))
    }
}

impl DeviceState {
    /// Steers the later forward passes with `steering` (`None` or zero scales: off,
    /// no launch added). The captured decode and multi-row graphs hold the old
    /// launches (or none), so they are dropped and captured again on next use.
    pub fn set_steering(&mut self, w: &CudaWeights, steering: Option<&Steering>) -> Result<()> {
        let dev = match steering.filter(|s| s.active()) {
            Some(s) => Some(SteerDev {
                dirs: w.gpu.upload(&s.dirs)?,
                n_layer: s.n_layer,
                n_embd: s.n_embd,
                ffn: s.ffn,
                attn: s.attn,
            }),
            None => None,
        };
        if dev.is_none() && self.steer.is_none() {
            return Ok(());
        }
        self.steer = dev;
        self.graphs.clear();
        if let Some(rs) = self.rows.as_mut() {
            rs.forget_graphs();
        }
        if let Some(p) = self.picks.as_mut() {
            p.forget_graphs();
        }
        Ok(())
    }
}
