//! One HTTP request of a download: the `Range` header, the status codes that mean
//! "resume", "start over", "retry later" or "give up", and the body written to the
//! `.part` file.

use std::fs::OpenOptions;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use ureq::http::{HeaderMap, StatusCode};

use super::progress::progress_bar;
use super::range::{parse_content_range, ContentRange};
use super::transfer::{file_len, DownloadOptions};
use super::HF_REPO;

/// Why one attempt ended without a complete file.
pub(super) enum Failure {
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

pub(super) fn make_agent() -> ureq::Agent {
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
pub(super) fn attempt(
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
                tracing::warn!(
                    "the server ignored the range request; restarting {} from zero",
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

    if let Some(t) = total {
        // #19 item 4: refuse before writing rather than filling the disk hours in. The
        // bytes already in `part` stay (resumed) or are freed (restart): either way only
        // the rest is new.
        crate::disk::ensure_free_space(part, t.saturating_sub(have)).map_err(fatal)?;
    }
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
