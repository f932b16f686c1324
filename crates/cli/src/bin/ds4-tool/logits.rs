//! `logits`: the f32 logits of every position of a token sequence, for comparisons
//! against other implementations (row-major positions × vocab, little-endian).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use ds4_cli::paths::{PathFlag, Want};
use ds4_engine::{BackendChoice, Engine, EngineOptions, Numerics};

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    Cpu,
    Cuda,
}

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF model.
    #[arg(short = 'm', long)]
    model: PathBuf,
    /// JSON file with the token ids: an array, or an object with a `tokens` array.
    #[arg(long)]
    tokens: PathBuf,
    /// Output file: positions × vocab little-endian f32.
    #[arg(long)]
    out: PathBuf,
    /// Backend (default: cpu; cuda is an error when no GPU is usable).
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    /// Exact f32 numerics (the official math) instead of ds4's quantised activations.
    #[arg(long)]
    quality: bool,
}

impl Args {
    /// The path flags checked before the model loads (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        vec![
            PathFlag::new("model", &self.model, Want::Model),
            PathFlag::new("tokens", &self.tokens, Want::File),
            PathFlag::new("out", &self.out, Want::OutFile),
        ]
    }
}

fn read_ids(path: &PathBuf) -> Result<Vec<u32>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let arr = match &v {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(o) => match o.get("tokens") {
            Some(serde_json::Value::Array(a)) => a,
            _ => bail!("{}: no \"tokens\" array", path.display()),
        },
        _ => bail!("{}: expected an array of token ids", path.display()),
    };
    arr.iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .with_context(|| format!("{}: {x} is not a token id", path.display()))
        })
        .collect()
}

pub fn run(a: Args) -> Result<()> {
    let ids = read_ids(&a.tokens)?;
    if ids.is_empty() {
        bail!("{}: no tokens", a.tokens.display());
    }
    let numerics = if a.quality {
        Numerics::Exact
    } else {
        Numerics::Fast
    };
    let backend = match a.backend {
        BackendArg::Cpu => BackendChoice::Cpu { threads: None },
        BackendArg::Cuda => BackendChoice::Cuda { device: 0 },
    };
    let engine = Engine::open(
        &a.model,
        EngineOptions {
            backend,
            numerics,
            ..EngineOptions::default()
        },
    )
    .with_context(|| format!("cannot load {}", a.model.display()))?;
    let vocab = engine.info().hparams.vocab;
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("token {t} is outside the vocabulary of {vocab}");
    }
    let mut session = engine.new_session(ids.len())?;
    let logits = session.prefill_all_logits(&ids)?;
    let mut w = std::io::BufWriter::new(
        std::fs::File::create(&a.out)
            .with_context(|| format!("cannot create {}", a.out.display()))?,
    );
    for v in &logits {
        w.write_all(&v.to_le_bytes())?;
    }
    w.flush()?;
    eprintln!(
        "{} positions × {vocab} logits ({} backend, {:?}) → {}",
        ids.len(),
        session.backend_name(),
        numerics,
        a.out.display()
    );
    Ok(())
}
