//! Counters for `GET /metrics` (Prometheus text format) and the server's log lines.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use tracing::Level;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// `MMDD HH:MM:SS` in UTC (the reference log prefix, without a timezone library).
pub fn timestamp() -> String {
    let secs = crate::kvcache::disk::now_secs();
    let days = (secs / 86400) as i64;
    let tod = secs % 86400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    format!(
        "{m:02}{d:02} {:02}:{:02}:{:02}",
        tod / 3600,
        tod / 60 % 60,
        tod % 60
    )
}

/// `log!(...)`: one line of the server's log, an `info` event (see [`init_logging`]).
#[macro_export]
macro_rules! log {
    ($($arg:tt)*) => {
        $crate::metrics::__tracing::info!($($arg)*)
    };
}

/// For [`log!`] expanded in other crates.
#[doc(hidden)]
pub use tracing as __tracing;

/// Installs the log subscriber of the `ds4-server` binary (libraries only emit events):
/// stderr lines with the reference prefix `MMDD HH:MM:SS ds4-server: `, filtered by
/// `RUST_LOG` when it is set, else `info` (the server's request log), `debug` with one
/// `-v`, `trace` with `-vv` or more.
pub fn init_logging(verbosity: u8) {
    let default = match verbosity {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .event_format(ReferenceLine)
        .init();
}

/// `MMDD HH:MM:SS ds4-server: message`, the level named before the message unless it is
/// `info`.
struct ReferenceLine;

impl<S, N> FormatEvent<S, N> for ReferenceLine
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        write!(w, "{} ds4-server: ", timestamp())?;
        let level = match *event.metadata().level() {
            Level::ERROR => "error: ",
            Level::WARN => "warning: ",
            Level::INFO => "",
            Level::DEBUG => "debug: ",
            Level::TRACE => "trace: ",
        };
        w.write_str(level)?;
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

#[derive(Debug)]
pub struct Metrics {
    pub queue_depth: AtomicU64,
    pub requests: [AtomicU64; 5],
    pub rejected_busy: AtomicU64,
    pub errors: AtomicU64,
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub prefill_tokens: AtomicU64,
    pub prefill_micros: AtomicU64,
    pub decode_tokens: AtomicU64,
    pub decode_micros: AtomicU64,
    /// Last request's throughputs, in milli-tokens per second.
    pub last_prefill_mtps: AtomicU64,
    pub last_decode_mtps: AtomicU64,
    /// Cache hits by kind (`CACHE_KINDS`), then misses.
    pub cache: [AtomicU64; CACHE_KINDS.len() + 1],
    pub disk_saves: AtomicU64,
    /// Turns whose live KV was rebuilt to the canonical rendering (§4.3).
    pub canonical_rebuilds: AtomicU64,
    /// `--mtp`: speculative cycles (target steps), drafts verified, drafts accepted and
    /// tokens the cycles emitted.
    pub mtp_cycles: AtomicU64,
    pub mtp_drafted: AtomicU64,
    pub mtp_accepted: AtomicU64,
    pub mtp_emitted: AtomicU64,
    /// Replies that ended inside a cycle's tokens (the session was rewound).
    pub mtp_rewinds: AtomicU64,
    /// Requests admitted to the engine (prefilling or decoding).
    pub running: AtomicU64,
    /// Batched decode steps and the rows they ran (`--max-sessions`).
    pub step_rows: Hist,
    /// Time to the first generated token, from the request's arrival in the queue.
    pub ttft: Hist,
    /// Time between two generated tokens of one request.
    pub itl: Hist,
    pub pool_hits: AtomicU64,
    pub pool_forks: AtomicU64,
    pub pool_evictions: AtomicU64,
    pub ram_saves: AtomicU64,
    pub ram_hits: AtomicU64,
    /// Per pool slot: (tokens, KV bytes when the engine reports them).
    pub sessions: std::sync::Mutex<Vec<(u64, Option<u64>)>>,
}

/// A Prometheus histogram with fixed bounds (cumulative buckets, sum and count).
#[derive(Debug)]
pub struct Hist {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    /// Sum in millionths of the unit (atomics hold integers).
    sum_micro: AtomicU64,
    count: AtomicU64,
}

/// Seconds: from a fast decode step to a long queue wait.
pub const LATENCY_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Rows of one batched decode step.
pub const ROW_BOUNDS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0];

impl Hist {
    pub fn new(bounds: &'static [f64]) -> Hist {
        Hist {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_micro: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.sum_micro.fetch_add((v.max(0.0) * 1e6) as u64, Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    pub fn sum(&self) -> f64 {
        self.sum_micro.load(Relaxed) as f64 / 1e6
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        let mut acc = 0;
        for (b, n) in self.bounds.iter().zip(&self.buckets) {
            acc += n.load(Relaxed);
            out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {acc}\n"));
        }
        let count = self.count();
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {count}\n"));
        out.push_str(&format!(
            "{name}_sum {}\n{name}_count {count}\n",
            self.sum()
        ));
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        let z = AtomicU64::default;
        Metrics {
            queue_depth: z(),
            requests: Default::default(),
            rejected_busy: z(),
            errors: z(),
            cancelled: z(),
            prompt_tokens: z(),
            cached_tokens: z(),
            completion_tokens: z(),
            prefill_tokens: z(),
            prefill_micros: z(),
            decode_tokens: z(),
            decode_micros: z(),
            last_prefill_mtps: z(),
            last_decode_mtps: z(),
            cache: Default::default(),
            disk_saves: z(),
            canonical_rebuilds: z(),
            mtp_cycles: z(),
            mtp_drafted: z(),
            mtp_accepted: z(),
            mtp_emitted: z(),
            mtp_rewinds: z(),
            running: z(),
            step_rows: Hist::new(ROW_BOUNDS),
            ttft: Hist::new(LATENCY_BOUNDS),
            itl: Hist::new(LATENCY_BOUNDS),
            pool_hits: z(),
            pool_forks: z(),
            pool_evictions: z(),
            ram_saves: z(),
            ram_hits: z(),
            sessions: Default::default(),
        }
    }
}

pub const ENDPOINTS: [&str; 5] = [
    "chat",
    "completions",
    "responses",
    "messages",
    "count_tokens",
];
pub const CACHE_KINDS: [&str; 9] = [
    "memory-token",
    "memory-text",
    "snapshot",
    "disk",
    "responses-visible",
    "responses-tool-output",
    "anthropic-tool-output",
    "thinking-visible",
    "ram",
];
const MISS: usize = CACHE_KINDS.len();

impl Metrics {
    pub fn endpoint(&self, name: &str) {
        if let Some(i) = ENDPOINTS.iter().position(|e| *e == name) {
            self.requests[i].fetch_add(1, Relaxed);
        }
    }

    /// Adds one generation's speculative counters.
    pub fn add_spec(&self, s: ds4_engine::SpecStats) {
        self.mtp_cycles.fetch_add(s.cycles, Relaxed);
        self.mtp_drafted.fetch_add(s.drafted, Relaxed);
        self.mtp_accepted.fetch_add(s.accepted, Relaxed);
        self.mtp_emitted.fetch_add(s.emitted, Relaxed);
    }

    pub fn cache_hit(&self, kind: &str) {
        match CACHE_KINDS.iter().position(|k| *k == kind) {
            Some(i) => self.cache[i].fetch_add(1, Relaxed),
            None => self.cache[MISS].fetch_add(1, Relaxed),
        };
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, lines: Vec<(String, f64)>| {
            s.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, v) in lines {
                s.push_str(&format!("{name}{labels} {v}\n"));
            }
        };
        let g = |a: &AtomicU64| a.load(Relaxed) as f64;
        let rate = |t: &AtomicU64, us: &AtomicU64| {
            let us = us.load(Relaxed);
            if us == 0 {
                0.0
            } else {
                t.load(Relaxed) as f64 * 1e6 / us as f64
            }
        };
        // The metrics without labels: (name, type, help, value); one line each.
        #[rustfmt::skip]
        let plain = [
            ("ds4_queue_depth", "gauge", "Requests waiting for the engine.", g(&self.queue_depth)),
            ("ds4_rejected_busy_total", "counter", "Requests refused with 503 because the queue was full.", g(&self.rejected_busy)),
            ("ds4_errors_total", "counter", "Generations that ended with an error.", g(&self.errors)),
            ("ds4_cancelled_total", "counter", "Generations cancelled because the client went away.", g(&self.cancelled)),
            ("ds4_prompt_tokens_total", "counter", "Prompt tokens (effective prompts).", g(&self.prompt_tokens)),
            ("ds4_cached_tokens_total", "counter", "Prompt tokens reused from the KV cache.", g(&self.cached_tokens)),
            ("ds4_tokens_in_total", "counter", "Prompt tokens evaluated (prefill).", g(&self.prefill_tokens)),
            ("ds4_tokens_out_total", "counter", "Generated tokens.", g(&self.completion_tokens)),
            ("ds4_prefill_tokens_per_second", "gauge", "Average prefill throughput since start.", rate(&self.prefill_tokens, &self.prefill_micros)),
            ("ds4_decode_tokens_per_second", "gauge", "Average decode throughput since start.", rate(&self.decode_tokens, &self.decode_micros)),
            ("ds4_last_prefill_tokens_per_second", "gauge", "Prefill throughput of the last request.", g(&self.last_prefill_mtps) / 1000.0),
            ("ds4_last_decode_tokens_per_second", "gauge", "Decode throughput of the last request.", g(&self.last_decode_mtps) / 1000.0),
            ("ds4_disk_cache_saves_total", "counter", "Checkpoints written to the disk cache.", g(&self.disk_saves)),
            ("ds4_canonical_rebuilds_total", "counter", "Turns whose live KV was rebuilt to the canonical rendering.", g(&self.canonical_rebuilds)),
            ("ds4_mtp_cycles_total", "counter", "Speculative decoding cycles (--mtp): target steps that verified drafts.", g(&self.mtp_cycles)),
            ("ds4_mtp_drafted_total", "counter", "MTP-drafted tokens verified.", g(&self.mtp_drafted)),
            ("ds4_mtp_accepted_total", "counter", "MTP-drafted tokens accepted.", g(&self.mtp_accepted)),
            ("ds4_mtp_rewinds_total", "counter", "Replies that ended inside a speculative cycle's tokens (a stop string, a closed tool block, a cancel): the session was rewound.", g(&self.mtp_rewinds)),
            ("ds4_mtp_tokens_per_cycle", "gauge", "Tokens emitted per speculative cycle since start (1 + accepted drafts on average).", rate(&self.mtp_emitted, &self.mtp_cycles) / 1e6),
            ("ds4_requests_running", "gauge", "Requests admitted to the engine (prefilling or generating).", g(&self.running)),
            ("ds4_requests_queued", "gauge", "Requests waiting for a place in the engine.", g(&self.queue_depth)),
            ("ds4_pool_hits_total", "counter", "Requests served by a live session of the pool with KV reuse (in place or forked).", g(&self.pool_hits)),
            ("ds4_pool_forks_total", "counter", "Requests that extended a busy session and got a copy of it.", g(&self.pool_forks)),
            ("ds4_pool_evictions_total", "counter", "Live sessions evicted from the pool to make room.", g(&self.pool_evictions)),
            ("ds4_pool_ram_saves_total", "counter", "Evicted sessions kept in the host-RAM tier (--kv-ram-mb).", g(&self.ram_saves)),
            ("ds4_pool_ram_hits_total", "counter", "Requests whose session came back from the host-RAM tier.", g(&self.ram_hits)),
        ];
        for (name, kind, help, v) in plain {
            metric(name, kind, help, vec![(String::new(), v)]);
        }
        metric(
            "ds4_requests_total",
            "counter",
            "Requests by endpoint.",
            ENDPOINTS
                .iter()
                .zip(&self.requests)
                .map(|(e, a)| (format!("{{endpoint=\"{e}\"}}"), g(a)))
                .collect(),
        );
        let mut cache: Vec<(String, f64)> = CACHE_KINDS
            .iter()
            .zip(&self.cache)
            .map(|(k, a)| (format!("{{kind=\"{k}\"}}"), g(a)))
            .collect();
        cache.push(("{kind=\"miss\"}".into(), g(&self.cache[MISS])));
        metric(
            "ds4_cache_hits_total",
            "counter",
            "KV reuse outcome per request, by kind.",
            cache,
        );
        let sessions = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        metric(
            "ds4_session_tokens",
            "gauge",
            "Tokens held by each live session of the pool.",
            sessions
                .iter()
                .enumerate()
                .map(|(i, (t, _))| (format!("{{session=\"{i}\"}}"), *t as f64))
                .collect(),
        );
        metric(
            "ds4_session_kv_bytes",
            "gauge",
            "KV bytes held by each live session of the pool (where the engine reports them).",
            sessions
                .iter()
                .enumerate()
                .filter_map(|(i, (_, b))| b.map(|b| (format!("{{session=\"{i}\"}}"), b as f64)))
                .collect(),
        );
        self.step_rows.render(
            "ds4_decode_step_rows",
            "Rows (requests) per batched decode step.",
            &mut s,
        );
        self.ttft.render(
            "ds4_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            &mut s,
        );
        self.itl.render(
            "ds4_inter_token_seconds",
            "Time between consecutive generated tokens of one request.",
            &mut s,
        );
        s
    }
}
