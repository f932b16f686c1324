//! Command-line flags (server.md §2.9 and §4.4) and the resolved configuration.

use std::path::PathBuf;

use clap::Parser;

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
    /// CPU threads (default: all cores).
    #[arg(short = 't', long = "threads", value_parser = positive)]
    pub threads: Option<usize>,
    /// Exact f32 numerics instead of ds4's quantised activations.
    #[arg(long)]
    pub quality: bool,
    /// Compute backend: cpu or cuda (default: cuda when a GPU is usable).
    #[arg(long)]
    pub backend: Option<String>,
    #[arg(long, conflicts_with_all = ["backend", "cuda"])]
    pub cpu: bool,
    #[arg(long, conflicts_with = "backend")]
    pub cuda: bool,
    /// Not supported on this engine (Apple only); rejected with a message.
    #[arg(long)]
    pub metal: bool,
    /// chdir before anything else, so relative paths resolve from DIR.
    #[arg(long)]
    pub chdir: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Add permissive CORS headers to every response.
    #[arg(long)]
    pub cors: bool,
    /// Per-request trace file (truncated at start).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Require this key as `Authorization: Bearer KEY` or `x-api-key: KEY` on /v1/*
    /// (default: $DS4_API_KEY).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests waiting for the engine beyond this many get 503.
    #[arg(long, default_value_t = 64, value_parser = positive)]
    pub queue_max: usize,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 64, value_parser = positive)]
    pub max_body_mb: usize,
    /// Seconds between SSE keepalive comments while a stream waits (prefill).
    #[arg(long, default_value_t = 5, value_parser = positive, hide = true)]
    pub keepalive_secs: usize,

    // Disk KV cache (§4.4).
    #[arg(long)]
    pub kv_disk_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 4096, value_parser = positive)]
    pub kv_disk_space_mb: usize,
    #[arg(long, default_value_t = 512, value_parser = positive)]
    pub kv_cache_min_tokens: usize,
    #[arg(long, default_value_t = 30000)]
    pub kv_cache_cold_max_tokens: usize,
    #[arg(long, default_value_t = 10000)]
    pub kv_cache_continued_interval_tokens: usize,
    #[arg(long, default_value_t = 32)]
    pub kv_cache_boundary_trim_tokens: usize,
    #[arg(long, default_value_t = 2048)]
    pub kv_cache_boundary_align_tokens: usize,
    #[arg(long)]
    pub kv_cache_reject_different_quant: bool,
    /// Load only cache files with our integrity section (checksum and model
    /// fingerprint); the reference's files are skipped instead of trusted by shape.
    #[arg(long)]
    pub kv_cache_strict: bool,
    #[arg(long, default_value_t = 100000, value_parser = positive)]
    pub tool_memory_max_ids: usize,
    #[arg(long)]
    pub disable_exact_dsml_tool_replay: bool,

    // Accepted for command-line compatibility with the reference; not implemented here.
    #[arg(long)]
    pub mtp: Option<PathBuf>,
    #[arg(long, value_parser = positive)]
    pub mtp_draft: Option<usize>,
    #[arg(long)]
    pub mtp_margin: Option<f32>,
    #[arg(long)]
    pub warm_weights: bool,
    #[arg(long)]
    pub dir_steering_file: Option<PathBuf>,
    #[arg(long)]
    pub dir_steering_ffn: Option<f32>,
    #[arg(long)]
    pub dir_steering_attn: Option<f32>,
    /// More log output on stderr: -v debug, -vv trace (RUST_LOG, when set, decides).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// Testing only: a scripted engine over this tokenizer.json instead of a model
    /// (deterministic replies, a DSML tool call when the user asks for weather).
    #[arg(long, hide = true)]
    pub fake_engine: Option<PathBuf>,
    /// Testing only: milliseconds the fake engine sleeps per token.
    #[arg(long, hide = true, default_value_t = 0)]
    pub fake_delay_ms: u64,
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be greater than 0".into()),
        Ok(v) => Ok(v),
        Err(e) => Err(e.to_string()),
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
    pub queue_max: usize,
    pub max_body_bytes: usize,
    pub keepalive: std::time::Duration,
    pub kv_disk: Option<KvDiskConfig>,
    pub tool_memory_max_ids: usize,
    pub exact_dsml_replay: bool,
    pub trace: Option<PathBuf>,
}

impl ServerConfig {
    /// A configuration for tests: small context, no disk cache.
    pub fn for_tests(ctx: usize) -> ServerConfig {
        ServerConfig {
            ctx,
            max_tokens: 393216,
            cors: false,
            api_key: None,
            queue_max: 64,
            max_body_bytes: 64 << 20,
            keepalive: std::time::Duration::from_secs(5),
            kv_disk: None,
            tool_memory_max_ids: 100000,
            exact_dsml_replay: true,
            trace: None,
        }
    }
}

impl Args {
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
        let kv_disk = self.kv_disk_dir.as_ref().map(|dir| KvDiskConfig {
            dir: dir.clone(),
            budget_bytes: self.kv_disk_space_mb as u64 * 1024 * 1024,
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
            queue_max: self.queue_max,
            max_body_bytes: self.max_body_mb << 20,
            keepalive: std::time::Duration::from_secs(self.keepalive_secs as u64),
            kv_disk,
            tool_memory_max_ids: self.tool_memory_max_ids,
            exact_dsml_replay: !self.disable_exact_dsml_tool_replay,
            trace: self.trace.clone(),
        })
    }
}
