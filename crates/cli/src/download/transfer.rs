//! One file's download from start to finish: the `.part` file, the retry loop with
//! backoff, and the rename once complete.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::http::{attempt, make_agent, Failure};

/// How one download is done.
#[derive(Debug, Clone)]
pub struct DownloadOptions {
    pub url: String,
    /// The final path; bytes go to `<dest>.part` until complete.
    pub dest: PathBuf,
    /// Sent as `Authorization: Bearer`; never printed.
    pub token: Option<String>,
    /// Consecutive failed attempts (without any new bytes) tolerated before giving up.
    pub retries: u32,
    /// First backoff delay; doubled after each consecutive failure, capped at a minute.
    pub retry_delay: Duration,
    /// Draw an indicatif progress bar on stderr (it hides itself when stderr is no terminal).
    pub progress: bool,
}

/// What [`download`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The final file already existed and was not empty; nothing was fetched.
    AlreadyPresent { bytes: u64 },
    /// The file is now complete; `resumed_from` bytes of it came from an earlier run's
    /// `.part` file (0 when the server made us start over).
    Downloaded { bytes: u64, resumed_from: u64 },
}

/// `<dest>.part`.
pub fn part_path(dest: &Path) -> PathBuf {
    let mut p = dest.as_os_str().to_owned();
    p.push(".part");
    PathBuf::from(p)
}

/// Downloads `opts.url` to `opts.dest`, resuming any `.part` file left by an earlier run.
///
/// On an error the `.part` file is kept when it holds bytes (the next run resumes from
/// them: they may be hours of transfer) and removed when it is empty.
pub fn download(opts: &DownloadOptions) -> Result<Outcome> {
    let result = download_inner(opts);
    if result.is_err() {
        remove_if_empty(&part_path(&opts.dest));
    }
    result
}

/// Removes `part` when it exists and holds no bytes (nothing to resume from).
pub fn remove_if_empty(part: &Path) {
    if std::fs::metadata(part).is_ok_and(|m| m.is_file() && m.len() == 0) {
        let _ = std::fs::remove_file(part);
    }
}

fn download_inner(opts: &DownloadOptions) -> Result<Outcome> {
    if let Ok(m) = std::fs::metadata(&opts.dest) {
        if m.is_file() && m.len() > 0 {
            return Ok(Outcome::AlreadyPresent { bytes: m.len() });
        }
    }
    if let Some(dir) = opts.dest.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the download directory {}", dir.display()))?;
    }
    let part = part_path(&opts.dest);
    // Lowered to 0 by `attempt` when a server ignores Range and the old bytes are dropped.
    let mut resumed_from = file_len(&part)?;
    let agent = make_agent();

    let mut failures = 0u32;
    let total = loop {
        let before = file_len(&part)?;
        let err = match attempt(&agent, opts, &part, &mut resumed_from) {
            Ok(total) => break total,
            Err(Failure::Fatal(e)) => return Err(e),
            Err(Failure::Transient(e)) => e,
        };
        // Multi-hour downloads see many unrelated hiccups: only failures in a row with
        // no new bytes in between count against the budget, so a link that keeps
        // dropping yet keeps advancing still finishes.
        if file_len(&part)? > before {
            failures = 0;
        }
        failures += 1;
        if failures > opts.retries {
            let kept = match file_len(&part)? {
                0 => "nothing was downloaded yet: check the network connection, then".to_owned(),
                n => format!("the {n} bytes in {} are kept:", part.display()),
            };
            return Err(err.context(format!(
                "download of {} failed after {failures} attempts in a row; {kept} run the \
                 same command again to resume",
                opts.url,
            )));
        }
        let delay = opts
            .retry_delay
            .saturating_mul(1u32 << (failures - 1).min(16))
            .min(Duration::from_secs(60));
        tracing::warn!(
            "{err:#}; retrying in {:.1}s (attempt {} of {})",
            delay.as_secs_f64(),
            failures + 1,
            opts.retries + 1
        );
        std::thread::sleep(delay);
    };

    let len = file_len(&part)?;
    if let Some(t) = total {
        // `attempt` already checked this; a second look costs nothing and guards the rename.
        if len != t {
            bail!(
                "{} has {len} bytes but the server reports {t}",
                part.display()
            );
        }
    }
    // Make the bytes durable before the name says "complete".
    File::open(&part)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("cannot sync {}", part.display()))?;
    std::fs::rename(&part, &opts.dest).with_context(|| {
        format!(
            "cannot rename {} to {}",
            part.display(),
            opts.dest.display()
        )
    })?;
    Ok(Outcome::Downloaded {
        bytes: len,
        resumed_from,
    })
}

pub(super) fn file_len(p: &Path) -> Result<u64> {
    match std::fs::metadata(p) {
        Ok(m) => Ok(m.len()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e).with_context(|| format!("cannot stat {}", p.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_path_appends_suffix() {
        assert_eq!(
            part_path(Path::new("gguf/x.gguf")),
            PathBuf::from("gguf/x.gguf.part")
        );
    }
}
