//! The engine worker (server.md §3, §4.1): one thread owns the engine and the single live
//! session and runs jobs from a bounded FIFO one at a time. Per job it brings the session
//! to the prompt reusing as much KV as it can, generates, and streams events back.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use ds4_engine::{argmax, Sampler, SamplerConfig};
use ds4_tokenizer::{clip_ranges_to, MarkedText, Tokenizer};

use crate::api::Prepared;
use crate::bindings::{same_ids, Bindings, EXT_RESPONSES_VISIBLE, EXT_THINKING_VISIBLE};
use crate::config::ServerConfig;
use crate::engine::EngineBackend;
use crate::error::ApiError;
use crate::gen::Pipeline;
use crate::job::{ApiKind, Finish, GenEvent, GenJob, GenResult, Usage};
use crate::kvcache::disk::Hit;
use crate::kvcache::{DiskCache, SaveReason};
use crate::log;
use crate::metrics::Metrics;
use crate::toolmem::ToolMemory;

mod spec;
mod turn;

/// Tokens per prefill call at least: small enough to notice a disconnect and report
/// progress; the engine's preferred batch when larger (the CUDA prefill chunk).
const PREFILL_CHUNK: usize = 512;

struct Queue {
    jobs: VecDeque<GenJob>,
    shutdown: bool,
}

/// State shared by the HTTP handlers and the worker.
pub struct Shared {
    pub cfg: ServerConfig,
    pub tok: Arc<Tokenizer>,
    pub metrics: Metrics,
    pub tools: Mutex<ToolMemory>,
    /// Live protocol bindings (§4.2): written by the worker, read by the handlers to
    /// validate tool outputs.
    pub bindings: Mutex<Bindings>,
    queue: Mutex<Queue>,
    cv: Condvar,
    next_id: AtomicU64,
    /// Set at shutdown: the running generation stops at its next token.
    stop_now: AtomicBool,
    seed_counter: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take the server down with poisoned locks.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub fn new(cfg: ServerConfig, tok: Arc<Tokenizer>) -> Arc<Shared> {
        let max_ids = cfg.tool_memory_max_ids;
        Arc::new(Shared {
            cfg,
            tok,
            metrics: Metrics::default(),
            tools: Mutex::new(ToolMemory::new(max_ids)),
            bindings: Mutex::new(Bindings::default()),
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                shutdown: false,
            }),
            cv: Condvar::new(),
            next_id: AtomicU64::new(1),
            stop_now: AtomicBool::new(false),
            seed_counter: AtomicU64::new(0),
        })
    }

    /// Server-wide request counter (ids `chatcmpl-N`, `cmpl-N`).
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }

    pub fn tool_memory(&self) -> MutexGuard<'_, ToolMemory> {
        lock(&self.tools)
    }

    pub fn bindings(&self) -> MutexGuard<'_, Bindings> {
        lock(&self.bindings)
    }

    /// Queues a job; 503 when the queue is full or the server is shutting down.
    pub fn submit(&self, job: GenJob) -> Result<(), ApiError> {
        let mut q = lock(&self.queue);
        if q.shutdown {
            return Err(ApiError::unavailable("server shutting down"));
        }
        if q.jobs.len() >= self.cfg.queue_max {
            self.metrics.rejected_busy.fetch_add(1, Relaxed);
            return Err(ApiError::unavailable(format!(
                "server busy: {} requests are already queued; retry later",
                q.jobs.len()
            )));
        }
        q.jobs.push_back(job);
        self.metrics.queue_depth.store(q.jobs.len() as u64, Relaxed);
        self.cv.notify_one();
        Ok(())
    }

    /// Stops accepting jobs; queued jobs are answered with 503, the running one stops.
    pub fn begin_shutdown(&self) {
        let mut q = lock(&self.queue);
        q.shutdown = true;
        self.stop_now.store(true, Relaxed);
        self.cv.notify_all();
    }

    pub fn is_shutting_down(&self) -> bool {
        lock(&self.queue).shutdown
    }

    fn seed(&self) -> u64 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        t ^ self.seed_counter.fetch_add(0x9e37_79b9_7f4a_7c15, Relaxed)
    }
}

pub struct Worker {
    shared: Arc<Shared>,
    engine: Box<dyn EngineBackend>,
    /// The live session right after the last prompt's `<｜Assistant｜>`: the next turn
    /// usually diverges there (dropped reasoning, truncated stop), and restoring it costs
    /// a copy instead of a re-prefill.
    snap: Option<Box<dyn EngineBackend>>,
    disk: Option<DiskCache>,
    /// Longest length saved as a continued checkpoint in this timeline.
    frontier: usize,
    trace: Option<File>,
    eos: u32,
    user: u32,
    assistant: u32,
}

/// Starts the worker thread; it returns once shutdown was requested and the queue is
/// drained (after saving the live session to the disk cache).
pub fn spawn_worker(shared: Arc<Shared>, engine: Box<dyn EngineBackend>) -> JoinHandle<()> {
    let mut w = Worker::new(shared, engine);
    std::thread::Builder::new()
        .name("ds4-engine".into())
        .spawn(move || w.run())
        .expect("spawn the engine thread")
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

type Fail = (u16, String);

/// A request brought onto the session: the effective prompt, how much of it was
/// reused, and from where.
struct Synced {
    eff: Vec<u32>,
    cached: usize,
    source: &'static str,
    /// A disk hit's key kind (`token-text`, `responses-visible`, `thinking-visible`).
    disk_kind: Option<&'static str>,
}

impl Synced {
    fn new(eff: Vec<u32>, cached: usize, source: &'static str) -> Synced {
        Synced {
            eff,
            cached,
            source,
            disk_kind: None,
        }
    }
}

/// Where the rest of the request's prompt starts after `prefix`, when `prefix` is a
/// proper prefix of it with the same client-text marks (identical bytes rendered from
/// different parts, client text spelling markup, must not continue a binding).
fn proper_rest(req: &Prepared, prefix: &MarkedText) -> Option<usize> {
    let text = &req.prompt_text;
    (text.len() > prefix.len()
        && text.starts_with(prefix.text())
        && clip_ranges_to(&req.prompt_plain, prefix.len()) == prefix.plain_ranges())
    .then_some(prefix.len())
}

/// Whether a disk checkpoint's tokens (`cached`, now in the engine) may serve a prompt
/// (`text` with client-text ranges `plain`, tokenized to `full`): a token-text key must
/// put control tokens where the prompt has them; a visible-transcript key (its tokens
/// differ from the key text on purpose) only when no client text in the key range
/// spells markup, as its own marks were when it was saved (`save_live`).
fn disk_hit_fits(
    tok: &Tokenizer,
    hit: &Hit,
    cached: &[u32],
    text: &str,
    plain: &[Range<usize>],
    full: &[u32],
) -> bool {
    if hit.ext & (EXT_RESPONSES_VISIBLE | EXT_THINKING_VISIBLE) == 0 {
        tok.same_added_spans(cached, full)
    } else {
        tok.marks_are_inert(&text[..hit.key_len], &clip_ranges_to(plain, hit.key_len))
    }
}

impl Worker {
    /// Tokens per prefill call.
    fn prefill_step(&self) -> usize {
        PREFILL_CHUNK.max(self.engine.preferred_batch())
    }

    pub fn new(shared: Arc<Shared>, engine: Box<dyn EngineBackend>) -> Worker {
        let sp = shared.tok.special_ids().ok().cloned();
        let disk = shared.cfg.kv_disk.clone().and_then(|c| {
            let dir = c.dir.clone();
            match DiskCache::open(c, engine.ctx(), engine.quant_bits(), engine.fingerprint()) {
                Ok(d) => Some(d),
                Err(e) => {
                    log!(
                        "kv cache: cannot use {}: {e}; disk cache disabled",
                        dir.display()
                    );
                    None
                }
            }
        });
        if let (Some(d), true) = (&disk, shared.cfg.exact_dsml_replay) {
            let maps = d.read_tool_maps(shared.cfg.tool_memory_max_ids);
            let mut mem = shared.tool_memory();
            for (id, block) in &maps {
                mem.insert(std::slice::from_ref(id), block);
            }
            if !maps.is_empty() {
                log!("kv cache: restored {} tool-call ids from disk", maps.len());
            }
        }
        let trace = shared
            .cfg
            .trace
            .as_ref()
            .and_then(|p| match File::create(p) {
                Ok(f) => Some(f),
                Err(e) => {
                    log!("cannot open trace file {}: {e}", p.display());
                    None
                }
            });
        Worker {
            shared,
            engine,
            snap: None,
            disk,
            frontier: 0,
            trace,
            eos: sp.as_ref().map_or(1, |s| s.eos),
            user: sp.as_ref().map_or(u32::MAX, |s| s.user),
            assistant: sp.as_ref().map_or(u32::MAX, |s| s.assistant),
        }
    }

    pub fn run(&mut self) {
        loop {
            let job = {
                let mut q = lock(&self.shared.queue);
                while q.jobs.is_empty() && !q.shutdown {
                    q = self.shared.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
                let j = q.jobs.pop_front();
                self.shared
                    .metrics
                    .queue_depth
                    .store(q.jobs.len() as u64, Relaxed);
                match j {
                    Some(j) if q.shutdown => {
                        let _ = j.tx.send(GenEvent::Failed {
                            status: 503,
                            message: "server shutting down".into(),
                        });
                        continue;
                    }
                    Some(j) => j,
                    None => break,
                }
            };
            if job.tx.is_closed() {
                self.shared.metrics.cancelled.fetch_add(1, Relaxed);
                continue;
            }
            // A bug in one request must not take the engine thread down.
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_job(&job)));
            if res.is_err() {
                log!("request {} panicked; resetting the live session", job.id);
                self.engine.reset();
                self.snap = None;
                let _ = job.tx.send(GenEvent::Failed {
                    status: 500,
                    message: "internal error".into(),
                });
            }
        }
        self.save_live(SaveReason::Shutdown);
        log!("engine worker stopped");
    }

    fn save_live(&mut self, reason: SaveReason) {
        let Some(disk) = &self.disk else { return };
        let toks = self.engine.tokens();
        if toks.len() < disk.cfg.min_tokens {
            return;
        }
        // evict/shutdown: the visible transcript of a live binding is the key, so the
        // client's next request (which renders that text) finds it (§4.4).
        let visible = matches!(reason, SaveReason::Evict | SaveReason::Shutdown)
            .then(|| {
                self.shared
                    .bindings()
                    .visible_key(toks.len())
                    .map(|(k, e)| (k.clone(), e))
            })
            .flatten();
        // A visible key whose client text spells markup would let a later prompt with
        // the same bytes but other marks find it: key those by their tokens instead.
        let visible =
            visible.filter(|(k, _)| self.shared.tok.marks_are_inert(k.text(), k.plain_ranges()));
        let (key, ext) = match visible {
            Some((k, e)) => (k.text().to_string(), e),
            None => (self.shared.tok.decode(toks, false), 0),
        };
        let map = self.tool_map_for(&key);
        match disk.store(self.engine.as_ref(), &key, reason, &map, ext) {
            Ok(_) => {
                self.shared.metrics.disk_saves.fetch_add(1, Relaxed);
            }
            Err(e) => log!("kv cache: {} save skipped: {e}", reason.as_str()),
        }
    }

    fn tool_map_for(&self, key: &str) -> Vec<(String, Arc<str>)> {
        if !self.shared.cfg.exact_dsml_replay {
            return Vec::new();
        }
        self.shared.tool_memory().entries_in(key)
    }

    /// The live protocol bindings (§4.1 steps 1–3): the visible transcript of the last
    /// Responses turn, or trailing tool outputs answering exactly the live calls.
    fn match_binding(&self, job: &GenJob) -> Option<Synced> {
        let live = self.engine.tokens();
        let pos = live.len();
        if pos == 0 {
            return None;
        }
        let extend = |text: &MarkedText, source: &'static str| {
            let mut eff = live.to_vec();
            let tok = &self.shared.tok;
            tok.encode_marked_into(text.text(), text.plain_ranges(), &mut eff);
            Synced::new(eff, pos, source)
        };
        let b = self.shared.bindings();
        match job.req.kind {
            ApiKind::Responses => {
                let rb = b.responses.as_ref().filter(|b| b.pos == pos)?;
                if let Some(from) = proper_rest(&job.req, &rb.visible) {
                    let mut eff = live.to_vec();
                    self.encode_prompt_tail(job, from, &mut eff);
                    return Some(Synced::new(eff, pos, "responses-visible"));
                }
                let tail = job.req.live.tail.as_ref()?;
                same_ids(&job.req.live.ids, &rb.ids).then(|| extend(tail, "responses-tool-output"))
            }
            ApiKind::Anthropic => {
                let ab = b.anthropic.as_ref().filter(|b| b.pos == pos)?;
                let tail = job.req.live.tail.as_ref()?;
                same_ids(&job.req.live.ids, &ab.ids).then(|| extend(tail, "anthropic-tool-output"))
            }
            _ => None,
        }
    }

    /// Finds how much of `job`'s prompt `engine` already holds: the token prefix, the
    /// thinking binding's visible transcript (live session only), or the decoded text as
    /// a byte prefix of the rendered prompt (BPE may tokenize the same text differently
    /// than it was sampled). The suffix is always tokenized from text, never sliced.
    fn match_session(
        &self,
        engine: &dyn EngineBackend,
        job: &GenJob,
        is_live: bool,
    ) -> Option<Synced> {
        let live = engine.tokens();
        if live.is_empty() {
            return None;
        }
        let prompt = &job.req.prompt_tokens;
        if prompt.len() >= live.len() && common_prefix(live, prompt) == live.len() {
            return Some(Synced::new(prompt.clone(), live.len(), "memory-token"));
        }
        let extend = |from: usize, source: &'static str| {
            let mut eff = live.to_vec();
            self.encode_prompt_tail(job, from, &mut eff);
            Synced::new(eff, live.len(), source)
        };
        if is_live && matches!(job.req.kind, ApiKind::Chat | ApiKind::Anthropic) {
            let b = self.shared.bindings();
            if let Some(tb) = b.thinking.as_ref().filter(|b| b.pos == live.len()) {
                if let Some(from) = proper_rest(&job.req, &tb.visible) {
                    return Some(extend(from, "thinking-visible"));
                }
            }
        }
        let text = self.shared.tok.decode(live, false);
        // Same bytes, but control tokens must sit where the prompt has them: client
        // text that spells markup never reuses a cached control token (nor the reverse).
        if job.req.prompt_text.len() >= text.len()
            && job.req.prompt_text.as_bytes().starts_with(text.as_bytes())
            && job.req.prompt_text.is_char_boundary(text.len())
            && self.shared.tok.same_added_spans(live, prompt)
        {
            return Some(extend(text.len(), "memory-text"));
        }
        None
    }

    /// §4.1: live bindings, the live session, the snapshot, the disk cache, a cold
    /// prefill. A request whose tool outputs only the (now gone) live session can serve
    /// fails with 409.
    fn sync(&mut self, job: &GenJob) -> Result<Synced, Fail> {
        if let Some(m) = self.match_binding(job) {
            return Ok(m);
        }
        if job.req.live.requires_live {
            let what = match job.req.kind {
                ApiKind::Anthropic => "Anthropic continuation state is not available; retry by replaying the full messages history",
                _ => "Responses continuation state is not available; retry by replaying the full input history",
            };
            return Err((409, what.into()));
        }
        if let Some(m) = self.match_session(self.engine.as_ref(), job, true) {
            return Ok(m);
        }
        if let Some(snap) = &self.snap {
            if let Some(m) = self.match_session(snap.as_ref(), job, false) {
                match snap.snapshot() {
                    Ok(copy) => {
                        self.engine = copy;
                        return Ok(Synced {
                            source: "snapshot",
                            ..m
                        });
                    }
                    // Out of device memory for the copy, say: the request goes on
                    // without the snapshot (disk cache or a cold prefill).
                    Err(e) => {
                        log!("kv cache: cannot restore the snapshot: {e}");
                        self.snap = None;
                    }
                }
            }
        }
        let live = self.engine.tokens().len();
        if live > 0 {
            let common = common_prefix(self.engine.tokens(), &job.req.prompt_tokens);
            log!(
                "live kv cache miss live={live} prompt={} common={common}",
                job.req.prompt_tokens.len()
            );
            if self.disk.as_ref().is_some_and(|d| live >= d.cfg.min_tokens) {
                self.save_live(SaveReason::Evict);
            }
        }
        self.frontier = 0;
        self.snap = None;
        if let Some(disk) = &self.disk {
            let r = &job.req;
            let hit = disk.lookup_fitting(&r.prompt_text, self.engine.as_mut(), |hit, cached| {
                disk_hit_fits(
                    &self.shared.tok,
                    hit,
                    cached,
                    &r.prompt_text,
                    &r.prompt_plain,
                    &r.prompt_tokens,
                )
            });
            if let Some(hit) = hit {
                let mut eff = self.engine.tokens().to_vec();
                let tok = &self.shared.tok;
                tok.encode_marked_tail(
                    &job.req.prompt_text,
                    &job.req.prompt_plain,
                    hit.key_len,
                    &mut eff,
                );
                self.frontier = hit.tokens;
                log!(
                    "kv cache: disk hit {} tokens ({} key) from {}",
                    hit.tokens,
                    hit.key_kind(),
                    hit.path.display()
                );
                return Ok(Synced {
                    disk_kind: Some(hit.key_kind()),
                    ..Synced::new(eff, hit.tokens, "disk")
                });
            }
        }
        self.engine.reset();
        Ok(Synced::new(job.req.prompt_tokens.clone(), 0, "none"))
    }

    /// Appends the tokens of the request's prompt from byte `from` on, its client
    /// text plain.
    fn encode_prompt_tail(&self, job: &GenJob, from: usize, out: &mut Vec<u32>) {
        let r = &job.req;
        self.shared
            .tok
            .encode_marked_tail(&r.prompt_text, &r.prompt_plain, from, out);
    }

    /// Cold-save cut (§4.4): the last `<｜User｜>` before the first `<｜Assistant｜>` keeps
    /// the stable scaffolding (system, tools) and leaves out the task text.
    fn cold_cut(&self, eff: &[u32]) -> Option<usize> {
        let d = self.disk.as_ref()?;
        let (min, max) = (d.cfg.min_tokens, d.cfg.cold_max_tokens);
        if max == 0 || eff.len() < min || eff.len() > max {
            return None;
        }
        let first_asst = eff
            .iter()
            .position(|&t| t == self.assistant)
            .unwrap_or(eff.len());
        let anchor = eff[..first_asst].iter().rposition(|&t| t == self.user);
        Some(match anchor {
            Some(a) if a >= min => a,
            _ => d.cfg.store_len(eff.len()),
        })
    }

    fn continued_due(&self, pos: usize) -> bool {
        let Some(d) = &self.disk else { return false };
        let step = d.cfg.continued_step();
        step > 0 && pos.is_multiple_of(step) && pos >= d.cfg.min_tokens && pos > self.frontier
    }

    fn save_continued(&mut self) {
        let pos = self.engine.tokens().len();
        self.save_live(SaveReason::Continued);
        self.frontier = pos;
    }

    /// Evaluates `eff[pos..]` in chunks, stopping at the cold-save cut, the snapshot
    /// point and continued-save frontiers. Fails when the client went away.
    fn prefill(&mut self, job: &GenJob, eff: &[u32], cold: Option<usize>) -> Result<(), Fail> {
        let start = self.engine.tokens().len();
        let total = eff.len() - start;
        let snap_at = eff.len().checked_sub(1).filter(|&p| p > start);
        let step = self.disk.as_ref().map_or(0, |d| d.cfg.continued_step());
        let t0 = Instant::now();
        loop {
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
                break;
            }
            let mut end = eff.len().min(pos + self.prefill_step());
            for p in [cold, snap_at].into_iter().flatten() {
                if p > pos {
                    end = end.min(p);
                }
            }
            if let Some(q) = pos.checked_div(step) {
                end = end.min((q + 1) * step);
            }
            self.engine
                .prefill(&eff[pos..end])
                .map_err(|e| (e.status(), e.to_string()))?;
            let _ = job.tx.send(GenEvent::Progress {
                done: end - start,
                total,
            });
            if job.tx.is_closed() {
                return Err((499, "client disconnected during prefill".into()));
            }
        }
        let m = &self.shared.metrics;
        let us = t0.elapsed().as_micros() as u64;
        m.prefill_tokens.fetch_add(total as u64, Relaxed);
        m.prefill_micros.fetch_add(us, Relaxed);
        if us > 0 && total > 0 {
            m.last_prefill_mtps
                .store(total as u64 * 1_000_000_000 / us, Relaxed);
        }
        Ok(())
    }

    fn run_job(&mut self, job: &GenJob) {
        let started = Instant::now();
        let Synced {
            eff,
            cached,
            source,
            disk_kind,
        } = match self.sync(job) {
            Ok(x) => x,
            Err((status, message)) => return self.fail(job, status, message),
        };
        // The session now belongs to this request: earlier bindings describe a state
        // that is about to change (§4.1, "cleared once the sync succeeds").
        self.shared.bindings().clear();
        let ctx = self.engine.ctx();
        if eff.len() >= ctx {
            self.engine.reset();
            return self.fail(
                job,
                400,
                format!(
                    "Prompt has {} tokens, but the configured context size is {ctx} tokens",
                    eff.len()
                ),
            );
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
            "{} ctx={cached}..{}:{} [{} tools={} think={}] queued {} ms",
            job.req.kind.as_str(),
            eff.len(),
            eff.len() - cached,
            source,
            job.req.tools_active,
            job.req.mode.as_str(),
            started.duration_since(job.enqueued).as_millis()
        );
        if let Err((status, message)) = self.prefill(job, &eff, cold) {
            if status == 499 {
                self.shared.metrics.cancelled.fetch_add(1, Relaxed);
                log!("request {}: {message}", job.id);
                return;
            }
            self.engine.reset();
            self.snap = None;
            return self.fail(job, status, message);
        }
        let _ = job.tx.send(GenEvent::Started {
            prompt: eff.len(),
            cached,
        });
        let result = self.generate(job, &eff, cached);
        self.trace(job, &eff, cached, source, &result);
        let m = &self.shared.metrics;
        m.prompt_tokens.fetch_add(eff.len() as u64, Relaxed);
        m.cached_tokens.fetch_add(cached as u64, Relaxed);
        m.completion_tokens
            .fetch_add(result.usage.completion as u64, Relaxed);
        if result.finish == Finish::Error {
            m.errors.fetch_add(1, Relaxed);
        }
        log!(
            "request {} finish={}{} tokens={} in {:.2}s",
            job.id,
            result.finish.openai(),
            result
                .error
                .as_ref()
                .map(|e| format!(" error=\"{e}\""))
                .unwrap_or_default(),
            result.usage.completion,
            started.elapsed().as_secs_f64()
        );
        // Bindings go up before the client sees the answer: its next request may be
        // validated against them right away.
        self.bind_turn(job, &result);
        let canon = self.needs_canonical(job, &result);
        let _ = job.tx.send(GenEvent::Done(Box::new(result)));
        // The client is now running its tools; bring the live KV to what its next
        // request renders meanwhile (§4.3; the reference does this before answering).
        if let Some(text) = canon {
            self.canonicalize(job, &eff, &text);
        }
    }

    fn fail(&mut self, job: &GenJob, status: u16, message: String) {
        log!("request {} failed: {message}", job.id);
        self.shared.metrics.errors.fetch_add(1, Relaxed);
        let _ = job.tx.send(GenEvent::Failed { status, message });
    }

    fn generate(&mut self, job: &GenJob, eff: &[u32], cached: usize) -> GenResult {
        let tok = self.shared.tok.clone();
        let ctx = self.engine.ctx();
        let max = job.req.max_tokens.min(ctx.saturating_sub(eff.len()));
        let s = &job.req.sampling;
        let seed = if s.seed > 0 {
            s.seed
        } else {
            self.shared.seed()
        };
        let mut sampler = Sampler::new(SamplerConfig {
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
        let mut pipe = Pipeline::new(
            job.req.kind,
            job.req.structured,
            job.req.mode.thinking(),
            job.req.tools_active,
            &job.req.stops,
        );
        let mut dec = tok.stream_decoder(false);
        let mut n = 0usize;
        let mut finish = Finish::Stop;
        let mut error: Option<String> = None;
        // `--mtp` (worker/spec.rs): tokens a speculative cycle returned and not yet
        // emitted; all but the last are already in the session. `held` is the length
        // the plain loop's session would have (the prompt and the emitted tokens it
        // decoded).
        let speculate = self.speculates(job, &sampler);
        let mut ahead: VecDeque<u32> = VecDeque::new();
        let mut held = self.engine.tokens().len();
        let mut engine_failed = false;
        let t0 = Instant::now();
        loop {
            if n >= max {
                finish = Finish::Length;
                break;
            }
            if job.tx.is_closed() {
                finish = Finish::Error;
                error = Some("client disconnected".into());
                self.shared.metrics.cancelled.fetch_add(1, Relaxed);
                break;
            }
            if self.shared.stop_now.load(Relaxed) {
                finish = Finish::Error;
                error = Some("shutdown requested".into());
                break;
            }
            let t = match ahead.pop_front() {
                Some(t) => t,
                None => {
                    let logits = self.engine.logits();
                    if logits.is_empty() {
                        finish = Finish::Error;
                        error = Some("no logits".into());
                        break;
                    }
                    // Greedy inside DSML syntax: a sampled typo in a tag breaks the
                    // call, while argument payloads keep the request's sampling (§2.2).
                    if job.req.tools_active && pipe.in_dsml_syntax() {
                        argmax(logits)
                    } else {
                        sampler.sample(logits)
                    }
                }
            };
            if t == self.eos {
                break;
            }
            n += 1;
            let piece = dec.push(t);
            for ev in pipe.push(&piece) {
                let _ = job.tx.send(ev);
            }
            if pipe.stop_hit.is_some() {
                break;
            }
            let pos = held;
            if pos >= ctx {
                finish = Finish::Length;
                break;
            }
            // Decode `t`: a speculative cycle already did unless it was its last token.
            let decoded = if !ahead.is_empty() {
                Ok(())
            } else {
                match self.spec_cap(speculate && !pipe.block_closed(), pos, max - n) {
                    Some(cap) => self
                        .engine
                        .advance(&mut sampler, t, cap, &[self.eos])
                        .map(|out| ahead.extend(out)),
                    None => self.engine.decode(t),
                }
            };
            if let Err(e) = decoded {
                finish = Finish::Error;
                error = Some(e.to_string());
                engine_failed = true;
                break;
            }
            held = pos + 1;
            if pipe.block_closed() {
                break;
            }
            if self.continued_due(held)
                && !pipe.in_dsml_syntax()
                && self.engine.tokens().len() == held
            {
                self.save_continued();
            }
        }
        if !engine_failed && self.engine.tokens().len() > held {
            // A stop string, a closed tool block or a cancellation inside a cycle's
            // tokens: back to the plain loop's session (the KV reuse and the bindings
            // of the next request match against it).
            self.rewind_to(held, job);
        }
        self.shared.metrics.add_spec(self.engine.take_spec_stats());
        let us = t0.elapsed().as_micros() as u64;
        let m = &self.shared.metrics;
        m.decode_tokens.fetch_add(n as u64, Relaxed);
        m.decode_micros.fetch_add(us, Relaxed);
        if us > 0 && n > 0 {
            m.last_decode_mtps
                .store(n as u64 * 1_000_000_000 / us, Relaxed);
        }
        let tail = dec.finish();
        if !tail.is_empty() {
            for ev in pipe.push(&tail) {
                let _ = job.tx.send(ev);
            }
        }
        let stop_sequence = pipe.stop_hit.clone();
        let (evs, out) = pipe.finish();
        for ev in evs {
            let _ = job.tx.send(ev);
        }
        if out.malformed {
            log!("request {}: invalid tool call; returned as text", job.id);
        }
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
                completion: n,
                cached,
            },
        }
    }

    fn trace(&mut self, job: &GenJob, eff: &[u32], cached: usize, source: &str, r: &GenResult) {
        let Some(f) = self.trace.as_mut() else { return };
        let mut s = String::new();
        s.push_str(&format!(
            "===== request {} {} =====\n",
            job.id,
            crate::metrics::timestamp()
        ));
        s.push_str(&format!(
            "kind: {}\nthink_mode: {}\ntools: {}\nprompt_tokens: {}\neffective_prompt_tokens: {}\ncached_tokens: {cached}\nmax_tokens: {}\ntemperature: {}\ntop_k: {}\ntop_p: {}\nmin_p: {}\nseed: {}\n",
            job.req.kind.as_str(), job.req.mode.as_str(), job.req.tools_active, job.req.prompt_tokens.len(), eff.len(),
            job.req.max_tokens, job.req.sampling.temperature, job.req.sampling.top_k, job.req.sampling.top_p, job.req.sampling.min_p, job.req.sampling.seed
        ));
        s.push_str(&format!(
            "--- cache decision ---\ncache_source: {source}\ncached_tokens: {cached}\n"
        ));
        if let Some(raw) = &job.req.raw {
            s.push_str("--- raw request json ---\n");
            s.push_str(raw);
            s.push('\n');
        }
        s.push_str("--- rendered prompt ---\n");
        s.push_str(&job.req.prompt_text);
        s.push_str("\n--- parsed message ---\n");
        s.push_str(&format!(
            "finish: {}\ngenerated_tokens: {}\n",
            r.finish.openai(),
            r.usage.completion
        ));
        if let Some(rsn) = &r.reasoning {
            s.push_str(&format!("reasoning: {rsn}\n"));
        }
        s.push_str(&format!("content: {}\n", r.content));
        for (i, c) in r.tool_calls.iter().enumerate() {
            s.push_str(&format!(
                "tool_call[{i}]: id={} name={} arguments={}\n",
                c.id, c.name, c.arguments
            ));
        }
        s.push_str(&format!("===== end request {} =====\n", job.id));
        let _ = f.write_all(s.as_bytes());
    }
}
