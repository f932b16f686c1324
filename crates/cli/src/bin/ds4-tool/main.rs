//! `ds4-tool`: model inspection, synthetic models, tokenizer and rendering debug tools.

mod download;
mod dump;
#[cfg(feature = "cuda")]
mod gpu_selftest;
mod inspect;
mod jsonl;
mod logits;
mod logprob_vectors;
mod quality;
mod quantize;
mod splice;
mod steer;
mod synth;
mod tokenize;

use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ds4-tool",
    version,
    about = "DeepSeek V4 Flash model tools: inspect GGUF files, write synthetic models, dump tensors"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// More log output on stderr: -v info, -vv debug (RUST_LOG, when set, decides).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    verbose: u8,
}

#[derive(Subcommand)]
enum Command {
    /// Print a GGUF's metadata, tensor table, bytes per type and the DS4 profile check.
    Inspect(inspect::Args),
    /// Write a synthetic DS4 model (random weights) in the exact published layout.
    Synth(synth::Args),
    /// Write one tensor dequantized to raw little-endian f32 (GGUF element order).
    DumpTensor(dump::Args),
    /// Check every CUDA kernel against the CPU on random inputs (and time them with --bench).
    #[cfg(feature = "cuda")]
    GpuSelftest(gpu_selftest::Args),
    /// Download a published GGUF from Hugging Face (resumable) and link ./ds4flash.gguf.
    Download(download::Args),
    /// Tokenize JSON Lines `{"text": …}` from stdin into `{"ids": […]}` lines.
    Tokenize(tokenize::TokenizeArgs),
    /// Render chat requests (encode_cases.jsonl schema) from stdin into `{"prompt": …}` lines.
    Render(tokenize::RenderArgs),
    /// Write the f32 logits of every position of a token sequence (positions × vocab, LE).
    Logits(logits::Args),
    /// Score a model on official continuations: target-token NLL, ppl, greedy match.
    Quality(quality::Args),
    /// Check a model against official top-logprob vectors (official.vec format).
    LogprobVectors(logprob_vectors::Args),
    /// Directional steering: `steer build` makes a direction file from paired prompt files.
    Steer(steer::Args),
    /// Build a DS4 GGUF (q2/q4 mix) from the official Hugging Face checkpoint.
    Quantize(quantize::Args),
    /// Mix two GGUFs: the routed experts of chosen layers from a donor (e.g. q4 into q2).
    Splice(splice::Args),
}

/// #19 item 4: the subcommand's files exist and its outputs can be written, checked
/// before any work; clap-style errors, status 2.
fn check_paths(cli: &Cli) -> Result<(), clap::Error> {
    let (name, flags) = match &cli.command {
        Command::Inspect(a) => ("inspect", a.path_flags()),
        Command::Synth(a) => ("synth", a.path_flags()),
        Command::DumpTensor(a) => ("dump-tensor", a.path_flags()),
        #[cfg(feature = "cuda")]
        Command::GpuSelftest(a) => ("gpu-selftest", a.path_flags()),
        Command::Download(a) => ("download", a.path_flags()),
        Command::Tokenize(a) => ("tokenize", a.path_flags()),
        Command::Render(_) => ("render", Vec::new()),
        Command::Logits(a) => ("logits", a.path_flags()),
        Command::Quality(a) => ("quality", a.path_flags()),
        Command::LogprobVectors(a) => ("logprob-vectors", a.path_flags()),
        Command::Steer(a) => return steer_paths(a),
        Command::Quantize(a) => ("quantize", a.path_flags()),
        Command::Splice(a) => ("splice", a.path_flags()),
    };
    let mut sub = Cli::command()
        .find_subcommand(name)
        .expect("the subcommand exists")
        .clone()
        .bin_name(format!("ds4-tool {name}"));
    ds4_cli::paths::validate(&mut sub, &flags)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    ds4_cli::logging::init(cli.verbose);
    check_paths(&cli).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Inspect(a) => inspect::run(a),
        Command::Synth(a) => synth::run(a),
        Command::DumpTensor(a) => dump::run(a),
        #[cfg(feature = "cuda")]
        Command::GpuSelftest(a) => gpu_selftest::run(a),
        Command::Download(a) => download::run(a),
        Command::Tokenize(a) => tokenize::run_tokenize(a),
        Command::Render(a) => tokenize::run_render(a),
        Command::Logits(a) => logits::run(a),
        Command::Quality(a) => quality::run(a),
        Command::LogprobVectors(a) => logprob_vectors::run(a),
        Command::Steer(a) => steer::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Splice(a) => splice::run(a),
    }
}

/// `check_paths` of `steer build` (a subcommand one level down).
fn steer_paths(a: &steer::Args) -> Result<(), clap::Error> {
    let mut sub = Cli::command()
        .find_subcommand("steer")
        .and_then(|s| s.find_subcommand("build").cloned())
        .expect("the subcommand exists")
        .bin_name("ds4-tool steer build");
    ds4_cli::paths::validate(&mut sub, &a.path_flags())
}

// #19 item 4: every flag has `--help` text.
ds4_cli::every_argument_has_help_text!(Cli);
