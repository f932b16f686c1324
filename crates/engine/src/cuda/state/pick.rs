//! Greedy decode with the picks made on the device (`Session::greedy_run`): a token's
//! graph ends with `greedy_pick`, which writes the argmax of its logits into the step
//! buffer as the next token. The next graph can then be launched while this one runs,
//! before the host has seen the token: the host launches graph t + 1, waits for graph t's
//! event and reads t's pick from a mapped ring slot. The GPU never waits for the host
//! between tokens (~0.2 ms a token otherwise: the logits' download, the host's scan,
//! the next step's upload and the graph launch).
//!
//! Sampled decode (`Session::sample_run`) ends the graph with `sample_pick` instead:
//! the host's sampler settings and, per token, its uniform draw go to a mapped
//! [`SampleRing`] before the launch, and the device picks the token the host's sampler
//! would (`sampling/fixed.rs`).

use std::collections::HashMap;

use ds4_cuda::{PickRing, SampleRing, SampleSettings, TokenEvent, TokenGraph};

use super::DeviceState;
use crate::cuda::weights::CudaWeights;
use crate::error::{EngineError, Result};
use crate::ops::linear::Numerics;

/// How a token's graph picks the next token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(in crate::cuda) enum PickMode {
    /// The first maximum, a token id left out (-1: none).
    Greedy { skip: i32 },
    /// The sampler's pick, settings and draws from the session's [`SampleRing`].
    Sample,
}

/// A session's pick machinery, allocated by its first [`DeviceState::decode_pick`].
pub(in crate::cuda) struct Picks {
    ring: PickRing,
    /// Allocated by the first [`DeviceState::sample_settings`].
    sample: Option<SampleRing>,
    /// The mode of the picks in flight (which ring [`DeviceState::pick_result`] reads).
    mode: PickMode,
    /// One event per token in flight (token `pos` uses `events[pos % 2]`).
    events: [TokenEvent; 2],
    /// The token graphs with the pick at their end (keyed by [`DeviceState::emit_key`]),
    /// and the numerics and pick they were captured with.
    graphs: HashMap<u64, TokenGraph>,
    captured: Option<(Numerics, PickMode)>,
}

impl Picks {
    /// Drops the captured graphs (the steering they baked in changed).
    pub(super) fn forget_graphs(&mut self) {
        self.graphs.clear();
    }
}

impl DeviceState {
    /// The pick machinery, allocated on first use.
    fn picks(&mut self, w: &CudaWeights) -> Result<&mut Picks> {
        if self.picks.is_none() {
            let g = &w.gpu.launcher(self.plan);
            self.picks = Some(Picks {
                ring: g.pick_ring()?,
                sample: None,
                mode: PickMode::Greedy { skip: -1 },
                events: [g.token_event()?, g.token_event()?],
                graphs: HashMap::new(),
                captured: None,
            });
        }
        Ok(self.picks.as_mut().expect("allocated above"))
    }

    /// The sampler's settings for the next [`PickMode::Sample`] picks. Call only while
    /// no sampled pick is in flight.
    pub fn sample_settings(&mut self, w: &CudaWeights, s: &SampleSettings) -> Result<()> {
        let vocab = w.config.vocab;
        let p = self.picks(w)?;
        if p.sample.is_none() {
            p.sample = Some(w.gpu.sample_ring(vocab)?);
        }
        p.sample.as_ref().expect("allocated above").set(s);
        Ok(())
    }

    /// The uniform draw of the sampled pick after the token decoded at `pos` (before
    /// that token's [`DeviceState::decode_pick`]).
    pub fn sample_draw(&self, pos: usize, u: f64) -> Result<()> {
        match self.picks.as_ref().and_then(|p| p.sample.as_ref()) {
            Some(r) => {
                r.set_draw(pos, u);
                Ok(())
            }
            None => Err(EngineError::Invalid(
                "a sampled pick's draw before its settings".into(),
            )),
        }
    }

    /// Decodes one token at position `n_tokens` and picks the next on the device as
    /// `mode` says. `token`: the host's token, or `None` for the device's pick of the
    /// previous `decode_pick` (still in the step buffer; nothing may have run on this
    /// session in between). Returns once the launch is queued;
    /// [`DeviceState::pick_result`] waits for the pick.
    pub fn decode_pick(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        token: Option<u32>,
        mode: PickMode,
    ) -> Result<()> {
        let p = self.picks(w)?;
        if mode == PickMode::Sample && p.sample.is_none() {
            return Err(EngineError::Invalid(
                "a sampled pick before its settings".into(),
            ));
        }
        p.mode = mode;
        let g = &w.gpu.launcher(self.plan);
        if let Some(t) = token {
            let pos = self.n_tokens as i32;
            g.write(&mut self.s.s.step, &[pos, t as i32])?;
        }
        if self.use_graphs {
            let key = self.emit_key(&w.config);
            let p = self.picks.as_mut().expect("allocated above");
            if p.captured != Some((numerics, mode)) {
                p.graphs.clear();
                p.captured = Some((numerics, mode));
            }
            if !p.graphs.contains_key(&key) {
                let here = self.n_tokens;
                for (k, pos) in self.capture_plan(&w.config) {
                    if self
                        .picks
                        .as_ref()
                        .expect("allocated above")
                        .graphs
                        .contains_key(&k)
                    {
                        continue;
                    }
                    self.n_tokens = pos;
                    let graph = g.capture(|| self.enqueue_pick(w, numerics, mode));
                    self.n_tokens = here;
                    let p = self.picks.as_mut().expect("allocated above");
                    p.graphs.insert(k, graph?);
                }
            }
            self.picks.as_ref().expect("allocated above").graphs[&key].launch()?;
        } else {
            self.enqueue_pick(w, numerics, mode)?;
        }
        let p = self.picks.as_ref().expect("allocated above");
        p.events[self.n_tokens % 2].record(&w.gpu)?;
        // The MTP draft's `HcSource::Last`: the decode scratch's streams.
        self.last_hc = Some(g.ptr(&self.s.s.h));
        self.n_tokens += 1;
        Ok(())
    }

    /// One token with the output head, then the pick of its logits.
    fn enqueue_pick(&mut self, w: &CudaWeights, numerics: Numerics, mode: PickMode) -> Result<()> {
        self.enqueue_token(w, numerics, true)?;
        let g = &w.gpu.launcher(self.plan);
        let (step, logits) = (g.ptr(&self.s.s.step), g.ptr(&self.s.s.logits));
        let p = self.picks.as_ref().expect("allocated before");
        match (mode, &p.sample) {
            (PickMode::Greedy { skip }, _) => {
                g.greedy_pick(step, logits, w.config.vocab, skip, &p.ring)?
            }
            (PickMode::Sample, Some(ring)) => g.sample_pick(step, logits, w.config.vocab, ring)?,
            (PickMode::Sample, None) => unreachable!("decode_pick checked the ring"),
        }
        Ok(())
    }

    /// Waits for the pick of the token decoded at `pos` by [`DeviceState::decode_pick`]
    /// (one of the last two): the next token, and whether its logits held a NaN (the
    /// token is then meaningless).
    pub fn pick_result(&self, pos: usize) -> Result<(u32, bool)> {
        let Some(p) = &self.picks else {
            return Err(EngineError::Invalid("no device pick was launched".into()));
        };
        p.events[pos % 2].wait()?;
        Ok(match (p.mode, &p.sample) {
            (PickMode::Sample, Some(r)) => r.read(pos),
            _ => p.ring.read(pos),
        })
    }
}
