//! One job's work in steps, so the batching loop ([`super::batch`]) can interleave jobs:
//! a bounded prefill chunk ([`Worker::prefill_one`]) and, per generated token, the
//! choice of the token ([`Worker::gen_pick`]: sampler, stop strings, DSML parser, SSE
//! events), its decode (batched over jobs, or a speculative cycle) and the checks after
//! it ([`Worker::gen_decoded`]). Run back to back for one job they are the loop the
//! single-session worker ran.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use ds4_engine::{argmax, Sampler, SamplerConfig};

use super::{Fail, Worker};
use crate::error::ServerError;
use crate::gen::Pipeline;
use crate::job::{Finish, GenEvent, GenJob, GenResult, Usage};
use crate::kvcache::SaveReason;
use crate::log;

/// A prompt being evaluated: where it started and the time spent in its chunks.
pub(super) struct Prefill {
    start: usize,
    spent: Duration,
}

impl Prefill {
    pub fn new(start: usize) -> Prefill {
        Prefill {
            start,
            spent: Duration::ZERO,
        }
    }
}

/// A generation in progress (the state the single-session loop kept in locals).
pub(super) struct Gen {
    sampler: Sampler,
    pipe: Pipeline,
    /// The stream decoder's held bytes (a character split across tokens).
    pending: Vec<u8>,
    n: usize,
    max: usize,
    ctx: usize,
    finish: Finish,
    error: Option<String>,
    /// `--mtp` (worker/spec.rs): tokens a speculative cycle returned and not yet
    /// emitted; all but the last are already in the session.
    speculate: bool,
    ahead: VecDeque<u32>,
    /// The length the plain loop's session would have (the prompt and the emitted
    /// tokens it decoded).
    held: usize,
    engine_failed: bool,
    /// Time spent in this job's decode steps (throughput metrics).
    spent: Duration,
    last_token: Option<Instant>,
}

/// What a generating job needs next.
pub(super) enum Step {
    /// Decode this token (batched with the other jobs').
    Decode(u32),
    /// A speculative cycle after this token returning at most this many tokens.
    Spec(u32, usize),
    /// The token is already in the session (a cycle decoded it).
    Held,
    /// The generation ended.
    Done,
}

impl Worker {
    /// One bounded chunk of `eff` for a prefilling job: the cold save, snapshot and
    /// continued-save checks at the current position, then at most `prefill_step()`
    /// tokens, stopping at those positions. `Ok(true)` once the whole prompt is in.
    /// Fails when the client went away (499) or the server is shutting down.
    pub(super) fn prefill_one(
        &mut self,
        job: &GenJob,
        eff: &[u32],
        cold: Option<usize>,
        p: &mut Prefill,
    ) -> Result<bool, Fail> {
        let t = Instant::now();
        let start = p.start;
        let snap_at = eff.len().checked_sub(1).filter(|&x| x > start);
        let step = self.disk.as_ref().map_or(0, |d| d.cfg.continued_step());
        let pos = self.engine.tokens().len();
        if Some(pos) == cold {
            self.save_live(SaveReason::Cold);
            self.frontier = self.frontier.max(pos);
        }
        if Some(pos) == snap_at {
            // Without a snapshot a later rewind re-prefills: slower, not wrong.
            self.snap = match self.engine.snapshot() {
                Ok(s) => Some(s),
                Err(e) => {
                    log!("kv cache: no snapshot at {pos}: {e}");
                    None
                }
            };
        }
        if pos > start && self.continued_due(pos) {
            self.save_continued();
        }
        if pos >= eff.len() {
            p.spent += t.elapsed();
            let total = (eff.len() - start) as u64;
            let us = p.spent.as_micros() as u64;
            let m = &self.shared.metrics;
            m.prefill_tokens.fetch_add(total, Relaxed);
            m.prefill_micros.fetch_add(us, Relaxed);
            if us > 0 && total > 0 {
                m.last_prefill_mtps
                    .store(total * 1_000_000_000 / us, Relaxed);
            }
            return Ok(true);
        }
        if self.shared.stop_now.load(Relaxed) {
            return Err((503, "server shutting down".into()));
        }
        let mut end = eff.len().min(pos + self.prefill_step());
        for x in [cold, snap_at].into_iter().flatten() {
            if x > pos {
                end = end.min(x);
            }
        }
        if let Some(q) = pos.checked_div(step) {
            end = end.min((q + 1) * step);
        }
        let call = Instant::now();
        self.engine
            .prefill(&eff[pos..end])
            .map_err(|e| (e.status(), e.to_string()))?;
        self.note_prefill(end - pos, call.elapsed().as_secs_f64());
        p.spent += t.elapsed();
        let _ = job.tx.send(GenEvent::Progress {
            done: end - start,
            total: eff.len() - start,
        });
        if job.tx.is_closed() {
            return Err((499, "client disconnected during prefill".into()));
        }
        Ok(false)
    }

    /// The generation state of `job` on the current session (its prompt evaluated).
    pub(super) fn begin_gen(&self, job: &GenJob, eff: &[u32]) -> Gen {
        let ctx = self.engine.ctx();
        let s = &job.req.sampling;
        let seed = if s.seed > 0 {
            s.seed
        } else {
            self.shared.seed()
        };
        let sampler = Sampler::new(SamplerConfig {
            temperature: s.temperature.clamp(0.0, 100.0),
            top_k: s.top_k.min(1024),
            top_p: if s.top_p > 0.0 && s.top_p <= 1.0 {
                s.top_p
            } else {
                1.0
            },
            min_p: s.min_p.clamp(0.0, 1.0),
            seed,
        });
        let pipe = Pipeline::new(
            job.req.kind,
            job.req.structured,
            job.req.mode.thinking(),
            job.req.tools_active,
            &job.req.stops,
        );
        let speculate = self.speculates(job, &sampler);
        Gen {
            sampler,
            pipe,
            pending: Vec::new(),
            n: 0,
            max: job.req.max_tokens.min(ctx.saturating_sub(eff.len())),
            ctx,
            finish: Finish::Stop,
            error: None,
            speculate,
            ahead: VecDeque::new(),
            held: self.engine.tokens().len(),
            engine_failed: false,
            spent: Duration::ZERO,
            last_token: None,
        }
    }

    /// Picks the next token of `g` from the current session's logits (or a cycle's
    /// tokens), streams its text, and says what the session needs next.
    pub(super) fn gen_pick(&mut self, g: &mut Gen, job: &GenJob) -> Step {
        if g.n >= g.max {
            g.finish = Finish::Length;
            return Step::Done;
        }
        if job.tx.is_closed() {
            g.finish = Finish::Error;
            g.error = Some("client disconnected".into());
            self.shared.metrics.cancelled.fetch_add(1, Relaxed);
            return Step::Done;
        }
        if self.shared.stop_now.load(Relaxed) {
            g.finish = Finish::Error;
            g.error = Some("shutdown requested".into());
            return Step::Done;
        }
        let t = match g.ahead.pop_front() {
            Some(t) => t,
            None => {
                let logits = self.engine.logits();
                if logits.is_empty() {
                    g.finish = Finish::Error;
                    g.error = Some("no logits".into());
                    return Step::Done;
                }
                // Greedy inside DSML syntax: a sampled typo in a tag breaks the
                // call, while argument payloads keep the request's sampling (§2.2).
                if job.req.tools_active && g.pipe.in_dsml_syntax() {
                    argmax(logits)
                } else {
                    g.sampler.sample(logits)
                }
            }
        };
        if t == self.eos {
            return Step::Done;
        }
        g.n += 1;
        let now = Instant::now();
        let m = &self.shared.metrics;
        match g.last_token {
            None => m
                .ttft
                .observe(now.duration_since(job.enqueued).as_secs_f64()),
            Some(prev) => m.itl.observe(now.duration_since(prev).as_secs_f64()),
        }
        g.last_token = Some(now);
        let piece = self.decode_piece(g, t);
        for ev in g.pipe.push(&piece) {
            let _ = job.tx.send(ev);
        }
        if g.pipe.stop_hit.is_some() {
            return Step::Done;
        }
        if g.held >= g.ctx {
            g.finish = Finish::Length;
            return Step::Done;
        }
        // Decode `t`: a speculative cycle already did unless it was its last token.
        if !g.ahead.is_empty() {
            return Step::Held;
        }
        let allowed = g.speculate && !g.pipe.block_closed();
        match self.spec_cap(allowed, g.held, g.max - g.n) {
            Some(cap) => Step::Spec(t, cap),
            None => Step::Decode(t),
        }
    }

    /// The text of `t` that became final (the stream decoder, whose held bytes live
    /// in `g` between steps).
    fn decode_piece(&self, g: &mut Gen, t: u32) -> String {
        let mut dec = self.shared.tok.stream_decoder(false);
        // The held bytes are an incomplete character: pushing them yields nothing.
        let none = dec.push_bytes(&std::mem::take(&mut g.pending));
        debug_assert!(none.is_empty());
        let piece = dec.push(t);
        g.pending = dec.pending().to_vec();
        piece
    }

    /// A speculative cycle after `t` on the current session (MTP runs batch-1).
    pub(super) fn gen_spec(&mut self, g: &mut Gen, t: u32, cap: usize) -> Result<(), ServerError> {
        let eos = self.eos;
        let out = self.engine.advance(&mut g.sampler, t, cap, &[eos])?;
        g.ahead.extend(out);
        Ok(())
    }

    /// After the picked token was decoded (`res`, taking `spent`): false when the
    /// generation ended (an engine error, a closed tool-call block).
    pub(super) fn gen_decoded(
        &mut self,
        g: &mut Gen,
        res: Result<(), ServerError>,
        spent: Duration,
    ) -> bool {
        g.spent += spent;
        if let Err(e) = res {
            g.finish = Finish::Error;
            g.error = Some(e.to_string());
            g.engine_failed = true;
            return false;
        }
        g.held += 1;
        if g.pipe.block_closed() {
            return false;
        }
        if self.continued_due(g.held)
            && !g.pipe.in_dsml_syntax()
            && self.engine.tokens().len() == g.held
        {
            self.save_continued();
        }
        true
    }

    /// Ends the generation of `g` on the current session: the rewind after a cycle's
    /// unused tokens, metrics, the last events, and the result.
    pub(super) fn finish_gen(
        &mut self,
        mut g: Gen,
        job: &GenJob,
        eff: &[u32],
        cached: usize,
    ) -> GenResult {
        if !g.engine_failed && self.engine.tokens().len() > g.held {
            // A stop string, a closed tool block or a cancellation inside a cycle's
            // tokens: back to the plain loop's session (the KV reuse and the bindings
            // of the next request match against it).
            self.rewind_to(g.held, job);
        }
        self.shared.metrics.add_spec(self.engine.take_spec_stats());
        let us = g.spent.as_micros() as u64;
        let m = &self.shared.metrics;
        m.decode_tokens.fetch_add(g.n as u64, Relaxed);
        m.decode_micros.fetch_add(us, Relaxed);
        if us > 0 && g.n > 0 {
            m.last_decode_mtps
                .store(g.n as u64 * 1_000_000_000 / us, Relaxed);
        }
        let mut dec = self.shared.tok.stream_decoder(false);
        let _ = dec.push_bytes(&g.pending);
        let tail = dec.finish();
        if !tail.is_empty() {
            for ev in g.pipe.push(&tail) {
                let _ = job.tx.send(ev);
            }
        }
        let stop_sequence = g.pipe.stop_hit.clone();
        let (evs, out) = g.pipe.finish();
        for ev in evs {
            let _ = job.tx.send(ev);
        }
        if out.malformed {
            log!("request {}: invalid tool call; returned as text", job.id);
        }
        let mut finish = g.finish;
        let mut error = g.error;
        if !out.calls.is_empty() && finish != Finish::Error {
            finish = Finish::ToolCalls;
        } else if out.unterminated && finish == Finish::Stop {
            finish = Finish::Error;
            error = Some("unterminated tool call".into());
        }
        if let (Some(block), false) = (
            &out.raw_block,
            out.calls.is_empty() || !self.shared.cfg.exact_dsml_replay,
        ) {
            let ids: Vec<String> = out.calls.iter().map(|c| c.id.clone()).collect();
            self.shared.tool_memory().insert(&ids, block);
        }
        GenResult {
            finish,
            error,
            reasoning: out.reasoning,
            reasoning_closed: out.reasoning_closed,
            content: out.content,
            tool_calls: out.calls,
            streamed_calls: out.streamed_calls,
            stop_sequence,
            malformed: out.malformed,
            usage: Usage {
                prompt: eff.len(),
                completion: g.n,
                cached,
            },
        }
    }
}
