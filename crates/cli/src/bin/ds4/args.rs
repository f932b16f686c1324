//! Command-line flags of `ds4`, compatible with the reference CLI (server.md §5).

use std::path::PathBuf;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};

pub const DEFAULT_SYSTEM: &str = "You are a helpful assistant";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The CPU reference backend (all cores unless -t).
    Cpu,
    /// One NVIDIA GPU (weights and KV in device memory).
    Cuda,
}

/// Reasoning mode of the assistant turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Think {
    /// `</think>`: answer directly.
    None,
    /// `<think>`: reason first (the default).
    High,
    /// `<think>` plus the Think Max paragraph after BOS (needs ctx ≥ 393216).
    Max,
}

impl Think {
    pub fn enabled(self) -> bool {
        self != Think::None
    }

    /// Max silently becomes High below the minimum context (server.md §1.3).
    pub fn effective(self, ctx: usize) -> Think {
        if self == Think::Max && ctx < ds4_tokenizer::chat::THINK_MAX_MIN_CONTEXT {
            Think::High
        } else {
            self
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Think::None => "off",
            Think::High => "high",
            Think::Max => "max",
        }
    }
}

const AFTER_HELP: &str = "\
Modes:
  ds4 -p TEXT            one-shot: answer TEXT and exit (or --prompt-file FILE)
  ds4                    interactive chat (type /help inside)
  ds4 -p TEXT --dump-tokens        print the prompt's token ids and exit (vocab only)
  ds4 -p TEXT --dump-logprobs F    greedy steps with top-k logprobs as JSON into F
  ds4 --perplexity-file F          teacher-forced NLL and perplexity of a text file
  ds4 --inspect                    model summary
  ds4 --imatrix-dataset F --imatrix-out OUT.dat   routed-expert imatrix (llama.cpp .dat)

A prompt that starts with <｜begin▁of▁sentence｜> is used verbatim as a rendered chat;
otherwise it becomes BOS, [Think Max text], system, <｜User｜>, prompt, <｜Assistant｜>,
<think> (or </think> with --nothink). Reasoning is printed in grey on a terminal.
Without the weights: `ds4-tool download q2-imatrix` fetches them and links ./ds4flash.gguf.
With `--mtp FILE` (from `ds4-tool download mtp`) generation is speculative: the final
line adds the MTP tokens per cycle and the draft acceptance.

Bad values and unknown options exit with status 2.";

#[derive(Parser, Debug)]
#[command(
    name = "ds4",
    version,
    about = "Chat with DeepSeek V4 Flash: one-shot prompts, an interactive session, scoring tools",
    after_help = AFTER_HELP
)]
pub struct Args {
    /// GGUF model file.
    #[arg(
        short = 'm',
        long,
        default_value = "ds4flash.gguf",
        value_name = "FILE"
    )]
    pub model: PathBuf,

    /// Prompt text (one-shot mode).
    #[arg(short = 'p', long, value_name = "TEXT", conflicts_with = "prompt_file")]
    pub prompt: Option<String>,

    /// Read the one-shot prompt from a file.
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,

    /// System prompt (`-sys` works too); "" sends none.
    #[arg(long = "system", value_name = "TEXT", default_value = DEFAULT_SYSTEM)]
    pub system: String,

    /// Maximum tokens to generate (clamped to the room left in the context).
    #[arg(short = 'n', long = "tokens", value_name = "N", default_value_t = 50000,
          value_parser = positive, allow_negative_numbers = true)]
    pub tokens: usize,

    /// Context size in tokens.
    #[arg(short = 'c', long = "ctx", value_name = "N", default_value_t = 32768,
          value_parser = positive, allow_negative_numbers = true)]
    pub ctx: usize,

    /// Sampling temperature in [0, 100]; 0 is greedy.
    #[arg(long, value_name = "F", default_value_t = 1.0,
          value_parser = |s: &str| float_in(s, 0.0, 100.0), allow_negative_numbers = true)]
    pub temp: f32,

    /// Nucleus sampling mass in [0, 1]; 1 is off.
    #[arg(long = "top-p", value_name = "F", default_value_t = 1.0,
          value_parser = |s: &str| float_in(s, 0.0, 1.0), allow_negative_numbers = true)]
    pub top_p: f32,

    /// Drop tokens below min-p × p(top token), in [0, 1].
    #[arg(long = "min-p", value_name = "F", default_value_t = 0.05,
          value_parser = |s: &str| float_in(s, 0.0, 1.0), allow_negative_numbers = true)]
    pub min_p: f32,

    /// Sampling seed (> 0; default: from the clock).
    #[arg(long, value_name = "N", value_parser = seed)]
    pub seed: Option<u64>,

    /// Reason before answering (the default).
    #[arg(long, overrides_with_all = ["think_max", "nothink"])]
    pub think: bool,

    /// Maximum reasoning effort (needs --ctx >= 393216, otherwise normal thinking).
    #[arg(long = "think-max", overrides_with_all = ["think", "nothink"])]
    pub think_max: bool,

    /// Answer directly, without reasoning.
    #[arg(long, overrides_with_all = ["think", "think_max"])]
    pub nothink: bool,

    /// MTP draft block GGUF (`ds4-tool download mtp`): speculative decoding — the same
    /// tokens at --temp 0, the same distribution otherwise, more tokens per step when
    /// the drafts are accepted.
    #[arg(long, value_name = "FILE")]
    pub mtp: Option<PathBuf>,

    /// Tokens the MTP block drafts per cycle, 1 to 16, verified in one multi-row step.
    /// The reference counts the verified token too: its --mtp-draft 2 is our 1.
    #[arg(long = "mtp-draft", value_name = "N", default_value_t = 1, allow_negative_numbers = true,
          value_parser = |s: &str| positive(s).and_then(|v| at_most(v, ds4_engine::MAX_DRAFT)))]
    pub mtp_draft: usize,

    /// MTP confidence gate: stop drafting at a draft whose top-2 logit gap is below F
    /// (that draft is not verified); 0 drafts always.
    #[arg(long = "mtp-margin", value_name = "F", default_value_t = 3.0,
          value_parser = non_negative, allow_negative_numbers = true)]
    pub mtp_margin: f32,

    /// CPU threads (default: all cores).
    #[arg(short = 't', long, value_name = "N", value_parser = positive, allow_negative_numbers = true)]
    pub threads: Option<usize>,

    /// Compute backend (default: cuda when a GPU is usable, else cpu).
    #[arg(long, value_enum, value_name = "NAME")]
    pub backend: Option<BackendArg>,

    /// Same as --backend cpu.
    #[arg(long, conflicts_with_all = ["backend", "cuda"])]
    pub cpu: bool,

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

    /// Same as --backend cuda.
    #[arg(long, conflicts_with = "backend")]
    pub cuda: bool,

    /// Exact f32 numerics (the official math) instead of ds4's quantised activations.
    #[arg(long)]
    pub quality: bool,

    /// Print the token ids of the prompt text as written (rendered-chat tokenizer) and exit.
    #[arg(long)]
    pub dump_tokens: bool,

    /// Run greedy steps and write each step's top logprobs as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub dump_logprobs: Option<PathBuf>,

    /// Alternatives per step in --dump-logprobs, 1 to 128.
    #[arg(long, value_name = "N", default_value_t = 20, allow_negative_numbers = true,
          value_parser = |s: &str| positive(s).and_then(|v| at_most(v, MAX_LOGPROBS_TOP_K)))]
    pub logprobs_top_k: usize,

    /// Score a raw text file: 32 context tokens, then up to -n teacher-forced tokens;
    /// prints `tokens= scored= nll= avg_nll= ppl=`.
    #[arg(long, value_name = "FILE")]
    pub perplexity_file: Option<PathBuf>,

    /// Print the model summary and exit.
    #[arg(long)]
    pub inspect: bool,

    /// Imatrix calibration prompts: rendered chats separated by `===== DS4_IMATRIX_PROMPT`
    /// lines (the reference's `rendered_prompts.txt`); needs --imatrix-out.
    #[arg(long, value_name = "FILE", requires = "imatrix_out")]
    pub imatrix_dataset: Option<PathBuf>,

    /// Collect the routed-expert imatrix over --imatrix-dataset and write it as a legacy
    /// llama.cpp .dat file.
    #[arg(long, value_name = "FILE", requires = "imatrix_dataset")]
    pub imatrix_out: Option<PathBuf>,

    /// Stop imatrix collection after N prompts (default: no limit).
    #[arg(long, value_name = "N", value_parser = positive, allow_negative_numbers = true)]
    pub imatrix_max_prompts: Option<usize>,

    /// Stop imatrix collection after N prompt tokens (default: no limit).
    #[arg(long, value_name = "N", value_parser = positive, allow_negative_numbers = true)]
    pub imatrix_max_tokens: Option<usize>,

    /// Directional steering: a flat f32 file of one direction per layer (n_layer ×
    /// n_embd, as `ds4-tool steer build` writes; the reference's dir-steering files).
    #[arg(long = "dir-steering-file", value_name = "FILE")]
    pub dir_steering_file: Option<PathBuf>,

    /// Steering scale after each FFN output (default 1 with a file): positive removes
    /// the direction, negative amplifies it, 0 is off.
    #[arg(long = "dir-steering-ffn", value_name = "F", value_parser = finite,
          allow_negative_numbers = true)]
    pub dir_steering_ffn: Option<f32>,

    /// Steering scale after each attention output (default 0: off).
    #[arg(long = "dir-steering-attn", value_name = "F", value_parser = finite,
          allow_negative_numbers = true)]
    pub dir_steering_attn: Option<f32>,

    /// Append a trace of each run to FILE (truncated at start): settings, rendered
    /// prompt, generated text, finish and timings (ds4-server's --trace layout).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,

    /// Read every weight page before the first token (with progress), so generation
    /// does not wait on the disk; on CUDA the upload already reads them (a no-op).
    #[arg(long = "warm-weights")]
    pub warm_weights: bool,

    /// The reference's Apple Metal backend: not available in this build (exit 2).
    #[arg(long)]
    pub metal: bool,

    /// (ds4-server's flag: refused with a pointer.)
    #[arg(long, hide = true)]
    pub server: bool,

    /// More log output on stderr: -v info, -vv debug (RUST_LOG, when set, decides).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count)]
    pub verbose: u8,
}

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(v) if v > 0 && v <= i32::MAX as usize => Ok(v),
        _ => Err(format!("expected a positive integer, got {s:?}")),
    }
}

/// `--logprobs-top-k` above this was clamped silently; now it is refused (#19 item 4).
pub const MAX_LOGPROBS_TOP_K: usize = 128;

fn at_most(v: usize, max: usize) -> Result<usize, String> {
    if v > max {
        return Err(format!("{v} is above the maximum {max}"));
    }
    Ok(v)
}

fn seed(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(format!("expected a positive integer, got {s:?}")),
    }
}

fn non_negative(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("expected a number >= 0, got {s:?}")),
    }
}

fn finite(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!("expected a finite number, got {s:?}")),
    }
}

fn float_in(s: &str, lo: f32, hi: f32) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && (lo..=hi).contains(&v) => Ok(v),
        _ => Err(format!("expected a number in [{lo}, {hi}], got {s:?}")),
    }
}

impl Args {
    /// Parses the process arguments; bad values exit with status 2.
    pub fn parse_env() -> Args {
        // The reference spells the system flag `-sys`; clap has no multi-letter shorts.
        let argv = std::env::args_os().map(|a| {
            if a == "-sys" {
                "--system".into()
            } else if let Some(v) = a.to_str().and_then(|s| s.strip_prefix("-sys=")) {
                format!("--system={v}").into()
            } else {
                a
            }
        });
        let args = Args::parse_from(argv);
        args.validate();
        args
    }

    fn validate(&self) {
        if self.server {
            fail(
                ErrorKind::UnknownArgument,
                "--server is not a ds4 option: use ds4-server",
            );
        }
        if self.metal {
            fail(
                ErrorKind::InvalidValue,
                "--metal: the Metal backend is not available in this build (use --cpu or --cuda)",
            );
        }
        if self.dir_steering_file.is_none()
            && [self.dir_steering_ffn, self.dir_steering_attn]
                .iter()
                .any(|s| s.is_some_and(|v| v != 0.0))
        {
            fail(
                ErrorKind::MissingRequiredArgument,
                "--dir-steering-ffn/--dir-steering-attn need --dir-steering-file",
            );
        }
        if self.dump_tokens && !self.has_prompt() {
            fail(
                ErrorKind::MissingRequiredArgument,
                "--dump-tokens needs -p or --prompt-file",
            );
        }
        if self.dump_logprobs.is_some() && !self.has_prompt() {
            fail(
                ErrorKind::MissingRequiredArgument,
                "--dump-logprobs needs -p or --prompt-file",
            );
        }
        if self.imatrix_out.is_some() && (self.has_prompt() || self.perplexity_file.is_some()) {
            fail(
                ErrorKind::ArgumentConflict,
                "--imatrix-out collects over its dataset: leave out -p/--prompt-file/--perplexity-file",
            );
        }
        if self.perplexity_file.is_some() && self.has_prompt() {
            fail(
                ErrorKind::ArgumentConflict,
                "--perplexity-file scores a file: leave out -p/--prompt-file",
            );
        }
        self.check_paths().unwrap_or_else(|e| e.exit());
    }

    /// #19 item 4: the files exist and the outputs can be written, before the model
    /// loads (minutes for the real one).
    fn check_paths(&self) -> Result<(), clap::Error> {
        use ds4_cli::paths::{validate, validate_model, PathFlag, Want};
        let mut cmd = Args::command();
        let flags = PathFlag::given(&[
            ("prompt_file", self.prompt_file.as_deref(), Want::File),
            ("mtp", self.mtp.as_deref(), Want::File),
            (
                "dir_steering_file",
                self.dir_steering_file.as_deref(),
                Want::File,
            ),
            ("trace", self.trace.as_deref(), Want::OutFile),
            (
                "perplexity_file",
                self.perplexity_file.as_deref(),
                Want::File,
            ),
            (
                "dump_logprobs",
                self.dump_logprobs.as_deref(),
                Want::OutFile,
            ),
            (
                "imatrix_dataset",
                self.imatrix_dataset.as_deref(),
                Want::File,
            ),
            ("imatrix_out", self.imatrix_out.as_deref(), Want::OutFile),
        ]);
        validate(&mut cmd, &flags)?;
        validate_model(&mut cmd, "model", &self.model)
    }

    pub fn has_prompt(&self) -> bool {
        self.prompt.is_some() || self.prompt_file.is_some()
    }

    pub fn think_mode(&self) -> Think {
        if self.nothink {
            Think::None
        } else if self.think_max {
            Think::Max
        } else {
            Think::High
        }
    }

    pub fn backend_choice(&self) -> Option<BackendArg> {
        if self.cpu {
            Some(BackendArg::Cpu)
        } else if self.cuda {
            Some(BackendArg::Cuda)
        } else {
            self.backend
        }
    }

    /// The prompt text of one-shot mode, if any (the file is read as is).
    pub fn prompt_text(&self) -> anyhow::Result<Option<String>> {
        if let Some(p) = &self.prompt {
            return Ok(Some(p.clone()));
        }
        match &self.prompt_file {
            Some(f) => Ok(Some(std::fs::read_to_string(f).map_err(|e| {
                anyhow::anyhow!("cannot read --prompt-file {}: {e}", f.display())
            })?)),
            None => Ok(None),
        }
    }
}

/// A usage error: message on stderr, exit status 2.
pub fn fail(kind: ErrorKind, msg: &str) -> ! {
    Args::command().error(kind, msg).exit()
}

// #19 item 4: every flag has `--help` text.
ds4_cli::every_argument_has_help_text!(Args);
