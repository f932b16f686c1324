//! A backend's MTP draft state on the host (the CPU backend's [`Backend::mtp_draft`],
//! [`Backend::mtp_mark`] and [`Backend::mtp_keep`]): the block's raw KV ring, the
//! chained HC state of the last draft, and the undo record of the drafts of the
//! current cycle.
//!
//! A speculative cycle drafts `k` tokens, each pushing one ring row, then verifies
//! them; rows for rejected positions must go. The mark saves the ring position and the
//! slots the next pushes will overwrite (O(drafts), like a multi-row step's undo
//! record); `keep(n)` rewinds to the mark and pushes back the first `n` rows drafted
//! since, so the ring is exactly the one that drafted only those.
//!
//! [`Backend::mtp_draft`]: crate::backend::Backend::mtp_draft
//! [`Backend::mtp_mark`]: crate::backend::Backend::mtp_mark
//! [`Backend::mtp_keep`]: crate::backend::Backend::mtp_keep

use crate::backend::MAX_ROWS;
use crate::error::{EngineError, Result};
use crate::kv::RawMark;
use crate::mtp::{Mtp, MtpState};

/// Most drafts between a mark and its keep: one multi-row step's worth.
const MAX_MARKED: usize = MAX_ROWS;

#[derive(Clone, Debug, Default)]
pub(crate) struct DraftRing {
    /// Created on the first draft (it needs the block's dimensions).
    state: Option<MtpState>,
    /// The last draft's output HC state ([`crate::backend::HcSource::Chain`]).
    chain: Option<Vec<f32>>,
    /// The ring before this cycle's drafts (`None`: there was no ring yet), and the
    /// rows pushed since, in order.
    mark: Option<(Option<RawMark>, Vec<f32>)>,
}

impl DraftRing {
    /// Drafts from `token` at `pos` with incoming HC state `g` (`None`: the chained
    /// state of the previous draft).
    pub fn draft(
        &mut self,
        mtp: &Mtp,
        token: u32,
        g: Option<&[f32]>,
        pos: usize,
    ) -> Result<Vec<f32>> {
        if let Some((_, pushed)) = &self.mark {
            let hd = mtp.main().config().head_dim;
            if pushed.len() / hd >= MAX_MARKED {
                return Err(EngineError::Invalid(format!(
                    "at most {MAX_MARKED} MTP drafts fit between mtp_mark and mtp_keep"
                )));
            }
        }
        let chain = self.chain.take();
        let g = match (g, &chain) {
            (Some(g), _) => g,
            (None, Some(c)) => c.as_slice(),
            (None, None) => {
                return Err(EngineError::Invalid(
                    "a chained MTP draft needs a previous draft".into(),
                ))
            }
        };
        let state = self.state.get_or_insert_with(|| mtp.new_state());
        let d = match mtp.draft(state, token, g, pos) {
            Ok(d) => d,
            Err(e) => {
                // Nothing was pushed (the input checks come first): keep the chain.
                self.chain = chain;
                return Err(e);
            }
        };
        if let Some((_, pushed)) = &mut self.mark {
            let l = state.layer();
            pushed.extend_from_slice(l.raw_row(l.n_raw() - 1));
        }
        self.chain = Some(d.hc);
        Ok(d.logits)
    }

    /// Marks the ring before a cycle's drafts (a mark not kept is dropped: its rows stay).
    pub fn mark(&mut self) {
        let ring = self
            .state
            .as_ref()
            .map(|s| s.layer_ref().raw_mark(MAX_MARKED));
        self.mark = Some((ring, Vec::new()));
    }

    /// Keeps the first `n` rows pushed since the mark and rewinds the rest. Without a
    /// mark only `n == 0` is valid (a no-op).
    pub fn keep(&mut self, n: usize) -> Result<()> {
        let pushed = self.mark.as_ref().map_or(0, |(_, rows)| rows.len());
        let hd = self.state.as_ref().map_or(1, |s| s.layer_ref().head_dim);
        if n > pushed / hd {
            return Err(EngineError::Invalid(format!(
                "cannot keep {n} MTP drafts: {} ran since mtp_mark",
                pushed / hd
            )));
        }
        let (Some((before, rows)), Some(state)) = (self.mark.take(), self.state.as_mut()) else {
            // No mark, or no draft since it (the ring did not exist yet).
            return Ok(());
        };
        match &before {
            Some(m) => state.layer().raw_rewind(m),
            None => state.reset(),
        }
        for row in rows.chunks_exact(hd).take(n) {
            state.layer().push_raw(row);
        }
        Ok(())
    }

    /// Forgets the ring, the chain and the mark (a session reset or import).
    pub fn clear(&mut self) {
        *self = DraftRing::default();
    }

    /// The ring (tests).
    pub fn state(&self) -> Option<&MtpState> {
        self.state.as_ref()
    }
}
