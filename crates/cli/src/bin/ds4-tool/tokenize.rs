//! `tokenize` and `render`: JSON Lines filters over stdin/stdout, backed by ds4-tokenizer.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use ds4_cli::paths::{PathFlag, Want};
use ds4_tokenizer::Tokenizer;

use crate::jsonl;

#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// A GGUF file (reads `tokenizer.ggml.*`) or a Hugging Face tokenizer.json.
    #[arg(long)]
    pub tokenizer: PathBuf,
}

#[derive(clap::Args)]
pub struct RenderArgs {}

impl TokenizeArgs {
    /// The path flags checked before stdin is read (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        vec![PathFlag::new("tokenizer", &self.tokenizer, Want::File)]
    }
}

/// Loads a tokenizer from a GGUF's metadata or from a tokenizer.json, by magic bytes.
pub fn load_tokenizer(path: &Path) -> anyhow::Result<Tokenizer> {
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let is_gguf = f.read_exact(&mut magic).is_ok() && &magic == b"GGUF";
    if !is_gguf {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        return Ok(Tokenizer::from_tokenizer_json(&bytes)?);
    }
    ds4_engine::load_tokenizer(path).with_context(|| path.display().to_string())
}

fn io() -> (impl BufRead, impl Write) {
    (
        BufReader::new(std::io::stdin().lock()),
        std::io::BufWriter::new(std::io::stdout().lock()),
    )
}

pub fn run_tokenize(a: TokenizeArgs) -> anyhow::Result<()> {
    let tok = load_tokenizer(&a.tokenizer)?;
    let (r, mut w) = io();
    jsonl::run_tokenize(r, &mut w, &tok)?;
    w.flush()?;
    Ok(())
}

pub fn run_render(_: RenderArgs) -> anyhow::Result<()> {
    let (r, mut w) = io();
    jsonl::run_render(r, &mut w)?;
    w.flush()?;
    Ok(())
}
