use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::builder::PossibleValuesParser;
use ds4_cli::download::{
    download, file_url, part_path, remove_if_empty, resolve_token, target, update_link,
    DownloadOptions, LinkUpdate, Outcome, DEFAULT_BASE_URL, HF_REPO, MODEL_LINK, TARGETS,
};
use ds4_cli::paths::{PathFlag, Want};
use ds4_gguf::GgufFile;
use indicatif::HumanBytes;

#[derive(clap::Args)]
#[command(after_help = targets_help())]
pub struct Args {
    /// What to download (see the list below).
    #[arg(value_parser = PossibleValuesParser::new(TARGETS.iter().map(|t| t.name)))]
    target: String,
    /// Download directory [default: $DS4_GGUF_DIR, else ./gguf].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Hugging Face token [default: $HF_TOKEN, else ~/.cache/huggingface/token].
    /// Prefer HF_TOKEN: a command-line argument is visible to other local users.
    #[arg(long)]
    token: Option<String>,
    /// Give up after this many failed attempts in a row without progress.
    #[arg(long, default_value_t = 5)]
    retries: u32,
    /// Do not open the downloaded file to check it is a GGUF.
    #[arg(long)]
    no_verify: bool,
    /// Do not point ./ds4flash.gguf at a downloaded main model.
    #[arg(long)]
    no_link: bool,
    /// Server to use instead of https://huggingface.co (tests) [env: DS4_DOWNLOAD_BASE_URL].
    #[arg(long, hide = true)]
    base_url: Option<String>,
    /// First retry delay in milliseconds, doubled on each failure in a row (tests).
    #[arg(long, hide = true, default_value_t = 2000)]
    retry_delay_ms: u64,
}

impl Args {
    /// The path flags checked before anything is fetched (#19 item 4).
    pub fn path_flags(&self) -> Vec<PathFlag<'_>> {
        self.dir
            .iter()
            .map(|d| PathFlag::new("dir", d, Want::OutDir))
            .collect()
    }
}

fn targets_help() -> String {
    let mut s = String::from("Targets:\n");
    for t in TARGETS {
        s += &format!("  {:<14} {:>8}  {}\n", t.name, t.size, t.about);
    }
    s += &format!(
        "\nFiles come from https://huggingface.co/{HF_REPO} and are written to\n\
         <dir>/<file>.part, then renamed when complete; an interrupted download resumes\n\
         when the same command is run again. After a main model, ./{MODEL_LINK} is\n\
         pointed at it."
    );
    s
}

fn env_nonempty(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

pub fn run(a: Args) -> Result<()> {
    let t = target(&a.target).expect("clap only accepts known targets");
    let dir = a
        .dir
        .or_else(|| env_nonempty("DS4_GGUF_DIR").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("gguf"));
    let base_url = a
        .base_url
        .or_else(|| env_nonempty("DS4_DOWNLOAD_BASE_URL"))
        .unwrap_or_else(|| DEFAULT_BASE_URL.to_owned());
    let dest = dir.join(t.file);
    let opts = DownloadOptions {
        url: file_url(&base_url, t.file),
        dest: dest.clone(),
        token: resolve_token(a.token.as_deref()),
        retries: a.retries,
        retry_delay: Duration::from_millis(a.retry_delay_ms),
        progress: true,
    };

    let already = std::fs::metadata(&dest).is_ok_and(|m| m.is_file() && m.len() > 0);
    if !already {
        println!("Downloading {} ({}) into {}", t.file, t.size, dir.display());
        println!("from {}", opts.url);
        let part = part_path(&dest);
        if let Ok(m) = std::fs::metadata(&part) {
            println!("resuming {} from {}", part.display(), HumanBytes(m.len()));
        }
        if opts.token.is_some() {
            println!("using a Hugging Face token");
        }
        println!("If the download stops, run the same command again to resume it.");
    }
    // Ctrl+C: the bytes fetched so far stay in the .part file for the next run; an
    // empty one is removed.
    let part = part_path(&dest);
    ctrlc::set_handler(move || {
        remove_if_empty(&part);
        match std::fs::metadata(&part) {
            Ok(m) => eprintln!(
                "\nds4-tool download: interrupted; {} of {} kept: run the same command again to resume",
                HumanBytes(m.len()),
                part.display()
            ),
            Err(_) => eprintln!("\nds4-tool download: interrupted"),
        }
        std::process::exit(130);
    })?;
    match download(&opts)? {
        Outcome::AlreadyPresent { bytes } => {
            println!(
                "Already downloaded: {} ({})",
                dest.display(),
                HumanBytes(bytes)
            )
        }
        Outcome::Downloaded {
            bytes,
            resumed_from,
        } => {
            let resumed = if resumed_from > 0 {
                format!(", resumed after {}", HumanBytes(resumed_from))
            } else {
                String::new()
            };
            println!(
                "Downloaded {} ({}{resumed})",
                dest.display(),
                HumanBytes(bytes)
            );
        }
    }

    if !a.no_verify {
        verify(&dest)?;
    }
    if t.main_model {
        if !a.no_link {
            let how = update_link(Path::new(MODEL_LINK), &dest)
                .context("the download is complete but the model link was not updated")?;
            let verb = match how {
                LinkUpdate::Created => "Linked",
                LinkUpdate::Replaced => "Relinked",
            };
            println!("{verb} ./{MODEL_LINK} -> {}", dest.display());
        }
    } else {
        println!(
            "MTP is an optional speculative-decoding component for the q2/q4 Flash models; \
             ./{MODEL_LINK} was not changed."
        );
        // Our --mtp-draft counts MTP-drafted tokens only (the reference's counts the
        // target's own token too: its 2 is our 1, the default), so none is printed.
        println!("Enable it explicitly, for example:");
        println!("  ds4 --mtp {}", dest.display());
        println!("  ds4-server --mtp {}", dest.display());
        println!(
            "(--mtp-draft N: tokens drafted per step, default 1 — the reference's --mtp-draft 2)"
        );
    }
    Ok(())
}

/// Opening the file parses and validates the whole GGUF header and tensor table, which
/// catches a wrong or truncated file in well under a second even for 150 GB.
fn verify(dest: &Path) -> Result<()> {
    let g = match GgufFile::open(dest) {
        Ok(g) => g,
        Err(e) => bail!(
            "{} is not a readable GGUF file: {e}. If the download was corrupted, delete it \
             and run the same command again",
            dest.display()
        ),
    };
    let arch = g
        .get_str("general.architecture")
        .map(|a| format!(", architecture {a}"))
        .unwrap_or_default();
    println!(
        "Verified GGUF v{}: {} tensors, {} metadata keys, {} of tensor data{arch}",
        g.version(),
        g.tensors().len(),
        g.metadata().len(),
        HumanBytes(g.tensor_bytes())
    );
    Ok(())
}
