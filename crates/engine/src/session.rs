//! A generation session: token history, current logits and a backend holding the state.

use std::sync::Arc;

use crate::backend::{
    check_accepted, check_rows, check_vocab, no_pending, Backend, CyclePicks, GreedyCycle,
    GreedyRun, HcSource, LogitRows,
};
use crate::cpu::CpuBackend;
use crate::error::{EngineError, Result};
use crate::imatrix::MoeObserver;
use crate::kv::KvCache;
use crate::model::Model;
use crate::mtp::Mtp;
use crate::ops::linear::Numerics;
use crate::sampling::Sampler;

pub(crate) fn check_ctx(ctx: usize) -> Result<()> {
    if ctx == 0 {
        return Err(EngineError::Invalid(
            "context must hold at least one token".into(),
        ));
    }
    Ok(())
}

/// Tokens per forward call of a CPU session's prefill ([`SessionOptions::prefill_chunk`]).
pub const DEFAULT_PREFILL_CHUNK: usize = 2048;

#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Context capacity in tokens.
    pub ctx: usize,
    /// `None`: the model's default.
    pub numerics: Option<Numerics>,
    /// Tokens per forward call during prefill (results do not depend on it); `None`:
    /// the backend's preferred batch (CPU DEFAULT_PREFILL_CHUNK, CUDA its prefill chunk).
    pub prefill_chunk: Option<usize>,
}

impl SessionOptions {
    pub fn new(ctx: usize) -> SessionOptions {
        SessionOptions {
            ctx,
            numerics: None,
            prefill_chunk: None,
        }
    }
}

/// One sequence's state on the engine's backend: token history, the logits after the
/// last token, and the KV state (in device memory on a GPU backend).
///
/// Sessions are not `Clone`: copying a GPU state allocates device memory, which can
/// fail, so [`Session::try_clone`] returns a `Result`.
pub struct Session {
    model: Model,
    backend: Box<dyn Backend>,
    tokens: Vec<u32>,
    logits: Logits,
    numerics: Numerics,
    prefill_chunk: usize,
    /// The multi-row step awaiting [`Session::commit_rows`].
    pending: Option<PendingRows>,
    /// Whether the backend holds the main model's final HC state of the last token
    /// ([`HcSource::Last`]): set by every forward, cleared where a backend may have
    /// none (reset, imports, payload loads).
    hc_ready: bool,
}

/// The logits after the last token: on the host, or kept on the device by a greedy
/// speculative cycle's commit ([`Backend::kept_logits`]) and fetched by the first
/// read — a speculative loop reads none of them, and each fetch is a 517 KB download.
#[derive(Debug)]
enum Logits {
    Host(Vec<f32>),
    Kept(std::sync::OnceLock<Vec<f32>>),
}

impl Logits {
    const NONE: Logits = Logits::Host(Vec::new());
}

impl Session {
    /// The logits as a host vector (a kept row is fetched; a failed fetch is empty).
    fn logits_vec(&self) -> Vec<f32> {
        self.logits().to_vec()
    }

    /// The logits on the host, fetched now if kept on the device.
    fn logits_host(&mut self) -> &mut Vec<f32> {
        if matches!(self.logits, Logits::Kept(_)) {
            self.logits = Logits::Host(self.logits_vec());
        }
        match &mut self.logits {
            Logits::Host(v) => v,
            Logits::Kept(_) => unreachable!("fetched above"),
        }
    }
}

/// A multi-row step between [`Session::step_rows`] and [`Session::commit_rows`].
struct PendingRows {
    /// Tokens held before the step.
    n_before: usize,
    /// The session's logits before the step (restored when no row is kept).
    logits_before: Logits,
    /// Every row's logits, `[rows][vocab]`; empty when they stayed on the device (a
    /// greedy cycle: [`Backend::row_logits`] fetches the kept row).
    rows: Vec<f32>,
    /// The step's rows.
    n_rows: usize,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("backend", &self.backend.name())
            .field("ctx", &self.backend.ctx())
            .field("n_tokens", &self.tokens.len())
            .field("numerics", &self.numerics)
            .finish()
    }
}

/// A session's whole state in host memory, from [`Session::export_state`]: it can be
/// imported into any session of the same model and context size, on any backend.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionState {
    kv: KvCache,
    tokens: Vec<u32>,
    logits: Vec<f32>,
}

impl SessionState {
    /// The tokens the state holds.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The context size of the session it came from.
    pub fn ctx(&self) -> usize {
        self.kv.ctx
    }
}

impl Session {
    /// Most tokens of one [`Session::step_rows`].
    pub const MAX_STEP_ROWS: usize = crate::backend::MAX_ROWS;

    /// A CPU session (in `pool`, or rayon's global pool).
    pub(crate) fn cpu(
        model: &Model,
        opts: SessionOptions,
        pool: Option<Arc<rayon::ThreadPool>>,
    ) -> Result<Session> {
        check_ctx(opts.ctx)?;
        let numerics = opts.numerics.unwrap_or(model.numerics());
        let backend = Box::new(CpuBackend::new(model, opts.ctx, numerics).with_pool(pool));
        Ok(Session::on_backend(
            model,
            backend,
            numerics,
            opts.prefill_chunk.unwrap_or(DEFAULT_PREFILL_CHUNK),
        ))
    }

    /// A session on another backend (which must start empty).
    pub(crate) fn on_backend(
        model: &Model,
        backend: Box<dyn Backend>,
        numerics: Numerics,
        prefill_chunk: usize,
    ) -> Session {
        Session {
            model: model.clone(),
            backend,
            tokens: Vec::new(),
            logits: Logits::NONE,
            numerics,
            prefill_chunk: prefill_chunk.max(1),
            pending: None,
            hc_ready: false,
        }
    }

    /// An independent copy of the whole state (a snapshot to rewind to). On a GPU
    /// this allocates a second device state and fails when memory runs out. The copy
    /// has no pending multi-row step: it holds every row of one.
    pub fn try_clone(&self) -> Result<Session> {
        Ok(Session {
            model: self.model.clone(),
            backend: self.backend.try_clone_box()?,
            tokens: self.tokens.clone(),
            logits: Logits::Host(self.logits_vec()),
            numerics: self.numerics,
            prefill_chunk: self.prefill_chunk,
            pending: None,
            // A backend copies its whole state, the HC state of the last token included.
            hc_ready: self.hc_ready,
        })
    }

    /// The whole state in host memory.
    pub fn export_state(&self) -> Result<SessionState> {
        Ok(SessionState {
            kv: self.backend.export_state()?,
            tokens: self.tokens.clone(),
            logits: self.logits_vec(),
        })
    }

    /// Replaces the state with one exported from a session of the same model and
    /// context size (on any backend).
    pub fn import_state(&mut self, state: SessionState) -> Result<()> {
        let cfg = self.model.config();
        if state.kv.ctx != self.ctx() {
            return Err(EngineError::Payload(format!(
                "a state of a {}-token context does not fit a session of {}",
                state.kv.ctx,
                self.ctx()
            )));
        }
        let fits = state.kv.layers.len() == cfg.n_layer
            && state.kv.n_tokens == state.tokens.len()
            && (state.logits.is_empty() || state.logits.len() == cfg.vocab)
            && state
                .kv
                .layers
                .iter()
                .zip(&cfg.compress_ratios)
                .all(|(l, &r)| l.ratio == r && l.head_dim == cfg.head_dim);
        if !fits {
            return Err(EngineError::Payload(
                "the state does not match this model's dimensions".into(),
            ));
        }
        self.accept_pending();
        self.hc_ready = false;
        self.backend.import_state(state.kv)?;
        self.tokens = state.tokens;
        self.logits = Logits::Host(state.logits);
        Ok(())
    }

    pub(crate) fn model_ref(&self) -> &Model {
        &self.model
    }

    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn ctx(&self) -> usize {
        self.backend.ctx()
    }

    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Logits after the last token (empty before the first).
    pub fn logits(&self) -> &[f32] {
        match &self.logits {
            Logits::Host(v) => v,
            Logits::Kept(cell) => cell.get_or_init(|| {
                self.backend.kept_logits().unwrap_or_else(|e| {
                    tracing::error!("the logits kept on the device could not be read: {e}");
                    Vec::new()
                })
            }),
        }
    }

    pub(crate) fn backend_ref(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// The backend's name (`cpu`, `cuda`).
    pub fn backend_name(&self) -> &str {
        self.backend.name()
    }

    /// Tokens per `prefill` call that keep the backend efficient: callers that split
    /// a prompt (for progress or cancellation) should not pass fewer.
    pub fn preferred_batch(&self) -> usize {
        self.backend.preferred_batch()
    }

    /// Bytes of KV state this session holds, when its backend can tell without a copy
    /// (the CPU backend; `None` elsewhere).
    pub fn kv_bytes(&self) -> Option<u64> {
        self.backend.kv_bytes()
    }

    /// (free device bytes, bytes of one more session like this one) on a GPU backend;
    /// `None` on the CPU. `ds4-server` sizes its session pool from it.
    pub fn device_memory(&self) -> Option<(u64, u64)> {
        self.backend.device_memory()
    }

    /// Logits per token (the vocabulary size).
    pub fn vocab(&self) -> usize {
        self.model.config().vocab
    }

    fn check_room(&self, adding: usize) -> Result<()> {
        if self.tokens.len() + adding > self.ctx() {
            return Err(EngineError::ContextFull {
                ctx: self.ctx(),
                have: self.tokens.len(),
                adding,
            });
        }
        Ok(())
    }

    /// Appends `tokens` in chunks of `prefill_chunk`; keeps the last token's logits.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.check_room(tokens.len())?;
        self.accept_pending();
        let chunks: Vec<&[u32]> = tokens.chunks(self.prefill_chunk).collect();
        for (i, c) in chunks.iter().enumerate() {
            let rows = if i + 1 == chunks.len() {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            let l = self.backend.forward(c, rows)?;
            check_logits(&l)?;
            self.hc_ready = true;
            self.tokens.extend_from_slice(c);
            if !l.is_empty() {
                self.logits = Logits::Host(l);
            }
        }
        Ok(())
    }

    /// Appends `tokens` like [`Session::prefill`] but computes no logits (the session's
    /// last logits are cleared) and hands each chunk's routed-expert inputs, layer by
    /// layer, to `obs` (imatrix collection: [`crate::ImatrixCollector`]). The CPU
    /// backend only; the same math as `prefill`.
    pub fn prefill_observed(&mut self, tokens: &[u32], obs: &mut dyn MoeObserver) -> Result<()> {
        self.check_room(tokens.len())?;
        self.accept_pending();
        for c in tokens.chunks(self.prefill_chunk) {
            self.backend.forward_observed(c, obs)?;
            self.hc_ready = true;
            self.tokens.extend_from_slice(c);
        }
        self.logits = Logits::NONE;
        Ok(())
    }

    /// Appends `tokens` and returns the logits after each of them (`[n][vocab]`).
    pub fn prefill_all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_room(tokens.len())?;
        self.accept_pending();
        let vocab = self.model.config().vocab;
        let mut all = Vec::with_capacity(tokens.len() * vocab);
        for c in tokens.chunks(self.prefill_chunk) {
            let l = self.backend.forward(c, LogitRows::All)?;
            self.hc_ready = true;
            self.tokens.extend_from_slice(c);
            all.extend_from_slice(&l);
        }
        if !tokens.is_empty() {
            self.logits = Logits::Host(all[all.len() - vocab..].to_vec());
        }
        Ok(all)
    }

    /// Appends one token; returns its logits.
    pub fn decode(&mut self, token: u32) -> Result<&[f32]> {
        self.check_room(1)?;
        self.accept_pending();
        let logits = self.backend.forward(&[token], LogitRows::Last)?;
        check_logits(&logits)?;
        self.hc_ready = true;
        self.logits = Logits::Host(logits);
        self.tokens.push(token);
        Ok(self.logits())
    }

    /// Greedy decoding from `first` (the token after the session's last, e.g. the
    /// argmax of [`Session::logits`]): decodes it, then hands each greedy pick (the
    /// first maximum of the logits, `skip` left out) to `on_pick` and decodes it, until
    /// `on_pick` returns `false`, `max` picks were delivered, or the context is full.
    /// The picks are the tokens of the loop `decode(t); t = argmax(logits())`; on the
    /// CUDA backend they are made on the device and the next token's pass is launched
    /// before the host sees the pick, so the GPU never waits for the host.
    ///
    /// Which picks are decoded: every pick but one that ends the run by `max` or a full
    /// context. A pick `on_pick` refused is decoded too (the device had launched it),
    /// so after a run that a stop token ended, the session holds that token (the
    /// chat's end-of-turn, which the next turn's prompt repeats). [`Session::tokens`]
    /// and [`Session::logits`] then describe the session as usual; after an error,
    /// `tokens` holds every token that was decoded. `max` = 0 does nothing.
    pub fn greedy_run(
        &mut self,
        first: u32,
        max: usize,
        skip: Option<u32>,
        on_pick: &mut dyn FnMut(u32) -> bool,
    ) -> Result<()> {
        self.pick_run(first, max, skip, None, on_pick)
    }

    /// [`Session::greedy_run`] with sampled picks: each pick is
    /// `sampler.sample(logits())` of the token before it, so the tokens (and the
    /// sampler's stream afterwards: one draw a delivered pick) are the plain loop's
    /// `decode(t); t = sampler.sample(logits())`. On the CUDA backend the device samples
    /// (the same integer-weight definition, `sampling/fixed.rs`, with the host's draws)
    /// and the next token's pass is launched before the host sees the pick. A greedy
    /// sampler (temperature ≤ 0) picks the argmax, as `sample` does.
    pub fn sample_run(
        &mut self,
        first: u32,
        max: usize,
        sampler: &mut Sampler,
        on_pick: &mut dyn FnMut(u32) -> bool,
    ) -> Result<()> {
        if sampler.is_greedy() {
            return self.pick_run(first, max, None, None, on_pick);
        }
        self.pick_run(first, max, None, Some(sampler), on_pick)
    }

    fn pick_run(
        &mut self,
        first: u32,
        max: usize,
        skip: Option<u32>,
        sampler: Option<&mut Sampler>,
        on_pick: &mut dyn FnMut(u32) -> bool,
    ) -> Result<()> {
        if max == 0 {
            return Ok(());
        }
        self.check_room(1)?;
        check_vocab(&[first], self.vocab())?;
        self.accept_pending();
        let run = GreedyRun {
            first,
            max,
            skip,
            sampler,
            room: self.ctx() - self.tokens.len(),
            on_pick,
        };
        let mut decoded = Vec::new();
        let logits = self.backend.greedy_run(run, &mut decoded);
        if !decoded.is_empty() {
            self.hc_ready = true;
        }
        self.tokens.extend_from_slice(&decoded);
        self.logits = Logits::Host(logits?);
        Ok(())
    }

    /// One decode token for each of several sessions of one engine (issue #21,
    /// continuous batching in the server): `rows[i].0` decodes `rows[i].1` at its own
    /// next position against its own KV, as [`Session::decode`] would; each session's
    /// [`Session::logits`] are then its next-token logits. Results are per row: a row
    /// that fails (a full context, a bad token, NaN logits) is unchanged and the others
    /// still advance. The tokens equal decoding each session alone (the default
    /// [`Backend::decode_rows`] runs them in turn; a device backend may run all rows in
    /// one pass over the weights).
    pub fn decode_batch(rows: &mut [(&mut Session, u32)]) -> Vec<Result<()>> {
        let mut out: Vec<Result<()>> = rows
            .iter()
            .map(|(s, t)| {
                s.check_room(1)?;
                check_vocab(std::slice::from_ref(t), s.vocab())
            })
            .collect();
        let mut live: Vec<usize> = (0..rows.len()).filter(|&i| out[i].is_ok()).collect();
        for &i in &live {
            rows[i].0.accept_pending();
        }
        let tokens: Vec<u32> = live.iter().map(|&i| rows[i].1).collect();
        let mut backends: Vec<&mut dyn Backend> = Vec::with_capacity(live.len());
        let mut want = live.iter().copied().peekable();
        for (i, (s, _)) in rows.iter_mut().enumerate() {
            if want.peek() == Some(&i) {
                want.next();
                backends.push(s.backend.as_mut());
            }
        }
        let results = match backends.split_first_mut() {
            Some((first, rest)) => first.decode_rows(rest, &tokens),
            None => Vec::new(),
        };
        drop(backends);
        for (i, r) in live.drain(..).zip(results) {
            let (s, t) = &mut rows[i];
            out[i] = r.and_then(|logits| {
                check_logits(&logits)?;
                s.hc_ready = true;
                s.logits = Logits::Host(logits);
                s.tokens.push(*t);
                Ok(())
            });
        }
        out
    }

    /// Keeps the first `n` tokens. Within a pending multi-row step this is
    /// [`Session::commit_rows`] (exact and cheap). Otherwise the compressed/windowed
    /// state cannot be rewound in place (the raw ring and the compressor frontiers
    /// have dropped older data), so this re-runs the kept prefix from an empty state;
    /// it is a no-op when `n` is the current length. Callers that rewind often should
    /// keep `try_clone()` snapshots.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n >= self.tokens.len() {
            return Ok(());
        }
        if let Some(p) = &self.pending {
            if n >= p.n_before {
                return self.commit_rows(n - p.n_before);
            }
        }
        let keep = self.tokens[..n].to_vec();
        self.reset();
        self.prefill(&keep)
    }

    /// A multi-row step (docs/architecture.md, "Multi-row steps and rollback"): runs
    /// 1..=[`Session::MAX_STEP_ROWS`] tokens at the next positions in one
    /// pass over the weights, causal among themselves, and returns every row's logits
    /// (`[rows][vocab]`; row `i` is what decoding `tokens[..=i]` one by one would give).
    ///
    /// The session then holds all the rows (tokens, logits of the last row) with an
    /// undo record: [`Session::commit_rows`]`(a)` keeps the first `a` and leaves the
    /// session exactly as if only those had been decoded. A caller that never commits
    /// keeps every row: `decode`, `prefill`, `step_rows`, `import_state`, `reset` and
    /// payload loads accept a pending step first, and a `try_clone` copy holds all its
    /// rows. Invalid input (no or too many rows, a full context, a bad token) changes
    /// nothing and leaves a pending step pending; a backend error (device memory)
    /// leaves the earlier step accepted and no new one.
    pub fn step_rows(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        check_rows(tokens.len())?;
        self.check_room(tokens.len())?;
        let vocab = self.vocab();
        check_vocab(tokens, vocab)?;
        self.accept_pending();
        let rows = self.backend.step_rows(tokens)?;
        if let Err(e) = check_logits(&rows) {
            // NaN logits: keep nothing (a failed rewind leaves every row, consistent).
            if self.backend.commit_rows(0).is_err() {
                self.tokens.extend_from_slice(tokens);
                self.logits = Logits::Host(rows[rows.len() - self.vocab()..].to_vec());
            }
            return Err(e);
        }
        self.hold_rows(tokens, rows);
        Ok(&self.pending.as_ref().expect("just set").rows)
    }

    /// The session after a multi-row step over `tokens` that the backend left pending:
    /// it holds them, with the last row's logits (`rows`, `[tokens][vocab]`, or empty
    /// when they stayed on the device: then unknown on the host until the commit) and
    /// the record [`Session::commit_rows`] rewinds to.
    fn hold_rows(&mut self, tokens: &[u32], rows: Vec<f32>) {
        self.hc_ready = true;
        let vocab = self.vocab();
        let last = if rows.is_empty() {
            Logits::NONE
        } else {
            Logits::Host(rows[rows.len() - vocab..].to_vec())
        };
        self.pending = Some(PendingRows {
            n_before: self.tokens.len(),
            logits_before: std::mem::replace(&mut self.logits, last),
            n_rows: tokens.len(),
            rows,
        });
        self.tokens.extend_from_slice(tokens);
    }

    /// Keeps the first `accepted` rows of the pending [`Session::step_rows`]: tokens,
    /// KV state and logits (row `accepted − 1`'s, or the logits from before the step
    /// when `accepted` is 0) are then those of a session that decoded only them.
    /// Without a pending step only `accepted == 0` is valid (a no-op); more rows than
    /// the step ran is an error that changes nothing. If the backend fails to rewind
    /// (a device error) the session keeps every row, consistent, and returns the error.
    pub fn commit_rows(&mut self, accepted: usize) -> Result<()> {
        let Some(p) = &self.pending else {
            return no_pending(accepted);
        };
        let vocab = self.vocab();
        check_accepted(accepted, p.n_rows)?;
        let p = self.pending.take().expect("checked above");
        self.backend.commit_rows(accepted)?;
        self.tokens.truncate(p.n_before + accepted);
        self.logits = if accepted == 0 {
            p.logits_before
        } else if p.rows.is_empty() {
            // The rows stayed on the device (a greedy cycle): the backend kept row
            // `accepted - 1` there; it is fetched when read.
            Logits::Kept(std::sync::OnceLock::new())
        } else {
            Logits::Host(p.rows[(accepted - 1) * vocab..accepted * vocab].to_vec())
        };
        Ok(())
    }

    /// Rows of the pending multi-row step (0: none).
    pub fn pending_rows(&self) -> usize {
        self.pending.as_ref().map_or(0, |p| p.n_rows)
    }

    /// Accepts every row of a pending step (which never rewinds, so cannot fail).
    fn accept_pending(&mut self) {
        if let Some(p) = self.pending.take() {
            let all = p.n_rows;
            let kept = self.backend.commit_rows(all);
            debug_assert!(kept.is_ok(), "accepting every row only drops the record");
        }
    }

    /// Steers this session's later forward passes (see [`crate::Engine::set_steering`];
    /// `None` or zero scales: off). The directions must match the model.
    pub fn set_steering(&mut self, steering: Option<Arc<crate::steer::Steering>>) -> Result<()> {
        let c = self.model.config();
        if let Some(s) = &steering {
            s.check_shape(c.n_layer, c.n_embd)?;
        }
        self.backend.set_steering(steering.filter(|s| s.active()))
    }

    /// Forgets every token.
    pub fn reset(&mut self) {
        self.pending = None;
        self.hc_ready = false;
        self.backend.reset();
        self.tokens.clear();
        self.logits = Logits::NONE;
    }

    /// The state's parts, to replace them (a payload load): a pending step is accepted.
    pub(crate) fn parts_mut(&mut self) -> (&mut Box<dyn Backend>, &mut Vec<u32>, &mut Vec<f32>) {
        self.accept_pending();
        self.hc_ready = false;
        self.logits_host();
        let Logits::Host(logits) = &mut self.logits else {
            unreachable!("on the host after logits_host")
        };
        (&mut self.backend, &mut self.tokens, logits)
    }
}

/// The MTP draft hooks of the speculative loop ([`crate::Speculator`]): the backend's
/// draft state sits beside the session's, never in its exported state.
impl Session {
    /// Whether [`HcSource::Last`] is available: the backend holds the final HC state
    /// of the last token (not after a reset, import or payload load, until the next
    /// forward).
    pub(crate) fn mtp_ready(&self) -> bool {
        self.hc_ready && !self.tokens.is_empty()
    }

    /// [`Backend::mtp_draft`] (a pending step is accepted first).
    pub(crate) fn mtp_draft(
        &mut self,
        mtp: &Mtp,
        token: u32,
        src: HcSource,
        pos: usize,
    ) -> Result<Vec<f32>> {
        self.accept_pending();
        self.backend.mtp_draft(mtp, token, src, pos)
    }

    /// [`Backend::mtp_mark`].
    pub(crate) fn mtp_mark(&mut self) {
        self.backend.mtp_mark();
    }

    /// [`Backend::mtp_keep`].
    pub(crate) fn mtp_keep(&mut self, n: usize) -> Result<()> {
        self.backend.mtp_keep(n)
    }

    /// [`Backend::greedy_cycle`]: the verify step is then pending as after
    /// [`Session::step_rows`] (its rows' logits possibly left on the device), for the
    /// caller's [`Session::commit_rows`]. No step when the gate stopped the first draft.
    pub(crate) fn greedy_cycle(&mut self, c: GreedyCycle<'_>) -> Result<CyclePicks> {
        self.check_room(1 + c.drafts)?;
        check_rows(1 + c.drafts)?;
        check_vocab(&[c.token], self.vocab())?;
        self.accept_pending();
        let token = c.token;
        let mut out = self.backend.greedy_cycle(c)?;
        if out.drafts.is_empty() {
            return Ok(out);
        }
        let mut rows_in = Vec::with_capacity(out.drafts.len() + 1);
        rows_in.push(token);
        rows_in.extend_from_slice(&out.drafts);
        // Rows left on the device (the caller commits at once).
        self.hold_rows(&rows_in, out.logits.take().unwrap_or_default());
        Ok(out)
    }
}

/// Whether `x` holds a NaN. Branch-free within a chunk so that it vectorises, with an
/// early exit between chunks. (`iter().any(is_nan)` runs one compare-and-branch per
/// value: ~130k a decoded token, 3% of a GPU token's time.)
fn has_nan(x: &[f32]) -> bool {
    // Sixteen independent flags a chunk, so the compare vectorises on the x86-64
    // baseline: ~4 µs a 129k row, where a max over the magnitude bits (no unsigned
    // 32-bit vector max before SSE4.1) took ~36 µs of every token's host time.
    x.chunks(4096).any(|c| {
        let mut flags = [false; 16];
        let mut lanes = c.chunks_exact(16);
        for l in &mut lanes {
            for (f, &v) in flags.iter_mut().zip(l) {
                *f |= v.is_nan();
            }
        }
        flags.iter().any(|&f| f) || lanes.remainder().iter().any(|v| v.is_nan())
    })
}

/// #18 item 11: NaN logits mean corrupt weights (an inf in a quantised scale, …); saying
/// so beats sampling token 0 forever. One pass over `vocab` floats per token is noise
/// next to the forward pass.
pub(crate) fn check_logits(logits: &[f32]) -> Result<()> {
    if has_nan(logits) {
        return Err(EngineError::nan_logits());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::has_nan;

    #[test]
    fn has_nan_finds_every_nan_and_nothing_else() {
        let mut v = vec![0.5f32; 10_000];
        v[17] = f32::INFINITY;
        v[18] = f32::NEG_INFINITY;
        v[19] = f32::MAX;
        assert!(!has_nan(&v));
        for bits in [
            0x7fc0_0000u32,
            0xffc0_0000,
            0x7f80_0001,
            0xff80_0001,
            0x7fff_ffff,
        ] {
            for at in [0, 4095, 4096, 9_999] {
                let mut w = v.clone();
                w[at] = f32::from_bits(bits);
                assert!(has_nan(&w), "{bits:#x} at {at}");
            }
        }
        assert!(!has_nan(&[]));
    }
}
