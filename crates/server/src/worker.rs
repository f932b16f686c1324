//! The engine worker (server.md §3, §4.1; architecture.md §6): one thread owns the
//! engine and a pool of live sessions (`--max-sessions`, [`pool`]) and runs the jobs of a
//! bounded FIFO together ([`batch`]): it admits jobs between steps, brings each one's
//! session to its prompt reusing as much KV as it can, interleaves bounded prefill
//! chunks with one batched decode step over every generating job, and streams each
//! job's events back.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use ds4_tokenizer::{clip_ranges_to, MarkedText, Tokenizer};

use crate::api::Prepared;
use crate::bindings::{same_ids, Bindings, EXT_RESPONSES_VISIBLE, EXT_THINKING_VISIBLE};
use crate::config::ServerConfig;
use crate::engine::EngineBackend;
use crate::error::ApiError;
use crate::job::{ApiKind, GenJob, GenResult};
use crate::kvcache::disk::Hit;
use crate::kvcache::{DiskCache, SaveReason};
use crate::log;
use crate::metrics::Metrics;
use crate::toolmem::ToolMemory;

mod batch;
mod pool;
mod spec;
mod step;
mod turn;

pub use pool::default_max_sessions;

/// Tokens per prefill call at least: small enough to notice a disconnect and report
/// progress; the engine's preferred batch when larger (the CUDA prefill chunk).
const PREFILL_CHUNK: usize = 512;

/// While other jobs are generating (continuous batching), a prefill chunk may hold up
/// their next token by at most about this long (issue #21: a long prompt arriving adds
/// ≤ 150 ms to the others' tokens; the rest is the decode step itself), so its size
/// follows the prefill rate measured on this engine ([`Worker::interleave_chunk`]).
const INTERLEAVE_BUDGET_S: f64 = 0.12;
/// The interleaved chunk before any prefill was timed, and the smallest one.
const INTERLEAVE_FIRST: usize = 256;
const INTERLEAVE_MIN: usize = 64;

/// Whether a prefill chunk is cut to the interleave budget: while at least as many jobs
/// generate as wait for their prompt. A burst of new prompts (most jobs prefilling) takes
/// whole chunks instead: each of them waits for its first token, and small chunks would
/// make all of them wait longer (8 prompts at once on an H200: TTFT p50 6.9 s with small
/// chunks, 3.1 s with whole ones) for the sake of a stream or two.
fn interleave_wanted(generating: usize, prefilling: usize) -> bool {
    generating > 0 && generating >= prefilling
}

/// Tokens of an interleaved prefill chunk for `secs_per_token` measured (None: not yet),
/// at most `preferred` (the engine's chunk).
fn interleave_chunk(secs_per_token: Option<f64>, preferred: usize) -> usize {
    let n = match secs_per_token {
        Some(s) if s > 0.0 && s.is_finite() => (INTERLEAVE_BUDGET_S / s) as usize,
        _ => INTERLEAVE_FIRST,
    };
    n.clamp(INTERLEAVE_MIN, preferred.max(INTERLEAVE_MIN))
}

struct Queue {
    jobs: VecDeque<GenJob>,
    shutdown: bool,
    /// [`Shared::pause_admission`]: queued jobs wait.
    paused: bool,
}

/// State shared by the HTTP handlers and the worker.
pub struct Shared {
    pub cfg: ServerConfig,
    pub tok: Arc<Tokenizer>,
    pub metrics: Metrics,
    pub tools: Mutex<ToolMemory>,
    /// Live protocol bindings (§4.2) of the pool session the worker is on (the others
    /// are parked in their slots, their call ids in `parked_ids`): written by the
    /// worker, read by the handlers to validate tool outputs.
    pub bindings: Mutex<Bindings>,
    queue: Mutex<Queue>,
    cv: Condvar,
    next_id: AtomicU64,
    /// Set at shutdown: the running generation stops at its next token.
    stop_now: AtomicBool,
    seed_counter: AtomicU64,
    /// Call ids of the Responses and Anthropic bindings of the pool's other sessions
    /// (`bindings` holds the session the worker is on): a tool output may answer a
    /// live call of any of them.
    parked_ids: Mutex<(Vec<String>, Vec<String>)>,
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
                paused: false,
            }),
            cv: Condvar::new(),
            next_id: AtomicU64::new(1),
            stop_now: AtomicBool::new(false),
            seed_counter: AtomicU64::new(0),
            parked_ids: Mutex::new((Vec::new(), Vec::new())),
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

    /// The call ids of every live binding of `kind` (Responses or Anthropic) across the
    /// session pool, or `None` when no session has one: what a request's tool outputs
    /// may answer without replaying their calls (§4.2).
    pub fn live_call_ids(&self, kind: ApiKind) -> Option<Vec<String>> {
        let b = self.bindings();
        let mut ids = match kind {
            ApiKind::Responses => b.responses.as_ref().map(|b| b.ids.clone()),
            ApiKind::Anthropic => b.anthropic.as_ref().map(|b| b.ids.clone()),
            _ => None,
        };
        let parked = lock(&self.parked_ids);
        let more = if kind == ApiKind::Responses {
            &parked.0
        } else {
            &parked.1
        };
        if !more.is_empty() {
            ids.get_or_insert_with(Vec::new)
                .extend(more.iter().cloned());
        }
        ids
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

    /// Holds queued jobs back (`true`) or lets the worker admit them again: tests
    /// queue several requests and release them together, so that they are admitted in
    /// one iteration of the batching loop (deterministic batches).
    pub fn pause_admission(&self, on: bool) {
        lock(&self.queue).paused = on;
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

/// The fields `engine`, `snap`, `frontier` (and `Shared::bindings`) belong to the pool
/// slot the worker is on (`cur`); the other slots hold theirs ([`pool`]), and
/// `Worker::switch` swaps them. Everything that works on "the live session" works on the
/// current slot.
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
    /// The pool: slot `cur`'s state is in the fields above.
    slots: Vec<pool::Slot>,
    cur: usize,
    ram: pool::RamTier,
    /// Most live sessions (and jobs running at once).
    max_sessions: usize,
    /// Pool recency counter.
    tick: u64,
    /// Other jobs are generating: prefill in interleaved chunks ([`Worker::prefill_step`]).
    interleave: bool,
    /// Seconds per prefill token, as last measured (an average of the recent calls).
    prefill_spt: Option<f64>,
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
    /// Tokens per prefill call: the engine's batch, or while other jobs generate a
    /// chunk that keeps their next token within [`INTERLEAVE_BUDGET_S`].
    fn prefill_step(&self) -> usize {
        let full = PREFILL_CHUNK.max(self.engine.preferred_batch());
        if self.interleave {
            interleave_chunk(self.prefill_spt, full)
        } else {
            full
        }
    }

    /// Folds one timed prefill call (`n` tokens in `secs`) into the measured rate.
    fn note_prefill(&mut self, n: usize, secs: f64) {
        if n == 0 || secs.is_nan() || secs <= 0.0 {
            return;
        }
        let spt = secs / n as f64;
        self.prefill_spt = Some(match self.prefill_spt {
            // The cost per token grows with the position (attention): follow it.
            Some(old) => 0.5 * old + 0.5 * spt,
            None => spt,
        });
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
        // Speculative decoding runs one job at a time (worker/spec.rs): a pool of one.
        let max_sessions = if engine.speculative() {
            1
        } else {
            shared
                .cfg
                .max_sessions
                .unwrap_or_else(|| match engine.device_memory() {
                    Some((free, one)) => pool::device_pool_size(free, one),
                    None => default_max_sessions(None, None, engine.ctx(), engine.on_device()),
                })
        };
        let ram = pool::RamTier::new(shared.cfg.kv_ram_bytes);
        log!(
            "session pool: {max_sessions} live session{}, host-RAM tier {} MiB",
            if max_sessions == 1 { "" } else { "s" },
            shared.cfg.kv_ram_bytes >> 20
        );
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
            slots: vec![pool::Slot::current()],
            cur: 0,
            ram,
            max_sessions,
            tick: 0,
            interleave: false,
            prefill_spt: None,
        }
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
    fn match_session(&self, live: &[u32], job: &GenJob, is_live: bool) -> Option<Synced> {
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

#[cfg(test)]
mod interleave_tests {
    use super::*;

    #[test]
    fn chunks_are_cut_while_the_generating_jobs_are_not_outnumbered() {
        assert!(!interleave_wanted(0, 1), "nothing generates: whole chunks");
        assert!(interleave_wanted(7, 1), "a long prompt beside 7 streams");
        assert!(interleave_wanted(1, 1));
        assert!(!interleave_wanted(1, 7), "a burst of new prompts");
        assert!(!interleave_wanted(3, 4));
    }

    #[test]
    fn an_interleaved_chunk_fits_the_budget_at_the_measured_rate() {
        // Before any measurement: the first guess, within the engine's chunk.
        assert_eq!(interleave_chunk(None, 2048), INTERLEAVE_FIRST);
        assert_eq!(interleave_chunk(None, 128), 128.max(INTERLEAVE_MIN));
        // 4,000 tokens/s: 0.12 s holds 480 tokens.
        assert_eq!(interleave_chunk(Some(1.0 / 4000.0), 2048), 480);
        // Fast prefill: never more than the engine's chunk.
        assert_eq!(interleave_chunk(Some(1e-6), 2048), 2048);
        // Slow prefill (the CPU): at least the smallest chunk, so a prompt still moves.
        assert_eq!(interleave_chunk(Some(0.05), 512), INTERLEAVE_MIN);
        // Nonsense measurements fall back to the first guess.
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(interleave_chunk(Some(bad), 2048), INTERLEAVE_FIRST, "{bad}");
        }
    }
}
