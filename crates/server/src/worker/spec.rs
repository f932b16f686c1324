//! Speculative decoding in the generation loop (`--mtp`, docs/server.md "MTP"): when a
//! cycle may run, how many tokens it may return, and the rewind after a reply that ended
//! inside a cycle's tokens.
//!
//! A cycle (`EngineBackend::advance`) decodes the emitted token and the accepted drafts
//! and returns the tokens after it; the loop emits them one by one with the plain loop's
//! checks, so the reply is the plain loop's: token for token for greedy requests, in
//! distribution with temperature. Three things keep it so:
//! * the sampler: the DSML rule decodes tags greedily whatever the request's sampler,
//!   and a cycle samples all its tokens with one sampler; with tools active a cycle runs
//!   only for greedy requests (where both are the argmax), otherwise the plain step;
//! * limits: a cycle returns at most the tokens `max_tokens` and the context still
//!   allow, never crosses a continued-checkpoint position (the checkpoint is saved when
//!   the session holds exactly that many tokens, as in the plain loop), and ends at EOS
//!   (not decoded, as in the plain loop);
//! * endings the engine cannot see (a stop string, a closed tool-call block, a
//!   cancelled request) may fall inside a cycle's tokens, which the session then already
//!   holds: [`Worker::rewind_to`] brings it back to the plain loop's length.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use ds4_engine::Sampler;

use super::Worker;
use crate::job::GenJob;
use crate::log;

impl Worker {
    /// Whether this request's generation may run speculative cycles.
    pub(super) fn speculates(&self, job: &GenJob, sampler: &Sampler) -> bool {
        self.engine.speculative() && (sampler.is_greedy() || !job.req.tools_active)
    }

    /// The most tokens a cycle after the token at `pos` may return (`None`: decode it
    /// plainly): `left` more tokens may be emitted, the session has room for
    /// `ctx − pos`, and the session may not pass the next continued-checkpoint position.
    /// Below 2 a cycle would return just the one token a plain step samples.
    pub(super) fn spec_cap(&self, allowed: bool, pos: usize, left: usize) -> Option<usize> {
        if !allowed {
            return None;
        }
        let mut cap = left.min(self.engine.ctx().saturating_sub(pos));
        let step = self.disk.as_ref().map_or(0, |d| d.cfg.continued_step());
        if let Some(q) = pos.checked_div(step) {
            cap = cap.min((q + 1) * step - pos);
        }
        (cap >= 2).then_some(cap)
    }

    /// Keeps the first `keep` tokens of the live session: from the prompt's snapshot when
    /// it is a prefix of them (a copy and a short prefill of the reply), else by a
    /// re-prefill from empty. A failure leaves an empty session (consistent; the next
    /// request prefills).
    pub(super) fn rewind_to(&mut self, keep: usize, job: &GenJob) {
        let t = Instant::now();
        self.shared.metrics.mtp_rewinds.fetch_add(1, Relaxed);
        let tokens = self.engine.tokens()[..keep].to_vec();
        let from_snap = self.snap.as_ref().filter(|s| {
            let st = s.tokens();
            !st.is_empty() && tokens.starts_with(st)
        });
        let copy = from_snap.map(|s| s.snapshot());
        match copy {
            Some(Ok(c)) => self.engine = c,
            Some(Err(e)) => {
                log!("kv cache: cannot restore the snapshot: {e}");
                self.snap = None;
                self.engine.reset();
            }
            None => self.engine.reset(),
        }
        let from = self.engine.tokens().len();
        for c in tokens[from..].chunks(self.prefill_step().max(1)) {
            if let Err(e) = self.engine.prefill(c) {
                log!("request {}: mtp: cannot rewind the session: {e}", job.id);
                self.engine.reset();
                return;
            }
        }
        log!(
            "request {}: mtp: the reply ended inside a speculative cycle; session rewound to {keep} tokens ({} re-evaluated) in {} ms",
            job.id,
            keep - from,
            t.elapsed().as_millis()
        );
    }
}
