//! Resumable download of the published DeepSeek V4 Flash GGUF files from Hugging Face
//! (`ds4-tool download`), the Rust counterpart of the reference `download_model.sh`.
//!
//! The files are 80-150 GB, so every design choice favours surviving a flaky network:
//! bytes go to `<file>.part`, each attempt resumes with an HTTP `Range` from the size on
//! disk, transient failures are retried with backoff (and an attempt that made progress
//! resets the retry budget), and only a complete file is renamed to its final name, so a
//! final name on disk always means "finished".

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{HumanBytes, HumanDuration, ProgressBar, ProgressState, ProgressStyle};
use ureq::http::{HeaderMap, StatusCode};

/// The Hugging Face model repository holding the published files.
pub const HF_REPO: &str = "antirez/deepseek-v4-gguf";
/// Where files are fetched from unless `--base-url` / `DS4_DOWNLOAD_BASE_URL` says otherwise.
pub const DEFAULT_BASE_URL: &str = "https://huggingface.co";
/// The link the `ds4` programs open by default; points at the chosen main model.
pub const MODEL_LINK: &str = "ds4flash.gguf";

/// One downloadable file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Name on the command line.
    pub name: &'static str,
    /// File name in the Hugging Face repository.
    pub file: &'static str,
    /// Approximate size on disk, for the help text.
    pub size: &'static str,
    /// A complete main model (then `ds4flash.gguf` is pointed at it); false for the MTP
    /// component, which is only an add-on to a main model.
    pub main_model: bool,
    /// One-line description for the help text.
    pub about: &'static str,
}

/// Every target, in the order the help lists them.
pub const TARGETS: &[Target] = &[
    Target {
        name: "q2-imatrix",
        file: "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf",
        size: "~81 GB",
        main_model: true,
        about: "2-bit routed experts; recommended for 96 and 128 GB RAM machines",
    },
    Target {
        name: "q2-q4-imatrix",
        file: "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix-fixed.gguf",
        size: "~98 GB",
        main_model: true,
        about: "2-bit routed experts, 4-bit in the last 6 layers",
    },
    Target {
        name: "q4-imatrix",
        file: "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix.gguf",
        size: "~153 GB",
        main_model: true,
        about: "4-bit routed experts; for machines with 256 GB RAM or more",
    },
    Target {
        name: "q2",
        file: "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2.gguf",
        size: "~81 GB",
        main_model: true,
        about: "like q2-imatrix, quantised without an importance matrix",
    },
    Target {
        name: "q4",
        file: "DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2.gguf",
        size: "~153 GB",
        main_model: true,
        about: "like q4-imatrix, quantised without an importance matrix",
    },
    Target {
        name: "mtp",
        file: "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf",
        size: "~3.5 GB",
        main_model: false,
        about: "optional speculative-decoding component; enable with --mtp (ds4flash.gguf is left alone)",
    },
];

/// Looks a target up by its command-line name.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// `BASE/antirez/deepseek-v4-gguf/resolve/main/FILE`. The published names are plain ASCII
/// without reserved characters, so no percent-encoding is needed.
pub fn file_url(base_url: &str, file: &str) -> String {
    format!(
        "{}/{HF_REPO}/resolve/main/{file}",
        base_url.trim_end_matches('/')
    )
}

/// The token precedence of `download_model.sh`: the explicit option, then a non-empty
/// `HF_TOKEN`, then the token file `huggingface-cli login` writes. Kept free of any
/// environment access so it can be tested directly.
pub fn pick_token(
    explicit: Option<&str>,
    env_token: Option<&str>,
    token_file: Option<&str>,
) -> Option<String> {
    [explicit, env_token, token_file]
        .into_iter()
        .flatten()
        .map(str::trim)
        .find(|t| !t.is_empty())
        .map(str::to_owned)
}

/// Where `huggingface-cli login` stores the token: `$HF_HOME/token`, by default
/// `~/.cache/huggingface/token`.
pub fn hf_token_file() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("HF_HOME").filter(|h| !h.is_empty()) {
        return Some(PathBuf::from(home).join("token"));
    }
    let home = std::env::var_os("HOME").filter(|h| !h.is_empty())?;
    Some(PathBuf::from(home).join(".cache/huggingface/token"))
}

/// [`pick_token`] fed from the real environment.
pub fn resolve_token(explicit: Option<&str>) -> Option<String> {
    let env_token = std::env::var("HF_TOKEN").ok();
    let file_token = hf_token_file().and_then(|p| std::fs::read_to_string(p).ok());
    pick_token(explicit, env_token.as_deref(), file_token.as_deref())
}

/// A parsed `Content-Range` response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentRange {
    /// `bytes FIRST-LAST/TOTAL` (TOTAL is `None` when the server sent `*`).
    Bytes {
        first: u64,
        last: u64,
        total: Option<u64>,
    },
    /// `bytes */TOTAL`, sent with 416 to say how long the resource really is.
    Unsatisfied { total: u64 },
}

/// Parses `Content-Range` (RFC 9110 §14.4); `None` for anything malformed.
pub fn parse_content_range(value: &str) -> Option<ContentRange> {
    let rest = value.trim().strip_prefix("bytes")?.trim_start();
    let (range, total) = rest.split_once('/')?;
    let total = total.trim();
    if range.trim() == "*" {
        return Some(ContentRange::Unsatisfied {
            total: total.parse().ok()?,
        });
    }
    let (first, last) = range.trim().split_once('-')?;
    let (first, last): (u64, u64) = (first.parse().ok()?, last.parse().ok()?);
    if last < first {
        return None;
    }
    let total = if total == "*" {
        None
    } else {
        let t: u64 = total.parse().ok()?;
        if last >= t {
            return None;
        }
        Some(t)
    };
    Some(ContentRange::Bytes { first, last, total })
}

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

/// Why one attempt ended without a complete file.
enum Failure {
    /// Worth another attempt (network trouble, 5xx, 429, short body).
    Transient(anyhow::Error),
    /// Retrying cannot help (401/403/404, local I/O errors): report at once.
    Fatal(anyhow::Error),
}

fn transient(e: impl Into<anyhow::Error>) -> Failure {
    Failure::Transient(e.into())
}

fn fatal(e: impl Into<anyhow::Error>) -> Failure {
    Failure::Fatal(e.into())
}

/// Downloads `opts.url` to `opts.dest`, resuming any `.part` file left by an earlier run.
pub fn download(opts: &DownloadOptions) -> Result<Outcome> {
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
        eprintln!(
            "warning: {err:#}; retrying in {:.1}s (attempt {} of {})",
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

fn file_len(p: &Path) -> Result<u64> {
    match std::fs::metadata(p) {
        Ok(m) => Ok(m.len()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e).with_context(|| format!("cannot stat {}", p.display())),
    }
}

fn make_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        // Status codes are inspected by hand: 206/416 are part of resuming, and 4xx need
        // their own advice.
        .http_status_as_error(false)
        // A renamed repo redirects within huggingface.co and still needs the token; the
        // CDN redirect goes to another host with a signed URL and must not get it.
        .redirect_auth_headers(ureq::config::RedirectAuthHeaders::SameHost)
        .user_agent(concat!("ds4-tool/", env!("CARGO_PKG_VERSION")))
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(Duration::from_secs(120)))
        // No overall body timeout (a file takes hours), but a connection that stalls
        // for a minute is treated as dropped and resumed on a fresh one.
        .timeout_per_read(Some(Duration::from_secs(60)))
        .build()
        .into()
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    header(headers, "content-length").and_then(|v| v.trim().parse().ok())
}

/// Transport errors: retry all but the ones that are plainly configuration mistakes.
fn classify(url: &str, e: ureq::Error) -> Failure {
    use ureq::Error as E;
    match e {
        E::BadUri(_)
        | E::Http(_)
        | E::InvalidProxyUrl
        | E::RequireHttpsOnly(_)
        | E::TooManyRedirects
        | E::RedirectFailed => fatal(anyhow!(e).context(format!("cannot request {url}"))),
        e => transient(anyhow!(e).context(format!("network error requesting {url}"))),
    }
}

/// One request: resumes `part` from its current size. Returns the total size when the
/// server told it, after `part` holds that many bytes.
fn attempt(
    agent: &ureq::Agent,
    opts: &DownloadOptions,
    part: &Path,
    resumed_from: &mut u64,
) -> Result<Option<u64>, Failure> {
    let have = file_len(part).map_err(fatal)?;
    let mut req = agent
        .get(&opts.url)
        // A transparent gzip would make Range offsets refer to the encoded stream.
        .header("Accept-Encoding", "identity");
    if let Some(t) = &opts.token {
        req = req.header("Authorization", format!("Bearer {t}"));
    }
    if have > 0 {
        req = req.header("Range", format!("bytes={have}-"));
    }
    let resp = req.call().map_err(|e| classify(&opts.url, e))?;
    let status = resp.status();
    let headers = resp.headers().clone();

    let (start, total) = match status {
        StatusCode::OK => {
            if have > 0 {
                eprintln!(
                    "note: the server ignored the range request; restarting {} from zero",
                    part.display()
                );
            }
            (0, content_length(&headers))
        }
        StatusCode::PARTIAL_CONTENT => {
            match header(&headers, "content-range").and_then(parse_content_range) {
                // With `*` for the total, the end of this range is the best estimate; a
                // server that sends a shorter chunk than asked for is simply resumed.
                Some(ContentRange::Bytes { first, last, total }) if first == have => {
                    (have, Some(total.unwrap_or(last + 1)))
                }
                other => {
                    // A range other than the one asked for cannot be appended safely;
                    // drop the partial file and start over.
                    truncate(part).map_err(fatal)?;
                    return Err(transient(anyhow!(
                        "the server answered the range request from byte {have} with \
                         Content-Range {other:?}; restarting from zero"
                    )));
                }
            }
        }
        StatusCode::RANGE_NOT_SATISFIABLE => {
            return finish_416(agent, opts, part, have, &headers).map(Some);
        }
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
            let hint = if opts.token.is_some() {
                "the token that was sent was refused: check it is valid and has access to \
                 the repository (https://huggingface.co/settings/tokens)"
            } else {
                "no token was sent: pass --token TOKEN, set HF_TOKEN, or run \
                 `huggingface-cli login`"
            };
            return Err(fatal(anyhow!(
                "access denied (HTTP {}) for {}: {hint}",
                status.as_u16(),
                opts.url
            )));
        }
        StatusCode::NOT_FOUND => {
            let file = opts.url.rsplit('/').next().unwrap_or(&opts.url);
            return Err(fatal(anyhow!(
                "file not found (HTTP 404): {file} is not in the repository at {}; the \
                 published file names may have changed, see \
                 https://huggingface.co/{HF_REPO}/tree/main",
                opts.url
            )));
        }
        s if s == StatusCode::TOO_MANY_REQUESTS
            || s.is_server_error()
            || s == StatusCode::REQUEST_TIMEOUT =>
        {
            return Err(transient(anyhow!("HTTP {s} from {}", opts.url)));
        }
        s => return Err(fatal(anyhow!("unexpected HTTP {s} from {}", opts.url))),
    };

    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .open(part)
        .with_context(|| format!("cannot open {}", part.display()))
        .map_err(fatal)?;
    if start == 0 {
        file.set_len(0)
            .with_context(|| format!("cannot truncate {}", part.display()))
            .map_err(fatal)?;
        *resumed_from = 0;
    }
    file.seek(SeekFrom::Start(start))
        .with_context(|| format!("cannot seek in {}", part.display()))
        .map_err(fatal)?;

    let bar = progress_bar(opts.progress, total, start);
    let mut pos = start;
    let mut reader = resp.into_body().into_reader();
    let mut buf = vec![0u8; 1 << 20];
    let result = loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                break Err(transient(
                    anyhow!(e).context(format!("connection lost after byte {pos}")),
                ))
            }
        };
        if let Err(e) = file.write_all(&buf[..n]) {
            break Err(fatal(
                anyhow!(e).context(format!("cannot write {} (disk full?)", part.display())),
            ));
        }
        pos += n as u64;
        bar.set_position(pos);
    };
    bar.finish_and_clear();
    // Bytes written before an error are kept: they are exactly what the next Range resumes from.
    file.flush().map_err(fatal)?;
    result?;
    if let Some(t) = total {
        if pos != t {
            return Err(transient(anyhow!(
                "connection closed after {pos} of {t} bytes"
            )));
        }
    }
    Ok(total)
}

fn truncate(part: &Path) -> Result<()> {
    match std::fs::remove_file(part) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("cannot remove {}", part.display()))
        }
        _ => Ok(()),
    }
}

/// 416 on `Range: bytes=HAVE-` normally means the partial file is already complete (an
/// earlier run was interrupted between the last byte and the rename). That is only
/// accepted once the real total is known to equal HAVE.
fn finish_416(
    agent: &ureq::Agent,
    opts: &DownloadOptions,
    part: &Path,
    have: u64,
    headers: &HeaderMap,
) -> Result<u64, Failure> {
    let total = match header(headers, "content-range").and_then(parse_content_range) {
        Some(ContentRange::Unsatisfied { total }) => Some(total),
        Some(ContentRange::Bytes { total, .. }) => total,
        None => None,
    };
    let total = match total {
        Some(t) => t,
        None => remote_size(agent, opts)?,
    };
    if total == have {
        return Ok(total);
    }
    // The partial file is longer than the remote one: it belongs to another version of
    // the file and cannot be resumed.
    truncate(part).map_err(fatal)?;
    Err(transient(anyhow!(
        "{} has {have} bytes but the remote file has {total}; restarting from zero",
        part.display()
    )))
}

/// The size from a HEAD request (following redirects), for servers whose 416 omits it.
fn remote_size(agent: &ureq::Agent, opts: &DownloadOptions) -> Result<u64, Failure> {
    let mut req = agent.head(&opts.url).header("Accept-Encoding", "identity");
    if let Some(t) = &opts.token {
        req = req.header("Authorization", format!("Bearer {t}"));
    }
    let resp = req.call().map_err(|e| classify(&opts.url, e))?;
    if !resp.status().is_success() {
        return Err(transient(anyhow!(
            "HTTP {} for HEAD {}",
            resp.status(),
            opts.url
        )));
    }
    content_length(resp.headers()).ok_or_else(|| {
        fatal(anyhow!(
            "the server refused to resume {} and did not say how long the file is; \
             delete the .part file and run the same command again",
            opts.url
        ))
    })
}

fn progress_bar(enabled: bool, total: Option<u64>, start: u64) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    // Rate and ETA are averaged over this attempt's bytes only: indicatif's own estimator
    // would count the resumed bytes already on disk as if they had just arrived.
    let rate = move |s: &ProgressState| {
        let secs = s.elapsed().as_secs_f64();
        (secs > 0.5).then(|| s.pos().saturating_sub(start) as f64 / secs)
    };
    let style = |template: &str| {
        ProgressStyle::with_template(template)
            .expect("valid template")
            .progress_chars("=> ")
            .with_key("rate", move |s: &ProgressState, w: &mut dyn fmt::Write| {
                let _ = match rate(s) {
                    Some(r) => write!(w, "{}/s", HumanBytes(r as u64)),
                    None => write!(w, "-"),
                };
            })
            .with_key("eta", move |s: &ProgressState, w: &mut dyn fmt::Write| {
                let left = s.len().map(|l| l.saturating_sub(s.pos()));
                let _ = match (rate(s), left) {
                    (Some(r), Some(left)) if r > 0.0 => write!(
                        w,
                        "{}",
                        HumanDuration(Duration::from_secs_f64(left as f64 / r))
                    ),
                    _ => write!(w, "-"),
                };
            })
    };
    let bar = match total {
        Some(t) => ProgressBar::new(t).with_style(style(
            "{bytes:>10}/{total_bytes:<10} [{wide_bar}] {percent:>3}% {rate:>12} ETA {eta}",
        )),
        None => ProgressBar::no_length().with_style(style("{bytes:>10} {rate:>12} {elapsed}")),
    };
    bar.set_position(start);
    bar.reset_elapsed();
    bar
}

/// What happened to the link in [`update_link`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkUpdate {
    Created,
    Replaced,
}

/// Points the symlink `link` at `target`, atomically: a temporary link is created next to
/// it and renamed over it, so a reader sees the old or the new model, never no file.
/// Refuses to replace anything that is not a symlink (a real model file would be lost).
#[cfg(unix)]
pub fn update_link(link: &Path, target: &Path) -> Result<LinkUpdate> {
    let existed = match std::fs::symlink_metadata(link) {
        Ok(m) if m.file_type().is_symlink() => true,
        Ok(_) => bail!(
            "{} exists and is not a symlink, so it was left alone; move it away (or run \
             ds4 with -m {}), then run the same command again: the download will be \
             skipped and the link created",
            link.display(),
            target.display()
        ),
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(e).with_context(|| format!("cannot stat {}", link.display())),
    };
    let name = link
        .file_name()
        .ok_or_else(|| anyhow!("bad link path {}", link.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = link.with_file_name(tmp_name);
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)
        .with_context(|| format!("cannot create the symlink {}", tmp.display()))?;
    if let Err(e) = std::fs::rename(&tmp, link) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot replace {}", link.display()));
    }
    Ok(if existed {
        LinkUpdate::Replaced
    } else {
        LinkUpdate::Created
    })
}

#[cfg(not(unix))]
pub fn update_link(link: &Path, target: &Path) -> Result<LinkUpdate> {
    bail!(
        "symlinks are not supported here: run ds4 with -m {} instead of relying on {}",
        target.display(),
        link.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_unique_and_point_at_gguf_files() {
        for (i, t) in TARGETS.iter().enumerate() {
            assert!(t.file.ends_with(".gguf"), "{}", t.file);
            assert!(TARGETS[i + 1..]
                .iter()
                .all(|u| u.name != t.name && u.file != t.file));
            assert_eq!(target(t.name), Some(t));
        }
        assert!(!target("mtp").unwrap().main_model);
        assert!(target("q2-imatrix").unwrap().main_model);
        assert_eq!(target("q8"), None);
    }

    #[test]
    fn url_layout_matches_hugging_face() {
        assert_eq!(
            file_url("https://huggingface.co/", "a.gguf"),
            "https://huggingface.co/antirez/deepseek-v4-gguf/resolve/main/a.gguf"
        );
        assert_eq!(
            file_url("http://127.0.0.1:9", "b.gguf"),
            "http://127.0.0.1:9/antirez/deepseek-v4-gguf/resolve/main/b.gguf"
        );
    }

    #[test]
    fn token_precedence() {
        assert_eq!(
            pick_token(Some("a"), Some("b"), Some("c")).as_deref(),
            Some("a")
        );
        assert_eq!(pick_token(None, Some("b"), Some("c")).as_deref(), Some("b"));
        assert_eq!(
            pick_token(None, Some(""), Some("c\n")).as_deref(),
            Some("c")
        );
        assert_eq!(pick_token(None, None, Some("  \n")), None);
        assert_eq!(pick_token(None, None, None), None);
    }

    #[test]
    fn content_range() {
        assert_eq!(
            parse_content_range("bytes 100-199/200"),
            Some(ContentRange::Bytes {
                first: 100,
                last: 199,
                total: Some(200)
            })
        );
        assert_eq!(
            parse_content_range("bytes 0-9/*"),
            Some(ContentRange::Bytes {
                first: 0,
                last: 9,
                total: None
            })
        );
        assert_eq!(
            parse_content_range("bytes */86720111488"),
            Some(ContentRange::Unsatisfied { total: 86720111488 })
        );
        for bad in [
            "",
            "bytes",
            "bytes 5-4/10",
            "bytes 0-10/10",
            "items 0-1/2",
            "bytes */*",
        ] {
            assert_eq!(parse_content_range(bad), None, "{bad}");
        }
    }

    #[test]
    fn part_path_appends_suffix() {
        assert_eq!(
            part_path(Path::new("gguf/x.gguf")),
            PathBuf::from("gguf/x.gguf.part")
        );
    }
}
