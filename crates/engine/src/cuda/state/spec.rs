//! A greedy speculative cycle on the device (`Backend::greedy_cycle`, issue #20): the
//! MTP drafts end with `draft_pick`, which writes each drafted token (the argmax, or
//! the host's override) into the next chained draft's step buffer and into the verify
//! step's records; the verify step ends with `rows_pick`. The host launches the drafts
//! and the verify back to back and waits once, reading a few integers from mapped
//! memory: no logits cross to the host, and the GPU does not wait between the drafts
//! and the verify (it did for the draft logits' download, the host's scans and the
//! verify's upload and launch). With the confidence gate on, the host reads each
//! draft's top-2 gap before launching more (a wait, but still no logits).

use ds4_cuda::{SpecRing, TokenEvent};

use super::rows::RowStep;
use super::DeviceState;
use crate::backend::{CyclePicks, GreedyCycle, HcSource};
use crate::cuda::weights::{CudaMtpWeights, CudaWeights};
use crate::error::{EngineError, Result};
use crate::ops::linear::Numerics;

/// A session's cycle machinery, allocated by its first greedy cycle.
pub(in crate::cuda) struct SpecDev {
    ring: SpecRing,
    event: TokenEvent,
}

impl DeviceState {
    /// The device's [`crate::dev::Backend::greedy_cycle`]: the drafts in the block's
    /// numerics `mtp_numerics`, the verify in `numerics`. The step stays pending.
    pub fn greedy_cycle(
        &mut self,
        w: &CudaWeights,
        mw: &CudaMtpWeights,
        (numerics, mtp_numerics): (Numerics, Numerics),
        c: GreedyCycle<'_>,
    ) -> Result<CyclePicks> {
        let g = &*w.gpu;
        if self.rows.is_none() {
            self.rows = Some(RowStep::new(self, w)?);
        }
        if self.spec.is_none() {
            self.spec = Some(SpecDev {
                ring: g.spec_ring()?,
                event: g.token_event()?,
            });
        }
        let sd = self.spec.take().expect("allocated above");
        let result = self.cycle_with(w, mw, (numerics, mtp_numerics), c, &sd);
        self.spec = Some(sd);
        result
    }

    fn cycle_with(
        &mut self,
        w: &CudaWeights,
        mw: &CudaMtpWeights,
        (numerics, mtp_numerics): (Numerics, Numerics),
        c: GreedyCycle<'_>,
        sd: &SpecDev,
    ) -> Result<CyclePicks> {
        let g = &*w.gpu;
        let n = self.n_tokens;
        // The verify's records: row 0 the cycle's token; the drafts' picks fill the
        // other rows' tokens.
        let rs = self.rows.as_mut().expect("allocated by the caller");
        rs.write_records(w, n, &vec![c.token; c.drafts + 1])?;
        let records = rs.records(w);
        let mut out = CyclePicks::default();
        let mut verified = c.drafts;
        for i in 0..c.drafts {
            let pos = n + i;
            let proposed = (c.propose)(pos + 1);
            sd.ring.set_override(pos, proposed);
            let src = if i == 0 {
                HcSource::Last
            } else {
                HcSource::Chain
            };
            let token = (i == 0).then_some(c.token);
            let pick = Some((records, &sd.ring));
            self.mtp_draft_launch(w, mw, mtp_numerics, (token, src, pos), pick)?;
            out.runs += 1;
            if c.margin > 0.0 {
                // The gate decides whether to verify this draft: read its gap first.
                sd.event.record(g)?;
                sd.event.wait()?;
                let d = sd.ring.draft(pos);
                if d.margin < c.margin {
                    verified = i;
                    break;
                }
                if c.stop.contains(&d.token) {
                    verified = i + 1;
                    break;
                }
            } else if proposed.is_some_and(|t| c.stop.contains(&t)) {
                verified = i + 1;
                break;
            }
            // Unknown picks that are stop tokens are verified past: never accepted.
        }
        if verified == 0 {
            return Ok(out);
        }
        self.step_rows_picks(w, numerics, verified + 1, &sd.ring)?;
        sd.event.record(g)?;
        sd.event.wait()?;
        out.drafts = (0..verified).map(|i| sd.ring.draft(n + i).token).collect();
        let mut nan = false;
        out.picks = (0..=verified)
            .map(|r| {
                let (t, bad) = sd.ring.row(r);
                nan |= bad;
                t
            })
            .collect();
        if nan {
            // Keep nothing, as a host verify does on NaN logits.
            let _ = self.commit_rows(w, numerics, 0);
            return Err(EngineError::nan_logits());
        }
        Ok(out)
    }

    /// The logits row the last commit of a greedy cycle's step kept.
    pub fn kept_logits(&self, w: &CudaWeights) -> Result<Vec<f32>> {
        match &self.rows {
            Some(rs) => rs.kept_logits(w),
            None => Err(EngineError::Invalid("no multi-row step has run".into())),
        }
    }
}
