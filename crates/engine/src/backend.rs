//! The boundary between a session and the device that runs the forward pass.
//!
//! A backend owns its KV state (a GPU keeps it in device memory) and exposes it in
//! the host form [`KvCache`] only for snapshots and payloads, so the payload layout
//! is the same on every backend.

use crate::error::{EngineError, Result};
use crate::imatrix::MoeObserver;
use crate::kv::KvCache;
use crate::mtp::Mtp;
use crate::sampling::{argmax_skip, Sampler};
use crate::session::check_logits;

/// Which logits rows a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    None,
    /// The last token's row only (prefill, decode).
    Last,
    /// One row per token (scoring, tests).
    All,
}

impl LogitRows {
    /// Whether token `i` of a forward over `n` tokens returns its logits row (the
    /// CUDA backends' token-by-token loops).
    #[cfg(feature = "cuda")]
    pub(crate) fn wants(self, i: usize, n: usize) -> bool {
        match self {
            LogitRows::None => false,
            LogitRows::Last => i + 1 == n,
            LogitRows::All => true,
        }
    }
}

/// Most rows of one multi-row step ([`Backend::step_rows`]): enough to verify the
/// drafts of multi-token prediction, few enough that the undo record stays small.
pub const MAX_ROWS: usize = 16;

/// Every token inside the vocabulary.
pub(crate) fn check_vocab(tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(&token) => Err(EngineError::BadToken { token, vocab }),
        None => Ok(()),
    }
}

/// [`check_vocab`], then room for the tokens after `have` of `ctx` positions: what a
/// backend checks before it touches its state.
pub(crate) fn check_tokens(tokens: &[u32], vocab: usize, have: usize, ctx: usize) -> Result<()> {
    check_vocab(tokens, vocab)?;
    if have + tokens.len() > ctx {
        return Err(EngineError::ContextFull {
            ctx,
            have,
            adding: tokens.len(),
        });
    }
    Ok(())
}

/// Checks a step's row count.
pub(crate) fn check_rows(n: usize) -> Result<()> {
    if n == 0 || n > MAX_ROWS {
        return Err(EngineError::Invalid(format!(
            "a multi-row step runs 1 to {MAX_ROWS} tokens, not {n}"
        )));
    }
    Ok(())
}

/// `commit_rows` when no step is pending.
pub(crate) fn no_pending(accepted: usize) -> Result<()> {
    if accepted != 0 {
        return Err(EngineError::Invalid(format!(
            "no multi-row step is pending to keep {accepted} rows of"
        )));
    }
    Ok(())
}

/// Checks `accepted` against a pending step of `rows` rows.
pub(crate) fn check_accepted(accepted: usize, rows: usize) -> Result<()> {
    if accepted > rows {
        return Err(EngineError::Invalid(format!(
            "cannot keep {accepted} rows of a {rows}-row step"
        )));
    }
    Ok(())
}

/// The incoming hyper-connection state of an MTP draft ([`Backend::mtp_draft`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HcSource {
    /// The main model's final HC state (`[n_hc][n_embd]`, before the output head) at
    /// the session's last token: after `commit_rows(a)` that is row `a - 1` of the
    /// step, after `forward` its last token. Unavailable (an error) after `reset` and
    /// `import_state`, until the next forward.
    Last,
    /// The output HC state of this backend's previous draft (a chained draft).
    Chain,
}

/// The error of every row of a [`Backend::decode_rows`] call whose token count is not
/// its state count, or `None` when they match.
pub(crate) fn decode_rows_mismatch(states: usize, tokens: usize) -> Option<Vec<Result<Vec<f32>>>> {
    if tokens == states {
        return None;
    }
    let msg = format!("a batched decode of {states} states got {tokens} tokens");
    Some(
        (0..states)
            .map(|_| Err(EngineError::Invalid(msg.clone())))
            .collect(),
    )
}

/// A greedy run's request ([`Backend::greedy_run`], [`crate::Session::greedy_run`]).
pub struct GreedyRun<'a> {
    /// The token decoded first.
    pub first: u32,
    /// Picks delivered at most (≥ 1).
    pub max: usize,
    /// A token never picked (a benchmark's EOS); `None`: plain argmax. Greedy runs only.
    pub skip: Option<u32>,
    /// Sampled picks: each pick is `sampler.sample(logits)` (one draw of its stream a
    /// delivered pick, as the plain loop takes them); `None`: greedy.
    pub sampler: Option<&'a mut Sampler>,
    /// Tokens the context still has room for (≥ 1).
    pub room: usize,
    /// Receives each pick; `false` ends the run.
    pub on_pick: &'a mut dyn FnMut(u32) -> bool,
}

/// A greedy speculative cycle's request ([`Backend::greedy_cycle`]).
pub struct GreedyCycle<'a> {
    pub mtp: &'a Mtp,
    /// The cycle's token: row 0 of the verify step, at position `n_tokens()`.
    pub token: u32,
    /// Drafts to run at most (≥ 1, at most [`MAX_ROWS`] − 1; the caller checked the
    /// context's room for them and the token).
    pub drafts: usize,
    /// The confidence gate (0: off): a draft whose top-1 − top-2 logit gap is below it
    /// ends the drafting and is not verified.
    pub margin: f32,
    /// Per draft, by the position its token would sit at, a token proposed instead of
    /// the draft's argmax (a benchmark's acceptance); `None`: the argmax.
    pub propose: &'a mut dyn FnMut(usize) -> Option<u32>,
    /// A draft proposing one of these ends the drafting after it (a backend may still
    /// verify drafts past it: they are never accepted).
    pub stop: &'a [u32],
}

/// What a greedy speculative cycle ran ([`Backend::greedy_cycle`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CyclePicks {
    /// The verified drafts: rows 1.. of the pending step. Empty when the gate stopped
    /// the first draft: no step ran and the caller decodes the token alone.
    pub drafts: Vec<u32>,
    /// MTP block runs (ring rows pushed since the cycle's [`Backend::mtp_mark`]).
    pub runs: usize,
    /// Each verified row's argmax (`drafts.len() + 1` of them; empty without a step).
    pub picks: Vec<u32>,
    /// Every row's logits (`[rows][vocab]`) when the backend has them on the host;
    /// `None` when they stay on the device (the commit keeps its last row there for
    /// [`Backend::kept_logits`]).
    pub logits: Option<Vec<f32>>,
}

pub trait Backend: Send {
    fn name(&self) -> &str;

    /// Positions held.
    fn n_tokens(&self) -> usize;

    /// Context capacity in tokens.
    fn ctx(&self) -> usize;

    /// Runs `tokens` at positions `n_tokens()..`, appending them to the state, and
    /// returns the requested logits rows (`[rows][vocab]`). Must equal running the
    /// tokens one at a time.
    fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>>;

    /// Greedy decoding (see [`crate::Session::greedy_run`], which checked `run`): decodes
    /// `run.first`, then picks and decodes until a stop. Appends every token it decodes
    /// to `decoded` (also when it fails) and returns the last decoded token's logits.
    ///
    /// Pick `k` (from 1) is delivered to `on_pick`; it is decoded when `k < max` and
    /// the context has room, whatever `on_pick` answers (a pipelined backend has
    /// launched that decode before the host sees the pick); the run ends after a pick
    /// that is not decoded or that `on_pick` refused. The default runs it on the host
    /// with [`Backend::forward`]; the CUDA backend picks on the device, one token ahead.
    /// With `run.sampler` the picks are sampled ([`crate::Session::sample_run`]); the
    /// sampler's stream then advances by one draw a delivered pick.
    fn greedy_run(&mut self, run: GreedyRun<'_>, decoded: &mut Vec<u32>) -> Result<Vec<f32>> {
        let mut logits = self.forward(&[run.first], LogitRows::Last)?;
        decoded.push(run.first);
        check_logits(&logits)?;
        let mut picks = 0;
        let mut sampler = run.sampler;
        loop {
            let pick = match sampler.as_deref_mut() {
                Some(s) => s.sample(&logits),
                None => argmax_skip(&logits, run.skip),
            };
            picks += 1;
            let ahead = picks < run.max && decoded.len() < run.room;
            let go = (run.on_pick)(pick);
            if !ahead {
                return Ok(logits);
            }
            logits = self.forward(&[pick], LogitRows::Last)?;
            decoded.push(pick);
            check_logits(&logits)?;
            if !go {
                return Ok(logits);
            }
        }
    }

    /// [`Backend::forward`] with no logits, handing each layer's routed-expert inputs
    /// to `obs` (imatrix collection, `imatrix.rs`). The state advances as `forward`'s.
    fn forward_observed(&mut self, tokens: &[u32], obs: &mut dyn MoeObserver) -> Result<()> {
        let _ = (tokens, obs);
        Err(EngineError::Invalid(format!(
            "the {} backend cannot observe activations",
            self.name()
        )))
    }

    /// A multi-row step (docs/architecture.md, "Multi-row steps and rollback"): runs
    /// 1..=[`MAX_ROWS`] tokens at positions `n_tokens()..` like
    /// `forward(tokens, LogitRows::All)` — causal among themselves, bit-identical to
    /// decoding them one by one — and keeps an undo record until
    /// [`Backend::commit_rows`]. Meanwhile the state holds every row; any other
    /// state-changing call (`forward`, `step_rows`, `import_state`, `reset`) first
    /// accepts them all. On error the state is unchanged and no step is pending.
    ///
    /// The record belongs to this state (one sequence), so a later batched step over
    /// several sessions' states gives each its own record and accept count.
    fn step_rows(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let _ = tokens;
        Err(EngineError::Invalid(format!(
            "the {} backend has no multi-row steps",
            self.name()
        )))
    }

    /// Keeps the first `accepted` rows of the pending step and drops the record:
    /// the state is then exactly the one that ran only those rows. With no pending
    /// step only `accepted == 0` is valid (a no-op). `accepted` above the step's rows
    /// is an error that changes nothing. If the backend fails while rewinding (a
    /// device error) the state keeps every row, consistent, and the error is returned.
    fn commit_rows(&mut self, accepted: usize) -> Result<()> {
        no_pending(accepted)
    }

    /// Rows of the pending step (0: none).
    fn pending_rows(&self) -> usize {
        0
    }

    /// A greedy speculative cycle (see [`crate::Speculator`]): MTP drafts from
    /// `c.token`, each the argmax of its draft logits unless `c.propose` gives a token,
    /// until the gate or a stop token ends them, then `c.token` and the drafts in one
    /// multi-row step left pending (as [`Backend::step_rows`]) with every row's argmax.
    /// A NaN in a verified row is an error that keeps no row. The default runs it with
    /// [`Backend::mtp_draft`] and [`Backend::step_rows`] on the host; the CUDA backend
    /// picks on the device, so the logits never cross to the host and the verify
    /// follows the drafts without a round trip.
    fn greedy_cycle(&mut self, c: GreedyCycle<'_>) -> Result<CyclePicks> {
        let n = self.n_tokens();
        let mut out = CyclePicks::default();
        let mut prev = c.token;
        for i in 0..c.drafts {
            let src = if i == 0 {
                HcSource::Last
            } else {
                HcSource::Chain
            };
            let logits = self.mtp_draft(c.mtp, prev, src, n + i)?;
            out.runs += 1;
            if c.margin > 0.0 && crate::spec::top2_margin(&logits) < c.margin {
                break;
            }
            let d = (c.propose)(n + i + 1).unwrap_or_else(|| argmax_skip(&logits, None));
            out.drafts.push(d);
            if c.stop.contains(&d) {
                break;
            }
            prev = d;
        }
        if out.drafts.is_empty() {
            return Ok(out);
        }
        let mut rows_in = Vec::with_capacity(out.drafts.len() + 1);
        rows_in.push(c.token);
        rows_in.extend_from_slice(&out.drafts);
        let rows = self.step_rows(&rows_in)?;
        if let Err(e) = check_logits(&rows) {
            // Keep nothing; a failed rewind keeps every row (consistent), still an error.
            let _ = self.commit_rows(0);
            return Err(e);
        }
        let vocab = rows.len() / rows_in.len();
        out.picks = rows.chunks(vocab).map(|r| argmax_skip(r, None)).collect();
        out.logits = Some(rows);
        Ok(out)
    }

    /// The logits row a [`Backend::commit_rows`] of a [`Backend::greedy_cycle`] step
    /// kept on the device (the last kept row's; `CyclePicks::logits` was `None`),
    /// valid until the next such commit. The default has none to give.
    fn kept_logits(&self) -> Result<Vec<f32>> {
        Err(EngineError::Invalid(format!(
            "the {} backend keeps no logits on a device",
            self.name()
        )))
    }

    /// The state in host form (a device backend copies it back, which can fail).
    fn export_state(&self) -> Result<KvCache>;

    /// Replaces the state.
    fn import_state(&mut self, state: KvCache) -> Result<()>;

    /// Forgets every position.
    fn reset(&mut self);

    /// An independent copy of the whole state (a device backend allocates a second
    /// state, which can run out of memory).
    fn try_clone_box(&self) -> Result<Box<dyn Backend>>;

    /// Runs the MTP block (docs/architecture.md §3.1) on `token` at position `pos` with
    /// the incoming state `src`, pushes the block's raw KV row into this backend's MTP
    /// ring and returns the draft logits (`[vocab]`). The ring and the chained state
    /// belong to the backend (on a GPU they stay in device memory); they are never
    /// part of [`Backend::export_state`], and `reset`/`import_state` empty the ring.
    fn mtp_draft(&mut self, mtp: &Mtp, token: u32, src: HcSource, pos: usize) -> Result<Vec<f32>> {
        let _ = (mtp, token, src, pos);
        Err(EngineError::Invalid(format!(
            "the {} backend cannot run the MTP draft block",
            self.name()
        )))
    }

    /// Marks the MTP ring before a cycle's drafts (see [`Backend::mtp_keep`]).
    fn mtp_mark(&mut self) {}

    /// Keeps the first `n` ring rows pushed since [`Backend::mtp_mark`] and rewinds the
    /// rest, restoring the rows they overwrote (the drafts of rejected positions).
    fn mtp_keep(&mut self, n: usize) -> Result<()> {
        let _ = n;
        Ok(())
    }

    /// One decode token for each of several sequences' states (docs/architecture.md
    /// §2, "batched decode"; issue #21): `self` runs `tokens[0]` and `others[i]` runs
    /// `tokens[i + 1]`, each at its own next position against its own KV state. Every
    /// row's result is its own: `Ok(logits)` (`[vocab]`, the last-token row) or the
    /// error of that row alone, whose state is then unchanged; the other rows go on.
    /// Each row must equal `forward(&[token], LogitRows::Last)` on that state.
    ///
    /// The default runs the rows one after another (one pass over the weights per
    /// row), so it gives the one-at-a-time tokens by construction. A device backend
    /// overrides it with one pass over the weights for all rows (the CUDA backend's
    /// batched step); all states belong to one engine (same model, same device).
    fn decode_rows(
        &mut self,
        others: &mut [&mut dyn Backend],
        tokens: &[u32],
    ) -> Vec<Result<Vec<f32>>> {
        if let Some(err) = decode_rows_mismatch(others.len() + 1, tokens.len()) {
            return err;
        }
        let mut out = Vec::with_capacity(tokens.len());
        out.push(self.forward(&tokens[..1], LogitRows::Last));
        for (b, t) in others.iter_mut().zip(&tokens[1..]) {
            out.push(b.forward(std::slice::from_ref(t), LogitRows::Last));
        }
        out
    }

    /// The backend as `Any`, for a batched step that must find its own kind among the
    /// `others` of [`Backend::decode_rows`]; `None` where no override needs it.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// [`Backend::as_any`], mutable.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }

    /// Bytes of KV state held now, when the backend can tell without copying it
    /// (`ds4-server`'s `/metrics`); `None` by default.
    fn kv_bytes(&self) -> Option<u64> {
        None
    }

    /// On a device: (free device bytes now, bytes one more session of this context
    /// takes there) — what sizes `ds4-server`'s session pool. `None` where sessions live
    /// in host memory.
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }

    /// Tokens per `forward` call that keep this backend efficient: callers that split
    /// a prompt (for progress or cancellation) should not pass fewer.
    fn preferred_batch(&self) -> usize {
        512
    }

    /// Steers the later forward passes (`crate::steer`; `None` or zero scales: off).
    fn set_steering(
        &mut self,
        steering: Option<std::sync::Arc<crate::steer::Steering>>,
    ) -> Result<()> {
        match steering {
            Some(s) if s.active() => Err(EngineError::Invalid(format!(
                "the {} backend cannot steer",
                self.name()
            ))),
            _ => Ok(()),
        }
    }
}
