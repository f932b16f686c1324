//! Greedy decode with the picks made on the device (`Session::greedy_run`): a token's
//! graph ends with `greedy_pick`, which writes the argmax of its logits into the step
//! buffer as the next token. The next graph can then be launched while this one runs,
//! before the host has seen the token: the host launches graph t + 1, waits for graph t's
//! event and reads t's pick from a mapped ring slot. The GPU never waits for the host
//! between tokens (~0.2 ms a token otherwise: the logits' download, the host's scan,
//! the next step's upload and the graph launch).

use std::collections::HashMap;

use ds4_cuda::{PickRing, TokenEvent, TokenGraph};

use super::DeviceState;
use crate::cuda::weights::CudaWeights;
use crate::error::{EngineError, Result};
use crate::ops::linear::Numerics;

/// A session's pick machinery, allocated by its first [`DeviceState::decode_pick`].
pub(in crate::cuda) struct Picks {
    ring: PickRing,
    /// One event per token in flight (token `pos` uses `events[pos % 2]`).
    events: [TokenEvent; 2],
    /// The token graphs with the pick at their end (keyed by [`DeviceState::emit_key`]),
    /// and the numerics and left-out token they were captured with.
    graphs: HashMap<u64, TokenGraph>,
    captured: Option<(Numerics, i32)>,
}

impl Picks {
    /// Drops the captured graphs (the steering they baked in changed).
    pub(super) fn forget_graphs(&mut self) {
        self.graphs.clear();
    }
}

impl DeviceState {
    /// Decodes one token at position `n_tokens` and picks the next on the device
    /// (`skip`: a token id left out of the pick, -1 none). `token`: the host's token, or
    /// `None` for the device's pick of the previous `decode_pick` (still in the step
    /// buffer; nothing may have run on this session in between). Returns once the
    /// launch is queued; [`DeviceState::pick_result`] waits for the pick.
    pub fn decode_pick(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        token: Option<u32>,
        skip: i32,
    ) -> Result<()> {
        let g = &w.gpu.launcher(self.plan);
        if self.picks.is_none() {
            self.picks = Some(Picks {
                ring: g.pick_ring()?,
                events: [g.token_event()?, g.token_event()?],
                graphs: HashMap::new(),
                captured: None,
            });
        }
        if let Some(t) = token {
            let pos = self.n_tokens as i32;
            g.write(&mut self.s.s.step, &[pos, t as i32])?;
        }
        if self.use_graphs {
            let key = self.emit_key(&w.config);
            let p = self.picks.as_mut().expect("allocated above");
            if p.captured != Some((numerics, skip)) {
                p.graphs.clear();
                p.captured = Some((numerics, skip));
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
                    let graph = g.capture(|| self.enqueue_pick(w, numerics, skip));
                    self.n_tokens = here;
                    let p = self.picks.as_mut().expect("allocated above");
                    p.graphs.insert(k, graph?);
                }
            }
            self.picks.as_ref().expect("allocated above").graphs[&key].launch()?;
        } else {
            self.enqueue_pick(w, numerics, skip)?;
        }
        let p = self.picks.as_ref().expect("allocated above");
        p.events[self.n_tokens % 2].record(&w.gpu)?;
        // The MTP draft's `HcSource::Last`: the decode scratch's streams.
        self.last_hc = Some(g.ptr(&self.s.s.h));
        self.n_tokens += 1;
        Ok(())
    }

    /// One token with the output head, then the pick of its logits.
    fn enqueue_pick(&mut self, w: &CudaWeights, numerics: Numerics, skip: i32) -> Result<()> {
        self.enqueue_token(w, numerics, true)?;
        let g = &w.gpu.launcher(self.plan);
        let (step, logits) = (g.ptr(&self.s.s.step), g.ptr(&self.s.s.logits));
        let ring = &self.picks.as_ref().expect("allocated before").ring;
        g.greedy_pick(step, logits, w.config.vocab, skip, ring)?;
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
        Ok(p.ring.read(pos))
    }
}
