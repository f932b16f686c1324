//! The session pool (issue #21, docs/server.md "Session pool"): up to `--max-sessions`
//! live KV sessions, each with its own snapshot, continued-save frontier and protocol
//! bindings. A request goes to the live session with the longest reusable prefix (the
//! §4.1 matching of one session, tried on each: bindings, token prefix, rendered bytes,
//! then the snapshots), else to a free or the least-recently-used idle session, whose
//! state is evicted to the host-RAM tier (`--kv-ram-mb`) and to the disk KV cache and
//! comes back from either. A request that extends a busy session gets a copy of it (a
//! fork), so both continue independently.
//!
//! The worker works on one slot at a time (`Worker::engine`, `snap`, `frontier` and
//! `Shared::bindings` are the current slot's): [`Worker::switch`] swaps the fields, so
//! all the single-session logic (matching, cache saves, bindings, canonical rebuilds)
//! runs unchanged on whichever slot a job holds.

use std::sync::atomic::Ordering::Relaxed;

use super::{disk_hit_fits, lock, Fail, Synced, Worker};
use crate::bindings::Bindings;
use crate::engine::EngineBackend;
use crate::job::GenJob;
use crate::kvcache::SaveReason;
use crate::log;

/// Largest derived pool: the batched decode step runs at most this many rows.
pub const MAX_POOL: usize = 16;
/// The pool in host memory without a memory estimate (the CPU backend, the fake
/// engine): enough for an agent's side requests next to its main conversation.
pub const CPU_POOL: usize = 4;

/// The default `--max-sessions`: as many full-context sessions (`ctx` tokens of
/// `bytes_per_token` KV each) as fit in 90% of `free_bytes` of device memory, 1 to
/// [`MAX_POOL`]. Without that estimate: [`CPU_POOL`] when the KV lives in host memory,
/// 1 on a device (`on_device`), whose memory a blind guess could exhaust; the CUDA
/// backend is to feed its free memory and KV size here.
pub fn default_max_sessions(
    free_bytes: Option<u64>,
    bytes_per_token: Option<u64>,
    ctx: usize,
    on_device: bool,
) -> usize {
    match (free_bytes, bytes_per_token) {
        (Some(free), Some(per)) if per > 0 => {
            let one = per.saturating_mul(ctx.max(1) as u64);
            let n = (free / 10 * 9) / one.max(1);
            (n as usize).clamp(1, MAX_POOL)
        }
        _ if on_device => 1,
        _ => CPU_POOL,
    }
}

/// The default pool on a GPU: the first session (which exists already) and as many
/// more as fit 90% of the `free` device bytes at `one` bytes each (a session at its
/// full context with its prefill buffers, `Session::device_memory`), up to [`MAX_POOL`].
pub fn device_pool_size(free: u64, one: u64) -> usize {
    let more = (free / 10 * 9) / one.max(1);
    (1 + usize::try_from(more).unwrap_or(MAX_POOL)).min(MAX_POOL)
}

/// One live session of the pool. The current slot's state lives in the worker's fields
/// (here `engine` is `None`).
pub(super) struct Slot {
    pub engine: Option<Box<dyn EngineBackend>>,
    pub snap: Option<Box<dyn EngineBackend>>,
    pub frontier: usize,
    pub bindings: Bindings,
    /// A running job holds it.
    pub busy: bool,
    /// Recency (the worker's tick when a job last took it).
    pub used: u64,
}

impl Slot {
    /// The slot the worker starts on (its state is in the worker).
    pub fn current() -> Slot {
        Slot {
            engine: None,
            snap: None,
            frontier: 0,
            bindings: Bindings::default(),
            busy: false,
            used: 0,
        }
    }
}

/// An evicted session in host memory: its DSV4 payload (`save_payload`).
pub(super) struct RamEntry {
    tokens: Vec<u32>,
    payload: Vec<u8>,
    frontier: usize,
}

/// The host-RAM tier: evicted sessions, oldest dropped first beyond the budget (they
/// were also written to the disk cache when it is on).
pub(super) struct RamTier {
    budget: u64,
    entries: Vec<RamEntry>,
}

impl RamTier {
    pub fn new(budget: u64) -> RamTier {
        RamTier {
            budget,
            entries: Vec::new(),
        }
    }

    fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.payload.len() as u64).sum()
    }

    /// Keeps `e`, dropping the oldest entries to make room; false when it alone is
    /// larger than the budget.
    fn insert(&mut self, e: RamEntry) -> bool {
        let size = e.payload.len() as u64;
        if size > self.budget {
            return false;
        }
        while self.bytes() + size > self.budget && !self.entries.is_empty() {
            self.entries.remove(0);
        }
        self.entries.push(e);
        true
    }
}

/// Where a reusable state was found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum From {
    Live,
    Snap,
}

impl Worker {
    /// Moves the worker onto slot `i` (its engine, snapshot, frontier and bindings).
    pub(super) fn switch(&mut self, i: usize) {
        if i == self.cur {
            return;
        }
        let cur = self.cur;
        let incoming = self.slots[i]
            .engine
            .take()
            .expect("a parked slot holds its engine");
        self.slots[cur].engine = Some(std::mem::replace(&mut self.engine, incoming));
        std::mem::swap(&mut self.snap, &mut self.slots[cur].snap);
        std::mem::swap(&mut self.snap, &mut self.slots[i].snap);
        std::mem::swap(&mut self.frontier, &mut self.slots[cur].frontier);
        std::mem::swap(&mut self.frontier, &mut self.slots[i].frontier);
        let mut b = self.shared.bindings();
        std::mem::swap(&mut *b, &mut self.slots[cur].bindings);
        std::mem::swap(&mut *b, &mut self.slots[i].bindings);
        self.cur = i;
        // Under the bindings lock (the handlers take it first): a handler sees the
        // current and the parked ids of one moment.
        let mut parked = lock(&self.shared.parked_ids);
        parked.0.clear();
        parked.1.clear();
        for s in &self.slots {
            if let Some(r) = &s.bindings.responses {
                parked.0.extend(r.ids.iter().cloned());
            }
            if let Some(a) = &s.bindings.anthropic {
                parked.1.extend(a.ids.iter().cloned());
            }
        }
    }

    /// The tokens slot `i` holds.
    fn slot_tokens(&self, i: usize) -> &[u32] {
        match &self.slots[i].engine {
            Some(e) if i != self.cur => e.tokens(),
            _ => self.engine.tokens(),
        }
    }

    /// Most jobs at once (and live sessions).
    pub(super) fn pool_size(&self) -> usize {
        self.max_sessions
    }

    /// Marks slot `i` taken by a job.
    pub(super) fn hold(&mut self, i: usize) {
        self.tick += 1;
        self.slots[i].busy = true;
        self.slots[i].used = self.tick;
    }

    pub(super) fn release(&mut self, i: usize) {
        self.slots[i].busy = false;
    }

    /// `/metrics`: tokens and KV bytes of every slot.
    pub(super) fn publish_sessions(&self) {
        let v: Vec<(u64, Option<u64>)> = (0..self.slots.len())
            .map(|i| {
                let e: &dyn EngineBackend = match &self.slots[i].engine {
                    Some(e) if i != self.cur => e.as_ref(),
                    _ => self.engine.as_ref(),
                };
                (e.tokens().len() as u64, e.kv_bytes())
            })
            .collect();
        *lock(&self.shared.metrics.sessions) = v;
    }

    /// §4.1 over the pool: picks the session `job` runs on and brings it to the longest
    /// reusable prefix of the prompt. The worker is then on that slot. A request whose
    /// tool outputs only a (now gone) live session can serve fails with 409.
    pub(super) fn route(&mut self, job: &GenJob) -> Result<(usize, Synced), Fail> {
        let n = self.slots.len();
        for i in 0..n {
            if self.slots[i].busy {
                continue;
            }
            self.switch(i);
            if let Some(m) = self.match_binding(job) {
                self.shared.metrics.pool_hits.fetch_add(1, Relaxed);
                return Ok((i, m));
            }
        }
        if job.req.live.requires_live {
            let what = match job.req.kind {
                crate::job::ApiKind::Anthropic => "Anthropic continuation state is not available; retry by replaying the full messages history",
                _ => "Responses continuation state is not available; retry by replaying the full input history",
            };
            return Err((409, what.into()));
        }
        // The longest reusable prefix; on a tie the live state over a snapshot, an idle
        // session over a busy one (no copy needed).
        let mut best: Option<(usize, From, Synced)> = None;
        for i in 0..n {
            self.switch(i);
            let live = self.match_session(self.engine.tokens(), job, true);
            let snap = self
                .snap
                .as_ref()
                .and_then(|s| self.match_session(s.tokens(), job, false));
            for (from, m) in [(From::Live, live), (From::Snap, snap)] {
                let Some(m) = m else { continue };
                let rank = |i: usize, f: From, c: usize| (c, !self.slots[i].busy, f == From::Live);
                if best
                    .as_ref()
                    .is_none_or(|(bi, bf, bm)| rank(i, from, m.cached) > rank(*bi, *bf, bm.cached))
                {
                    best = Some((i, from, m));
                }
            }
        }
        let ram_best = self
            .ram
            .entries
            .iter()
            .enumerate()
            .filter_map(|(k, e)| self.match_session(&e.tokens, job, false).map(|m| (k, m)))
            .max_by_key(|(_, m)| m.cached);
        let live_cached = best.as_ref().map_or(0, |b| b.2.cached);
        if let (Some((i, from, m)), false) = (
            best,
            ram_best.as_ref().is_some_and(|r| r.1.cached > live_cached),
        ) {
            if let Some(r) = self.reuse(i, from, m) {
                self.shared.metrics.pool_hits.fetch_add(1, Relaxed);
                return Ok(r);
            }
        }
        let t = self.take_slot()?;
        if let Some((k, m)) = ram_best.filter(|r| r.1.cached > 0) {
            let e = self.ram.entries.remove(k);
            match self.engine.load_payload(&mut &e.payload[..]) {
                Ok(()) if self.engine.tokens() == e.tokens.as_slice() => {
                    self.frontier = e.frontier;
                    self.shared.metrics.ram_hits.fetch_add(1, Relaxed);
                    log!(
                        "kv cache: session restored from host RAM ({} tokens)",
                        e.tokens.len()
                    );
                    return Ok((t, Synced { source: "ram", ..m }));
                }
                Ok(()) => {
                    log!("kv cache: a host-RAM session came back with other tokens; dropped");
                    self.engine.reset();
                }
                Err(e) => log!("kv cache: cannot restore a host-RAM session: {e}"),
            }
        }
        Ok((t, self.disk_or_cold(job)))
    }

    /// Puts the state `from` of slot `i` under `job`: in place when the slot is idle,
    /// else (a busy session) a copy into another slot. `None` when a copy fails (out of
    /// memory): the request then goes on as a miss.
    fn reuse(&mut self, i: usize, from: From, m: Synced) -> Option<(usize, Synced)> {
        self.switch(i);
        let busy = self.slots[i].busy;
        if !busy && from == From::Live {
            return Some((i, m));
        }
        let copy = match from {
            From::Live => self.engine.snapshot(),
            From::Snap => self.snap.as_ref()?.snapshot(),
        };
        let copy = match copy {
            Ok(c) => c,
            Err(e) => {
                // Out of device memory for the copy, say: the request goes on
                // without it (disk cache or a cold prefill).
                log!("kv cache: cannot copy session {i}: {e}");
                if from == From::Snap && !busy {
                    self.snap = None;
                }
                return None;
            }
        };
        let source = if from == From::Snap {
            "snapshot"
        } else {
            m.source
        };
        if !busy {
            self.engine = copy;
            return Some((i, Synced { source, ..m }));
        }
        let frontier = self.frontier;
        let t = self.take_slot().ok()?;
        self.engine = copy;
        self.frontier = frontier;
        self.shared.metrics.pool_forks.fetch_add(1, Relaxed);
        log!("kv cache: forked busy session {i} into session {t}");
        Some((t, Synced { source, ..m }))
    }

    /// An idle slot for a new timeline, empty, and the worker on it: a free one, a new
    /// one while the pool has room, else the least recently used idle one, evicted.
    fn take_slot(&mut self) -> Result<usize, Fail> {
        let n = self.slots.len();
        let free = (0..n).find(|&i| !self.slots[i].busy && self.slot_tokens(i).is_empty());
        if let Some(i) = free {
            self.switch(i);
            self.clear_current();
            return Ok(i);
        }
        if n < self.max_sessions {
            match self.engine.snapshot() {
                Ok(mut e) => {
                    e.reset();
                    let mut s = Slot::current();
                    s.engine = Some(e);
                    self.slots.push(s);
                    self.switch(n);
                    return Ok(n);
                }
                Err(e) => log!("session pool: cannot add a session ({e}); evicting one"),
            }
        }
        let Some(i) = (0..n)
            .filter(|&i| !self.slots[i].busy)
            .min_by_key(|&i| self.slots[i].used)
        else {
            return Err((503, "server busy: no free session".into()));
        };
        self.switch(i);
        self.evict_current();
        Ok(i)
    }

    /// Evicts the current slot's session: to the host-RAM tier and the disk cache, then
    /// empties it.
    fn evict_current(&mut self) {
        let toks = self.engine.tokens().len();
        if toks > 0 {
            self.shared.metrics.pool_evictions.fetch_add(1, Relaxed);
            log!("kv cache: evicting session {} ({toks} tokens)", self.cur);
            if self.ram.budget > 0 {
                let mut payload = Vec::new();
                let kept = match self.engine.save_payload(&mut payload) {
                    Ok(()) => self.ram.insert(RamEntry {
                        tokens: self.engine.tokens().to_vec(),
                        payload,
                        frontier: self.frontier,
                    }),
                    Err(e) => {
                        log!("kv cache: cannot keep session {} in RAM: {e}", self.cur);
                        false
                    }
                };
                if kept {
                    self.shared.metrics.ram_saves.fetch_add(1, Relaxed);
                }
            }
            if self.disk.as_ref().is_some_and(|d| toks >= d.cfg.min_tokens) {
                self.save_live(SaveReason::Evict);
            }
        }
        self.clear_current();
    }

    fn clear_current(&mut self) {
        self.engine.reset();
        self.snap = None;
        self.frontier = 0;
        self.shared.bindings().clear();
    }

    /// A miss in the pool and the RAM tier: the best disk checkpoint, or a cold prefill
    /// (the current slot is empty).
    fn disk_or_cold(&mut self, job: &GenJob) -> Synced {
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
                return Synced {
                    disk_kind: Some(hit.key_kind()),
                    ..Synced::new(eff, hit.tokens, "disk")
                };
            }
        }
        self.engine.reset();
        Synced::new(job.req.prompt_tokens.clone(), 0, "none")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_pool_fits_free_memory() {
        assert_eq!(default_max_sessions(None, None, 4096, false), CPU_POOL);
        assert_eq!(default_max_sessions(None, None, 4096, true), 1);
        assert_eq!(
            default_max_sessions(Some(1 << 40), None, 4096, false),
            CPU_POOL
        );
        // 90% of 4 GiB for sessions of 1 MiB × 1024 tokens: 3 sessions.
        assert_eq!(
            default_max_sessions(Some(4 << 30), Some(1 << 20), 1024, true),
            3
        );
        assert_eq!(
            default_max_sessions(Some(1 << 20), Some(1 << 20), 1024, true),
            1
        );
        assert_eq!(
            default_max_sessions(Some(1 << 50), Some(1), 1024, true),
            MAX_POOL
        );
    }

    #[test]
    fn a_gpu_pool_fills_the_free_memory() {
        // H200 with q2: 58 GiB free beside one 32k session of ~2.5 GiB.
        assert_eq!(device_pool_size(58 << 30, 5 << 29), 16);
        assert_eq!(device_pool_size(20 << 30, 5 << 29), 8);
        // The H100 with offloaded experts: no room for a second session.
        assert_eq!(device_pool_size(1 << 29, 2 << 30), 1);
        assert_eq!(device_pool_size(0, 0), 1);
    }

    #[test]
    fn ram_tier_drops_the_oldest_beyond_its_budget() {
        let e = |t: u32, n: usize| RamEntry {
            tokens: vec![t],
            payload: vec![0; n],
            frontier: 0,
        };
        let mut r = RamTier::new(100);
        assert!(r.insert(e(1, 40)));
        assert!(r.insert(e(2, 40)));
        assert!(r.insert(e(3, 40)));
        let kept: Vec<u32> = r.entries.iter().map(|e| e.tokens[0]).collect();
        assert_eq!(kept, [2, 3]);
        assert!(!r.insert(e(4, 101)));
        assert_eq!(r.bytes(), 80);
    }
}
