//! `ds4-tool`: model inspection, synthetic models, tokenizer and rendering debug tools.
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ds4-tool", version, about = "DeepSeek V4 Flash model tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {}
}
