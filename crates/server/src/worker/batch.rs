//! Continuous batching (issue #21; docs/server.md "Continuous batching"): the worker's
//! loop runs every admitted job at once. Each iteration
//! 1. admits queued jobs while the pool has room (each gets a session, [`Worker::route`]);
//! 2. runs one bounded prefill chunk of one job that is still prefilling, round-robin,
//!    so a long prompt is interleaved with the decode steps of the others instead of
//!    stalling them for seconds;
//! 3. picks the next token of every generating job (its own sampler, stop strings, DSML
//!    parser, SSE stream; a disconnected client ends its job, freeing the row), then
//!    decodes all of them in one batched step ([`crate::engine::decode_batch`]);
//! 4. finishes the jobs that ended (result, bindings, canonical rebuild).
//!
//! With `--mtp` the pool is one session and a job's tokens come from speculative
//! cycles (worker/spec.rs): batch-1, as before.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::step::{Gen, Prefill, Step};
use super::{lock, Synced, Worker};
use crate::engine::{decode_batch, EngineBackend};
use crate::job::{Finish, GenEvent, GenJob};
use crate::kvcache::SaveReason;
use crate::log;

/// An admitted job.
pub(super) struct Active {
    job: GenJob,
    slot: usize,
    /// When the worker took it from the queue.
    started: Instant,
    eff: Vec<u32>,
    cached: usize,
    source: &'static str,
    cold: Option<usize>,
    phase: Phase,
}

enum Phase {
    Prefill(Prefill),
    Decode(Box<Gen>),
    /// Ended: the result is sent and the slot released at the end of the iteration.
    Done,
}

fn failed(job: &GenJob, status: u16, message: &str) {
    let _ = job.tx.send(GenEvent::Failed {
        status,
        message: message.into(),
    });
}

impl Worker {
    /// The worker thread: until shutdown was requested and every job is answered; then
    /// the live sessions are saved to the disk cache.
    pub fn run(&mut self) {
        let mut active: Vec<Active> = Vec::new();
        let mut next_prefill = 0usize;
        loop {
            let (jobs, stop) = self.take_jobs(active.is_empty(), active.len());
            for job in jobs {
                if let Some(a) = self.guarded_admit(job) {
                    active.push(a);
                }
            }
            if stop && active.is_empty() {
                break;
            }
            self.shared
                .metrics
                .running
                .store(active.len() as u64, Relaxed);
            let prefilling: Vec<usize> = (0..active.len())
                .filter(|&i| matches!(active[i].phase, Phase::Prefill(_)))
                .collect();
            if !prefilling.is_empty() {
                let pick = prefilling
                    .iter()
                    .copied()
                    .find(|&i| i >= next_prefill)
                    .unwrap_or(prefilling[0]);
                next_prefill = pick + 1;
                // Others generating: a chunk short enough not to stall their next token
                // (unless new prompts outnumber them, see `interleave_wanted`).
                let generating = active
                    .iter()
                    .filter(|a| matches!(a.phase, Phase::Decode(_)))
                    .count();
                self.interleave = super::interleave_wanted(generating, prefilling.len());
                self.guarded(&mut active[pick], Self::prefill_job);
                self.interleave = false;
            }
            self.decode_step(&mut active);
            let mut i = 0;
            while i < active.len() {
                if matches!(active[i].phase, Phase::Done) {
                    let a = active.remove(i);
                    self.release(a.slot);
                    if i < next_prefill {
                        next_prefill -= 1;
                    }
                } else {
                    i += 1;
                }
            }
            self.shared
                .metrics
                .running
                .store(active.len() as u64, Relaxed);
            self.publish_sessions();
        }
        self.shared.metrics.running.store(0, Relaxed);
        for i in 0..self.slots.len() {
            self.switch(i);
            self.save_live(SaveReason::Shutdown);
        }
        log!("engine worker stopped");
    }

    /// Queued jobs for the free places of the pool (waiting for one when `idle`), and
    /// whether shutdown was requested. After shutdown, queued jobs are answered 503.
    fn take_jobs(&self, idle: bool, running: usize) -> (Vec<GenJob>, bool) {
        let mut q = lock(&self.shared.queue);
        while idle && (q.jobs.is_empty() || q.paused) && !q.shutdown {
            q = self.shared.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        let mut out = Vec::new();
        if q.shutdown {
            for j in q.jobs.drain(..) {
                failed(&j, 503, "server shutting down");
            }
        }
        while running + out.len() < self.pool_size() && (!q.paused || q.shutdown) {
            match q.jobs.pop_front() {
                Some(j) => out.push(j),
                None => break,
            }
        }
        self.shared
            .metrics
            .queue_depth
            .store(q.jobs.len() as u64, Relaxed);
        (out, q.shutdown)
    }

    /// Runs `f` on `a`; a panic (a bug in one request) fails that job with 500 and
    /// empties its session instead of taking the engine thread down.
    fn guarded(&mut self, a: &mut Active, f: fn(&mut Worker, &mut Active)) {
        let res = catch_unwind(AssertUnwindSafe(|| f(self, a)));
        if res.is_err() {
            self.panicked(a);
        }
    }

    fn panicked(&mut self, a: &mut Active) {
        log!("request {} panicked; resetting its session", a.job.id);
        self.switch(a.slot);
        self.engine.reset();
        self.snap = None;
        self.shared.bindings().clear();
        failed(&a.job, 500, "internal error");
        a.phase = Phase::Done;
    }

    fn guarded_admit(&mut self, job: GenJob) -> Option<Active> {
        if job.tx.is_closed() {
            self.shared.metrics.cancelled.fetch_add(1, Relaxed);
            return None;
        }
        let id = job.id;
        let tx = job.tx.clone();
        match catch_unwind(AssertUnwindSafe(|| self.admit(job))) {
            Ok(a) => a,
            Err(_) => {
                log!("request {id} panicked while taking a session; resetting it");
                self.engine.reset();
                self.snap = None;
                self.shared.bindings().clear();
                let _ = tx.send(GenEvent::Failed {
                    status: 500,
                    message: "internal error".into(),
                });
                None
            }
        }
    }

    /// §4.1 for one job: a session of the pool brought to the longest reusable prefix
    /// of its prompt; `None` when the job was answered already (an error).
    fn admit(&mut self, job: GenJob) -> Option<Active> {
        let started = Instant::now();
        let (slot, synced) = match self.route(&job) {
            Ok(x) => x,
            Err((status, message)) => {
                self.fail(&job, status, message);
                return None;
            }
        };
        let Synced {
            eff,
            cached,
            source,
            disk_kind,
        } = synced;
        // The session now belongs to this request: earlier bindings describe a state
        // that is about to change (§4.1, "cleared once the sync succeeds").
        self.shared.bindings().clear();
        self.hold(slot);
        let ctx = self.engine.ctx();
        if eff.len() >= ctx {
            self.engine.reset();
            self.release(slot);
            self.fail(
                &job,
                400,
                format!(
                    "Prompt has {} tokens, but the configured context size is {ctx} tokens",
                    eff.len()
                ),
            );
            return None;
        }
        if job.req.live.requires_live_reasoning
            && !source.ends_with("-tool-output")
            && source != "responses-visible"
            && disk_kind != Some("responses-visible")
        {
            log!(
                "request {}: the replayed tool call has no reasoning and no live checkpoint holds it; continuing from the visible history",
                job.id
            );
        }
        let cold = if cached == 0 {
            self.cold_cut(&eff)
        } else {
            None
        };
        self.shared.metrics.cache_hit(source);
        log!(
            "{} ctx={cached}..{}:{} [{} tools={} think={}] session {slot} reused {cached} queued {} ms",
            job.req.kind.as_str(),
            eff.len(),
            eff.len() - cached,
            source,
            job.req.tools_active,
            job.req.mode.as_str(),
            started.duration_since(job.enqueued).as_millis()
        );
        let start = self.engine.tokens().len();
        Some(Active {
            job,
            slot,
            started,
            eff,
            cached,
            source,
            cold,
            phase: Phase::Prefill(Prefill::new(start)),
        })
    }

    /// One prefill chunk of `a`; when its prompt is in, it starts generating.
    fn prefill_job(&mut self, a: &mut Active) {
        self.switch(a.slot);
        let Phase::Prefill(p) = &mut a.phase else {
            return;
        };
        match self.prefill_one(&a.job, &a.eff, a.cold, p) {
            Ok(false) => {}
            Ok(true) => {
                let _ = a.job.tx.send(GenEvent::Started {
                    prompt: a.eff.len(),
                    cached: a.cached,
                });
                a.phase = Phase::Decode(Box::new(self.begin_gen(&a.job, &a.eff)));
            }
            Err((499, message)) => {
                self.shared.metrics.cancelled.fetch_add(1, Relaxed);
                log!("request {}: {message}", a.job.id);
                a.phase = Phase::Done;
            }
            Err((status, message)) => {
                self.engine.reset();
                self.snap = None;
                self.fail(&a.job, status, message);
                a.phase = Phase::Done;
            }
        }
    }

    /// One token for every generating job: each picks its token on its own session,
    /// then all the tokens to decode run in one batched step.
    fn decode_step(&mut self, active: &mut [Active]) {
        let mut rows: Vec<(usize, u32)> = Vec::new();
        for (i, a) in active.iter_mut().enumerate() {
            let Phase::Decode(_) = a.phase else { continue };
            let res = catch_unwind(AssertUnwindSafe(|| self.pick(a)));
            match res {
                Ok(Some(t)) => rows.push((i, t)),
                Ok(None) => {}
                Err(_) => self.panicked(a),
            }
        }
        if rows.is_empty() {
            return;
        }
        let slots: Vec<(usize, u32)> = rows.iter().map(|&(i, t)| (active[i].slot, t)).collect();
        let t = Instant::now();
        let res = catch_unwind(AssertUnwindSafe(|| self.decode_slots(&slots)));
        let spent = t.elapsed();
        self.shared.metrics.step_rows.observe(rows.len() as f64);
        let Ok(results) = res else {
            for &(i, _) in &rows {
                self.panicked(&mut active[i]);
            }
            return;
        };
        for (&(i, _), r) in rows.iter().zip(results) {
            let a = &mut active[i];
            self.switch(a.slot);
            let Phase::Decode(g) = &mut a.phase else {
                continue;
            };
            if !self.gen_decoded(g, r, spent) {
                self.guarded(a, Self::complete);
            }
        }
    }

    /// The token `a` decodes next (`None`: nothing to batch; a speculative cycle ran,
    /// or the job ended and was completed).
    fn pick(&mut self, a: &mut Active) -> Option<u32> {
        self.switch(a.slot);
        let Phase::Decode(g) = &mut a.phase else {
            return None;
        };
        let more = match self.gen_pick(g, &a.job) {
            Step::Decode(t) => return Some(t),
            Step::Done => false,
            Step::Held => self.gen_decoded(g, Ok(()), Default::default()),
            Step::Spec(t, cap) => {
                let t0 = Instant::now();
                let r = self.gen_spec(g, t, cap);
                self.gen_decoded(g, r, t0.elapsed())
            }
        };
        if !more {
            self.complete(a);
        }
        None
    }

    /// Decodes `rows` (slot, token) in one batched step; results in order.
    fn decode_slots(&mut self, rows: &[(usize, u32)]) -> Vec<Result<(), crate::ServerError>> {
        let cur = self.cur;
        let mut by_slot: Vec<Option<&mut dyn EngineBackend>> = Vec::new();
        for (i, s) in self.slots.iter_mut().enumerate() {
            by_slot.push(if i == cur {
                None
            } else {
                s.engine.as_deref_mut()
            });
        }
        let mut current = Some(self.engine.as_mut());
        let mut batch: Vec<(&mut dyn EngineBackend, u32)> = Vec::with_capacity(rows.len());
        for &(s, t) in rows {
            let e = if s == cur {
                current.take()
            } else {
                by_slot[s].take()
            };
            // Two jobs never hold one slot.
            batch.push((e.expect("one row per session"), t));
        }
        decode_batch(batch)
    }

    /// Finishes `a`: the result to the client, metrics and the per-request log line,
    /// the bindings, and the canonical rebuild (§4.3) of its session.
    fn complete(&mut self, a: &mut Active) {
        let Phase::Decode(g) = std::mem::replace(&mut a.phase, Phase::Done) else {
            return;
        };
        self.switch(a.slot);
        let job = &a.job;
        let result = self.finish_gen(*g, job, &a.eff, a.cached);
        self.trace(job, &a.eff, a.cached, a.source, &result);
        let m = &self.shared.metrics;
        m.prompt_tokens.fetch_add(a.eff.len() as u64, Relaxed);
        m.cached_tokens.fetch_add(a.cached as u64, Relaxed);
        m.completion_tokens
            .fetch_add(result.usage.completion as u64, Relaxed);
        if result.finish == Finish::Error {
            m.errors.fetch_add(1, Relaxed);
        }
        log!(
            "request {} finish={}{} tokens={} session {} reused {} in {:.2}s",
            job.id,
            result.finish.openai(),
            result
                .error
                .as_ref()
                .map(|e| format!(" error=\"{e}\""))
                .unwrap_or_default(),
            result.usage.completion,
            a.slot,
            a.cached,
            a.started.elapsed().as_secs_f64()
        );
        // Bindings go up before the client sees the answer: its next request may be
        // validated against them right away.
        self.bind_turn(job, &result);
        let canon = self.needs_canonical(job, &result);
        let _ = job.tx.send(GenEvent::Done(Box::new(result)));
        // The client is now running its tools; bring the live KV to what its next
        // request renders meanwhile (§4.3; the reference does this before answering).
        if let Some(text) = canon {
            self.canonicalize(job, &a.eff, &text);
        }
    }

    pub(super) fn fail(&mut self, job: &GenJob, status: u16, message: String) {
        log!("request {} failed: {message}", job.id);
        self.shared.metrics.errors.fetch_add(1, Relaxed);
        let _ = job.tx.send(GenEvent::Failed { status, message });
    }
}
