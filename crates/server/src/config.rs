//! Command-line flags (server.md §2.9 and §4.4) and the resolved configuration.

use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser};

/// `ds4-server` flags. Names and defaults follow the reference server so its users can
/// switch; `--api-key`, `--queue-max`, `--max-body-mb` and `--fake-engine` are ours.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "ds4-server",
    version,
    about = "OpenAI/Anthropic-compatible server for DeepSeek V4 Flash"
)]
pub struct Args {
    /// Model GGUF.
    #[arg(short = 'm', long = "model", default_value = "ds4flash.gguf")]
    pub model: PathBuf,
    /// Context size in tokens.
    #[arg(short = 'c', long = "ctx", default_value_t = 32768, value_parser = positive)]
    pub ctx: usize,
    /// Default (and maximum) output tokens per request.
    #[arg(short = 'n', long = "tokens", default_value_t = 393216, value_parser = positive)]
    pub tokens: usize,
    /// Keep the routed experts of some layers in pinned host memory, read over the bus:
    /// `auto` (default) offloads as few layers as the GPU needs for the model and one
    /// --ctx session (none when it fits), N the last N layers' experts, 0 never.
    #[arg(
        long,
        value_name = "auto|N",
        default_value = "auto",
        allow_negative_numbers = true
    )]
    pub offload_experts: ds4_engine::Offload,
    /// Split the layers over these GPUs (e.g. `0,1`), in order; default: one GPU, or
    /// every visible GPU when the model does not fit one (no expert offload then).
    #[arg(long, value_name = "LIST")]
    pub gpus: Option<ds4_engine::GpuList>,
    /// Put the layers on GPUs by hand: `GPU:LAYERS` per stage, in the order they run,
    /// e.g. `0:0-20,1:21-42` (inclusive ranges, together every layer from 0 to the
    /// model's last once; a GPU at most once). Each stage keeps its last layers' experts
    /// in host memory when its card needs it (--offload-experts). Not with --gpus.
    #[arg(long, value_name = "GPU:LAYERS,...", conflicts_with = "gpus")]
    pub device_map: Option<ds4_engine::DeviceMap>,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long = "threads", value_parser = positive)]
    pub threads: Option<usize>,
    /// Exact f32 numerics instead of ds4's quantised activations.
    #[arg(long)]
    pub quality: bool,
    /// Compute backend: cpu or cuda (default: cuda when a GPU is usable).
    #[arg(long)]
    pub backend: Option<String>,
    /// Same as `--backend cpu`.
    #[arg(long, conflicts_with_all = ["backend", "cuda"])]
    pub cpu: bool,
    /// Same as `--backend cuda`.
    #[arg(long, conflicts_with = "backend")]
    pub cuda: bool,
    /// The reference's Apple Metal backend: not available in this build (exit 2).
    #[arg(long)]
    pub metal: bool,
    /// chdir before anything else, so relative paths resolve from DIR.
    #[arg(long)]
    pub chdir: Option<PathBuf>,
    /// Address to listen on (`0.0.0.0` for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// TCP port to listen on (bound before the model loads, so a busy port fails at once).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Add permissive CORS headers to every response.
    #[arg(long)]
    pub cors: bool,
    /// Per-request trace file (truncated at start).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Require this key as `Authorization: Bearer KEY` or `x-api-key: KEY` on /v1/*.
    /// Visible to every local user in `ps`: prefer --api-key-file or $DS4_API_KEY.
    #[arg(long, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from the first line of this file (keeps it out of `ps`).
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// Without an API key, also accept requests whose Host header names HOST (besides
    /// IP addresses, localhost and --host); repeatable, `*` accepts any. Guards against
    /// DNS rebinding.
    #[arg(long = "allow-host", value_name = "HOST")]
    pub allow_hosts: Vec<String>,
    /// Without an API key, also accept POSTs from browser pages of ORIGIN (e.g.
    /// `https://app.example`; besides localhost pages); repeatable, `*` accepts any.
    /// Guards against cross-site requests.
    #[arg(long = "allow-origin", value_name = "ORIGIN")]
    pub allow_origins: Vec<String>,
    /// Requests waiting for the engine beyond this many get 503.
    #[arg(long, default_value_t = 64, value_parser = positive)]
    pub queue_max: usize,
    /// Live KV sessions kept on the engine (the session pool), and so the most
    /// requests generating at once (continuous batching). Default: derived from the
    /// engine (4 on the CPU; 1 on CUDA until the backend sizes it from free memory);
    /// 1 with --mtp (speculative decoding is batch-1).
    #[arg(long, value_name = "N", value_parser = positive)]
    pub max_sessions: Option<usize>,
    /// Host-RAM tier of the session pool in MiB: sessions evicted from the pool are
    /// kept here (besides the disk KV cache) and come back without a disk read.
    /// 0: off.
    #[arg(long, value_name = "MB", default_value_t = 0)]
    pub kv_ram_mb: u64,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 64, value_parser = mebibytes)]
    pub max_body_mb: usize,
    /// Request bodies being received or parsed at once may hold at most this many MiB
    /// together; a body that does not fit gets 503 (parsing a body takes several times
    /// its size, so this bounds the memory of requests not yet queued).
    #[arg(long, default_value_t = 256, value_parser = mebibytes)]
    pub max_inflight_body_mb: usize,
    /// Most stop strings one request may give (`stop`, `stop_sequences`); more is a 400.
    #[arg(long, default_value_t = 32, value_parser = positive)]
    pub max_stops: usize,
    /// Longest stop string in bytes; longer is a 400. Stop matching costs about
    /// max-stops × max-stop-bytes per generated token on the engine thread.
    #[arg(long, default_value_t = 512, value_parser = positive)]
    pub max_stop_bytes: usize,
    /// Seconds between SSE keepalive comments while a stream waits (prefill).
    #[arg(long, default_value_t = 5, value_parser = seconds, hide = true)]
    pub keepalive_secs: u64,
    /// Most open client connections; beyond it the longest-idle one is closed to make
    /// room (so /health stays reachable), or the new one when all are busy.
    #[arg(long, default_value_t = 4096, value_parser = positive)]
    pub max_connections: usize,
    /// Seconds from a request's first byte until its headers must be complete; a slower
    /// client is disconnected.
    #[arg(long, default_value_t = 30, value_parser = seconds)]
    pub header_read_timeout_secs: u64,
    /// Seconds an idle keep-alive connection stays open without a request.
    #[arg(long, default_value_t = 60, value_parser = seconds)]
    pub idle_timeout_secs: u64,

    // Disk KV cache (§4.4).
    /// Directory of the disk KV cache (off when not given).
    #[arg(long)]
    pub kv_disk_dir: Option<PathBuf>,
    /// Disk KV cache budget in MiB; the oldest files are evicted beyond it.
    #[arg(long, default_value_t = 4096, value_parser = mebibytes)]
    pub kv_disk_space_mb: usize,
    /// Shortest prompt (tokens) worth saving to the disk cache.
    #[arg(long, default_value_t = 512, value_parser = positive)]
    pub kv_cache_min_tokens: usize,
    /// Longest prompt (tokens) saved before generation starts (0: no limit).
    #[arg(long, default_value_t = 30000)]
    pub kv_cache_cold_max_tokens: usize,
    /// Tokens between checkpoint saves during a long prefill (0: none).
    #[arg(long, default_value_t = 10000)]
    pub kv_cache_continued_interval_tokens: usize,
    /// Tokens dropped from the end of a saved prompt (the part that changes next turn).
    #[arg(long, default_value_t = 32)]
    pub kv_cache_boundary_trim_tokens: usize,
    /// Saved prompt lengths are rounded down to a multiple of this (0: no rounding).
    #[arg(long, default_value_t = 2048)]
    pub kv_cache_boundary_align_tokens: usize,
    /// Ignore cache files written with another quantisation instead of converting them.
    #[arg(long)]
    pub kv_cache_reject_different_quant: bool,
    /// Load only cache files with our integrity section (checksum and model
    /// fingerprint); the reference's files are skipped instead of trusted by shape.
    #[arg(long)]
    pub kv_cache_strict: bool,
    /// Tool-call ids remembered for exact DSML replay.
    #[arg(long, default_value_t = 100000, value_parser = positive)]
    pub tool_memory_max_ids: usize,
    /// Re-render earlier tool calls from JSON instead of replaying the exact DSML text.
    #[arg(long)]
    pub disable_exact_dsml_tool_replay: bool,

    /// MTP draft block (`ds4-tool download mtp`): speculative decoding, checked against
    /// the model at startup (a mismatched file is refused).
    #[arg(long)]
    pub mtp: Option<PathBuf>,
    /// MTP-drafted tokens verified per cycle, 1..=15 (default 1). The target's own next
    /// token comes on top: the reference's `--mtp-draft 2` is our 1.
    #[arg(long, value_parser = mtp_draft)]
    pub mtp_draft: Option<usize>,
    /// MTP confidence gate: drafting stops at a draft whose top-1 − top-2 logit margin is
    /// below this (default 3; 0 drafts always).
    #[arg(long, value_parser = mtp_margin)]
    pub mtp_margin: Option<f32>,
    /// Read the model file once at start so the weights sit in the page cache.
    #[arg(long)]
    pub warm_weights: bool,
    /// Directional steering: a flat f32 file of one direction per layer (n_layer ×
    /// n_embd, as `ds4-tool steer build` writes; the reference's dir-steering files).
    #[arg(long)]
    pub dir_steering_file: Option<PathBuf>,
    /// Steering scale after each FFN output (default 1 with a file): positive removes
    /// the direction, negative amplifies it, 0 is off.
    #[arg(long, value_parser = finite, allow_negative_numbers = true)]
    pub dir_steering_ffn: Option<f32>,
    /// Steering scale after each attention output (default 0: off).
    #[arg(long, value_parser = finite, allow_negative_numbers = true)]
    pub dir_steering_attn: Option<f32>,
    /// More log output on stderr: -v debug, -vv trace (RUST_LOG, when set, decides).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// Testing only: a scripted engine over this tokenizer.json instead of a model
    /// (deterministic replies, a DSML tool call when the user asks for weather).
    #[arg(long, hide = true)]
    pub fake_engine: Option<PathBuf>,
    /// Testing only: milliseconds the start-up load takes at least (to watch /health
    /// answer "loading").
    #[arg(long, hide = true, default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(..=600_000))]
    pub fake_load_ms: u64,
    /// Testing only: milliseconds the fake engine sleeps per token.
    #[arg(long, hide = true, default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(..=60_000))]
    pub fake_delay_ms: u64,
}

fn mtp_draft(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(v @ 1..=15) => Ok(v),
        Ok(_) => Err("must be 1 to 15".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn finite(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err("must be a finite number".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn mtp_margin(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(_) => Err("must be a finite number ≥ 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be greater than 0".into()),
        Ok(v) => Ok(v),
        Err(e) => Err(e.to_string()),
    }
}

/// A positive MiB count whose byte size fits (#18 item 10: a huge budget used to wrap
/// to 0 and evict the whole disk cache at start).
fn mebibytes(s: &str) -> Result<usize, String> {
    let v = positive(s)?;
    v.checked_mul(1 << 20)
        .and_then(|b| u64::try_from(b).ok())
        .map(|_| v)
        .ok_or_else(|| format!("{v} MiB does not fit in {} bits of bytes", usize::BITS))
}

/// Longest accepted time flag: a year; beyond it deadlines overflow `Instant`.
const MAX_SECS: u64 = 365 * 24 * 3600;

fn seconds(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be greater than 0".into()),
        Ok(v) if v > MAX_SECS => Err(format!("must be at most {MAX_SECS} (a year)")),
        Ok(v) => Ok(v),
        Err(e) => Err(e.to_string()),
    }
}

/// Connection limits of the accept loop (#18 item 1).
#[derive(Clone, Debug)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> ConnLimits {
        ConnLimits {
            max_connections: 4096,
            header_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Disk KV cache knobs (§4.4).
#[derive(Clone, Debug)]
pub struct KvDiskConfig {
    pub dir: PathBuf,
    pub budget_bytes: u64,
    pub min_tokens: usize,
    pub cold_max_tokens: usize,
    pub continued_interval: usize,
    pub trim: usize,
    pub align: usize,
    pub reject_different_quant: bool,
    /// `--kv-cache-strict`: skip files without an integrity section.
    pub strict: bool,
}

impl KvDiskConfig {
    /// A cache in `dir` for tests: 64 MiB, rows from 16 tokens, no continued saves,
    /// the reference's trim and alignment.
    pub fn for_tests(dir: PathBuf) -> KvDiskConfig {
        KvDiskConfig {
            dir,
            budget_bytes: 64 << 20,
            min_tokens: 16,
            cold_max_tokens: 30000,
            continued_interval: 0,
            trim: 32,
            align: 2048,
            reject_different_quant: false,
            strict: false,
        }
    }

    /// Continued-save spacing: the interval rounded up to the alignment (10000 → 10240).
    pub fn continued_step(&self) -> usize {
        if self.continued_interval == 0 {
            return 0;
        }
        if self.align == 0 {
            return self.continued_interval;
        }
        self.continued_interval.div_ceil(self.align) * self.align
    }

    /// Cold-save fallback length: trimmed and aligned down, when that stays ≥ min.
    pub fn store_len(&self, len: usize) -> usize {
        if len > self.min_tokens + self.trim {
            let x = len - self.trim;
            let x = x.checked_div(self.align).map_or(x, |q| q * self.align);
            if x >= self.min_tokens {
                return x;
            }
        }
        len
    }
}

/// Everything the server needs at run time.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub ctx: usize,
    pub max_tokens: usize,
    pub cors: bool,
    pub api_key: Option<String>,
    /// Host names and browser origins accepted without an API key (besides loopback).
    pub allowed_hosts: Vec<String>,
    pub allowed_origins: Vec<String>,
    pub queue_max: usize,
    pub max_body_bytes: usize,
    /// Bytes of request bodies being received or parsed at once, all requests together.
    pub max_inflight_body_bytes: usize,
    /// Stop-string limits per request: count and bytes each.
    pub max_stops: usize,
    pub max_stop_bytes: usize,
    pub keepalive: std::time::Duration,
    pub conn: ConnLimits,
    pub kv_disk: Option<KvDiskConfig>,
    pub tool_memory_max_ids: usize,
    pub exact_dsml_replay: bool,
    pub trace: Option<PathBuf>,
    /// `--max-sessions`; `None`: [`crate::worker::default_max_sessions`].
    pub max_sessions: Option<usize>,
    /// `--kv-ram-mb` in bytes (0: no RAM tier).
    pub kv_ram_bytes: u64,
}

impl ServerConfig {
    /// A configuration for tests: small context, no disk cache.
    pub fn for_tests(ctx: usize) -> ServerConfig {
        ServerConfig {
            ctx,
            max_tokens: 393216,
            cors: false,
            api_key: None,
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            queue_max: 64,
            max_body_bytes: 64 << 20,
            max_inflight_body_bytes: 256 << 20,
            max_stops: 32,
            max_stop_bytes: 512,
            keepalive: std::time::Duration::from_secs(5),
            conn: ConnLimits::default(),
            kv_disk: None,
            tool_memory_max_ids: 100000,
            exact_dsml_replay: true,
            trace: None,
            // One live session, as before the pool: the cache tests expect a second
            // conversation to evict the first. Pool tests raise it.
            max_sessions: Some(1),
            kv_ram_bytes: 0,
        }
    }
}

// The start-up path checks shared with ds4, ds4-tool and ds4-bench; included by path
// because this crate does not depend on ds4-cli (it needs only std, clap and libc).
#[path = "../../cli/src/paths.rs"]
pub mod paths;

impl Args {
    /// `--chdir` names a directory (checked before the server changes into it).
    pub fn check_chdir(&self) -> Result<(), clap::Error> {
        use paths::{validate, PathFlag, Want};
        match &self.chdir {
            Some(d) => validate(
                &mut Args::command(),
                &[PathFlag::new("chdir", d, Want::Dir)],
            ),
            None => Ok(()),
        }
    }

    /// #19 item 4: input files exist and outputs can be written, checked after
    /// `--chdir` and before the port is bound or the model loads; clap-style errors
    /// (exit with status 2).
    pub fn check_paths(&self) -> Result<(), clap::Error> {
        use paths::{validate, validate_model, PathFlag, Want};
        let mut cmd = Args::command();
        let flags = PathFlag::given(&[
            ("api_key_file", self.api_key_file.as_deref(), Want::File),
            ("mtp", self.mtp.as_deref(), Want::File),
            (
                "dir_steering_file",
                self.dir_steering_file.as_deref(),
                Want::File,
            ),
            ("fake_engine", self.fake_engine.as_deref(), Want::File),
            ("trace", self.trace.as_deref(), Want::OutFile),
            ("kv_disk_dir", self.kv_disk_dir.as_deref(), Want::OutDir),
        ]);
        validate(&mut cmd, &flags)?;
        if self.fake_engine.is_none() {
            validate_model(&mut cmd, "model", &self.model)?;
        }
        Ok(())
    }

    /// The API key: `--api-key`, else the first line of `--api-key-file`, else
    /// `$DS4_API_KEY` (#18 item 14: the flag shows in `ps`, the other two do not).
    pub fn resolve_api_key(&mut self) -> Result<(), String> {
        if let Some(p) = &self.api_key_file {
            let text = std::fs::read_to_string(p)
                .map_err(|e| format!("--api-key-file {}: {e}", p.display()))?;
            let key = text.lines().next().unwrap_or("").trim();
            if key.is_empty() {
                return Err(format!("--api-key-file {}: the file is empty", p.display()));
            }
            self.api_key = Some(key.to_string());
        }
        if self.api_key.is_none() {
            self.api_key = std::env::var("DS4_API_KEY").ok();
        }
        Ok(())
    }

    /// Checks cross-flag rules and builds the run-time configuration.
    pub fn to_config(&self) -> Result<ServerConfig, String> {
        if self.kv_cache_cold_max_tokens != 0
            && self.kv_cache_cold_max_tokens < self.kv_cache_min_tokens
        {
            return Err(format!(
                "--kv-cache-cold-max-tokens must be 0 or >= --kv-cache-min-tokens ({})",
                self.kv_cache_min_tokens
            ));
        }
        let align = self.kv_cache_boundary_align_tokens.max(1);
        if self
            .kv_cache_continued_interval_tokens
            .div_ceil(align)
            .checked_mul(align)
            .is_none()
        {
            return Err(
                "--kv-cache-continued-interval-tokens is too large for its alignment".into(),
            );
        }
        let kv_disk = self.kv_disk_dir.as_ref().map(|dir| KvDiskConfig {
            dir: dir.clone(),
            // `mebibytes` checked that this fits.
            budget_bytes: (self.kv_disk_space_mb as u64) << 20,
            min_tokens: self.kv_cache_min_tokens,
            cold_max_tokens: self.kv_cache_cold_max_tokens,
            continued_interval: self.kv_cache_continued_interval_tokens,
            trim: self.kv_cache_boundary_trim_tokens,
            align: self.kv_cache_boundary_align_tokens,
            reject_different_quant: self.kv_cache_reject_different_quant,
            strict: self.kv_cache_strict,
        });
        Ok(ServerConfig {
            ctx: self.ctx,
            max_tokens: self.tokens,
            cors: self.cors,
            api_key: self.api_key.clone().filter(|k| !k.is_empty()),
            allowed_hosts: std::iter::once(self.host.clone())
                .chain(self.allow_hosts.iter().cloned())
                .collect(),
            allowed_origins: self.allow_origins.clone(),
            queue_max: self.queue_max,
            max_body_bytes: self.max_body_mb << 20,
            keepalive: Duration::from_secs(self.keepalive_secs),
            conn: ConnLimits {
                max_connections: self.max_connections,
                header_read_timeout: Duration::from_secs(self.header_read_timeout_secs),
                idle_timeout: Duration::from_secs(self.idle_timeout_secs),
            },
            max_inflight_body_bytes: self.max_inflight_body_mb << 20,
            max_stops: self.max_stops,
            max_stop_bytes: self.max_stop_bytes,
            kv_disk,
            tool_memory_max_ids: self.tool_memory_max_ids,
            exact_dsml_replay: !self.disable_exact_dsml_tool_replay,
            trace: self.trace.clone(),
            max_sessions: self.max_sessions,
            kv_ram_bytes: self
                .kv_ram_mb
                .checked_mul(1 << 20)
                .ok_or("--kv-ram-mb is too large")?,
        })
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
