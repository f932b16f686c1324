//! The disk KV cache (server.md §4.4): KVC files (layout in `format.rs`) named by the
//! SHA-1 of their key text.
//!
//! Files are written to `<name>.kv.tmp.<pid>`, fsynced and renamed (then the directory is
//! fsynced), so a crash never leaves a torn file under a valid name; temp files of dead
//! processes are removed at start-up. A `.kv` file that fails a check (header, size,
//! checksum, model fingerprint, payload) is deleted with a log line, so it is never
//! retried, also not after a restart.

use std::collections::HashSet;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha1::{Digest, Sha1};

pub use super::format::{
    decode_tool_map, encode_tool_map, parse_file, Header, Integrity, EXT_INTEGRITY, EXT_TOOL_MAP,
    HEADER_LEN, INTEGRITY_LEN,
};
use crate::config::KvDiskConfig;
use crate::engine::EngineBackend;
use crate::log;

/// Hit-decay half-life in seconds (6 h, fixed).
const HALF_LIFE: f64 = 21600.0;
/// A temp file of a live process older than this is a leftover of a recycled pid.
const STALE_TMP: Duration = Duration::from_secs(3600);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveReason {
    Unknown = 0,
    Cold = 1,
    Continued = 2,
    Evict = 3,
    Shutdown = 4,
}

impl SaveReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SaveReason::Unknown => "unknown",
            SaveReason::Cold => "cold",
            SaveReason::Continued => "continued",
            SaveReason::Evict => "evict",
            SaveReason::Shutdown => "shutdown",
        }
    }
}

/// SHA-1 of `text`, lowercase hex.
pub fn sha1_hex(text: &[u8]) -> String {
    let d = Sha1::digest(text);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `size + ceil(size / 100) <= budget`: a file must leave 1 % headroom.
pub fn fits_budget(size: u64, budget: u64) -> bool {
    size + size.div_ceil(100) <= budget
}

/// Eviction score (§4.4): higher is more worth keeping.
pub fn score(h: &Header, file_size: u64, now: u64) -> f64 {
    let last = if h.last_used > 0 {
        h.last_used
    } else {
        h.created
    };
    let age = now.saturating_sub(last) as f64;
    let mut eff = h.hits as f64 * (-age / HALF_LIFE).exp2();
    if eff < 0.01 {
        eff = 0.0;
    }
    (eff + 1.0) * h.tokens as f64 / file_size.max(1) as f64
}

#[derive(Clone, Debug)]
pub struct Entry {
    pub path: PathBuf,
    pub name: String,
    pub header: Header,
    pub file_size: u64,
}

/// A successful lookup.
#[derive(Clone, Debug)]
pub struct Hit {
    /// Bytes of the request text covered by the checkpoint.
    pub key_len: usize,
    pub tokens: usize,
    pub path: PathBuf,
    /// The file's ext flags (bit1: Responses visible key, bit2: thinking visible key).
    pub ext: u8,
}

impl Hit {
    /// What the key text is (log lines and the trace).
    pub fn key_kind(&self) -> &'static str {
        key_kind(self.ext)
    }
}

/// `token-text`, `responses-visible` or `thinking-visible` from the ext flags.
pub fn key_kind(ext: u8) -> &'static str {
    if ext & crate::bindings::EXT_RESPONSES_VISIBLE != 0 {
        "responses-visible"
    } else if ext & crate::bindings::EXT_THINKING_VISIBLE != 0 {
        "thinking-visible"
    } else {
        "token-text"
    }
}

pub struct DiskCache {
    pub cfg: KvDiskConfig,
    ctx: usize,
    quant: u8,
    /// The model's identity, written into and checked against integrity sections.
    fingerprint: [u8; 32],
    /// Files already reported as skipped (log once each).
    reported: Mutex<HashSet<String>>,
}

impl DiskCache {
    /// Prepares the directory (never changing the mode of an existing one), removes
    /// temp files that crashed writers left, and trims the cache to its budget.
    pub fn open(
        cfg: KvDiskConfig,
        ctx: usize,
        quant: u8,
        fingerprint: [u8; 32],
    ) -> std::io::Result<DiskCache> {
        let mut cfg = cfg;
        cfg.dir = prepare_dir(&cfg.dir)?;
        let c = DiskCache {
            cfg,
            ctx,
            quant,
            fingerprint,
            reported: Mutex::new(HashSet::new()),
        };
        c.remove_stale_temps();
        c.evict(None);
        Ok(c)
    }

    fn report(&self, name: &str, why: &str) {
        let mut r = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        if r.insert(format!("{name}:{why}")) {
            log!("kv cache: ignoring {name}: {why}");
        }
    }

    /// Deletes a `.kv` file that failed a check: it can never load, and keeping it would
    /// make every matching request (and every restart) try it again.
    fn quarantine(&self, path: &Path, why: &str) {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        match fs::remove_file(path) {
            Ok(()) => log!("kv cache: deleted invalid {name}: {why}"),
            Err(e) => self.report(&name, &format!("{why} (cannot delete: {e})")),
        }
    }

    /// `<name>.kv.tmp.<pid>` files whose writer is gone (not alive, or the pid is ours:
    /// nothing is being written while the cache opens) or that are older than an hour.
    fn remove_stale_temps(&self) {
        let me = std::process::id();
        for (path, pid, age) in temp_files(&self.cfg.dir) {
            if pid == me || !pid_alive(pid) || age > STALE_TMP {
                log!("kv cache: removing stale temp file {}", path.display());
                let _ = fs::remove_file(&path);
            }
        }
    }

    /// Valid entries (`<40 hex>.kv` with a good header and a large enough file); files
    /// with a bad header or too short are deleted.
    pub fn scan(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        let Ok(rd) = fs::read_dir(&self.cfg.dir) else {
            return out;
        };
        for de in rd.flatten() {
            let fname = de.file_name().to_string_lossy().into_owned();
            let Some(name) = fname.strip_suffix(".kv") else {
                continue;
            };
            if name.len() != 40
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            {
                continue;
            }
            let path = de.path();
            let mut head = [0u8; HEADER_LEN];
            let res = fs::File::open(&path).and_then(|mut f| {
                let size = f.metadata()?.len();
                let n = read_up_to(&mut f, &mut head)?;
                Ok((size, n))
            });
            let (size, n) = match res {
                Ok(x) => x,
                Err(e) => {
                    self.report(&fname, &e.to_string());
                    continue;
                }
            };
            match Header::decode(&head[..n]) {
                Ok(h) if size >= h.min_file_len() => out.push(Entry {
                    path,
                    name: name.to_string(),
                    header: h,
                    file_size: size,
                }),
                Ok(h) => self.quarantine(
                    &path,
                    &format!("truncated ({size} bytes, need {})", h.min_file_len()),
                ),
                Err(e) => self.quarantine(&path, &e),
            }
        }
        out
    }

    /// Finds the longest checkpoint whose key is a prefix of `text` and loads it into
    /// `engine`. On failure the engine is reset and the file is skipped or deleted.
    pub fn lookup(&self, text: &str, engine: &mut dyn EngineBackend) -> Option<Hit> {
        self.lookup_fitting(text, engine, |_, _| true)
    }

    /// `lookup`, skipping (with a log line) checkpoints that `fits` refuses once loaded
    /// (given the hit and the engine's tokens): same key bytes, but control tokens
    /// where the request has client text, or the reverse (docs/server.md, "Control
    /// tokens in client text"). A shorter checkpoint may still serve.
    pub fn lookup_fitting(
        &self,
        text: &str,
        engine: &mut dyn EngineBackend,
        fits: impl Fn(&Hit, &[u32]) -> bool,
    ) -> Option<Hit> {
        let mut cands: Vec<Entry> = Vec::new();
        for e in self.scan() {
            let h = &e.header;
            let kl = h.key_len as usize;
            if (h.tokens as usize) < self.cfg.min_tokens || kl == 0 || kl > text.len() {
                continue;
            }
            if h.ctx as usize > self.ctx || h.tokens as usize >= self.ctx {
                self.report(
                    &e.name,
                    &format!(
                        "written for ctx {} with {} tokens (current ctx {})",
                        h.ctx, h.tokens, self.ctx
                    ),
                );
                continue;
            }
            if self.cfg.reject_different_quant && h.quant != self.quant {
                self.report(
                    &e.name,
                    &format!("{}-bit checkpoint, model is {}-bit", h.quant, self.quant),
                );
                continue;
            }
            if self.cfg.strict && h.ext & EXT_INTEGRITY == 0 {
                // The reference's files are valid, only unverifiable: skip, keep.
                self.report(&e.name, "no integrity section (--kv-cache-strict)");
                continue;
            }
            if !text.is_char_boundary(kl) || sha1_hex(&text.as_bytes()[..kl]) != e.name {
                continue;
            }
            cands.push(e);
        }
        cands.sort_by(|a, b| {
            (b.header.key_len, b.header.tokens).cmp(&(a.header.key_len, a.header.tokens))
        });
        for e in cands {
            match self.load(&e, text, engine) {
                Ok(hit) if fits(&hit, engine.tokens()) => return Some(hit),
                Ok(hit) => {
                    engine.reset();
                    log!(
                        "kv cache: {} skipped: its control tokens differ from the request's",
                        hit.path.display()
                    );
                }
                Err((msg, delete)) => {
                    engine.reset();
                    if delete {
                        self.quarantine(&e.path, &msg);
                    } else {
                        log!("kv cache: cannot load {}: {msg}", e.name);
                    }
                }
            }
        }
        None
    }

    /// Loads one file; the error says whether the file itself is bad (delete it).
    fn load(
        &self,
        e: &Entry,
        text: &str,
        engine: &mut dyn EngineBackend,
    ) -> Result<Hit, (String, bool)> {
        let h = &e.header;
        let data = fs::read(&e.path).map_err(|err| (err.to_string(), false))?;
        let file = parse_file(&data).map_err(|err| (err, true))?;
        if &file.header != h {
            return Err(("file changed while reading".into(), false));
        }
        if let Some(i) = &file.integrity {
            if i.fingerprint != self.fingerprint {
                return Err(("written by another model".into(), true));
            }
        }
        let kl = h.key_len as usize;
        if sha1_hex(file.key) != e.name {
            return Err(("key does not match its name".into(), true));
        }
        if file.key != &text.as_bytes()[..kl] {
            return Err(("key does not match the prompt".into(), false));
        }
        let mut payload = file.payload;
        engine.reset();
        engine
            .load_payload(&mut payload)
            .map_err(|err| (err.to_string(), true))?;
        if engine.tokens().len() != h.tokens as usize {
            return Err((
                format!(
                    "payload has {} tokens, header says {}",
                    engine.tokens().len(),
                    h.tokens
                ),
                true,
            ));
        }
        if self.cfg.cold_max_tokens > 0 && h.tokens as usize > self.cfg.cold_max_tokens {
            // Long checkpoints are consumed: the live session now carries them.
            let _ = fs::remove_file(&e.path);
        } else {
            let _ = touch(&e.path, h.hits.saturating_add(1), now_secs());
        }
        Ok(Hit {
            key_len: kl,
            tokens: h.tokens as usize,
            path: e.path.clone(),
            ext: h.ext,
        })
    }

    /// Saves the engine's session under `key`: its decoded text, or (`key_ext` bit1 or
    /// bit2) the visible transcript of a live binding. Returns the path.
    pub fn store(
        &self,
        engine: &dyn EngineBackend,
        key: &str,
        reason: SaveReason,
        tool_map: &[(String, Arc<str>)],
        key_ext: u8,
    ) -> Result<PathBuf, String> {
        let n = engine.tokens().len();
        if n < self.cfg.min_tokens {
            return Err(format!(
                "{n} tokens is below the minimum {}",
                self.cfg.min_tokens
            ));
        }
        let name = sha1_hex(key.as_bytes());
        let path = self.cfg.dir.join(format!("{name}.kv"));
        let map = encode_tool_map(tool_map);
        let now = now_secs();
        // Same key already stored: only refresh its tool map and last-used time.
        if let Ok(f) = fs::File::open(&path) {
            if let Some((h, integrity)) = self.compatible_same_key(f, key) {
                return rewrite_trailer(&path, &h, &map, &integrity, now)
                    .map(|_| path)
                    .map_err(|e| e.to_string());
            }
        }
        let mut payload = Vec::new();
        engine
            .save_payload(&mut payload)
            .map_err(|e| e.to_string())?;
        let mut ext = (key_ext & !EXT_TOOL_MAP) | EXT_INTEGRITY;
        if !map.is_empty() {
            ext |= EXT_TOOL_MAP;
        }
        let h = Header {
            quant: engine.quant_bits(),
            reason: reason as u8,
            ext,
            tokens: n as u32,
            hits: 0,
            ctx: self.ctx as u32,
            created: now,
            last_used: now,
            payload_len: payload.len() as u64,
            key_len: key.len() as u32,
        };
        let integrity = Integrity {
            fingerprint: self.fingerprint,
            checksum: super::format::checksum(&h, key.as_bytes(), &payload),
        };
        let size = h.body_len() + map.len() as u64 + INTEGRITY_LEN as u64;
        if !fits_budget(size, self.cfg.budget_bytes) {
            return Err(format!(
                "{size} bytes do not fit the budget of {} bytes",
                self.cfg.budget_bytes
            ));
        }
        let tmp = self
            .cfg
            .dir
            .join(format!("{name}.kv.tmp.{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&h.encode())?;
            f.write_all(key.as_bytes())?;
            f.write_all(&payload)?;
            f.write_all(&map)?;
            f.write_all(&integrity.encode())?;
            // Durable before it gets a valid name; the directory entry after the rename.
            f.sync_all()?;
            drop(f);
            fs::rename(&tmp, &path)?;
            fs::File::open(&self.cfg.dir)?.sync_all()
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            return Err(e.to_string());
        }
        log!(
            "kv cache: stored {name}.kv reason={} key={} tokens={n} bytes={size}",
            reason.as_str(),
            key_kind(key_ext)
        );
        self.evict(Some(&path));
        Ok(path)
    }

    /// The header and integrity section of an existing file with the same key that this
    /// model may reuse as is (a file without a section of ours is rewritten whole).
    fn compatible_same_key(&self, mut f: fs::File, key: &str) -> Option<(Header, Integrity)> {
        let mut head = [0u8; HEADER_LEN];
        let n = read_up_to(&mut f, &mut head).ok()?;
        let h = Header::decode(&head[..n]).ok()?;
        if h.ctx as usize > self.ctx || h.key_len as usize != key.len() {
            return None;
        }
        if self.cfg.reject_different_quant && h.quant != self.quant {
            return None;
        }
        if h.ext & EXT_INTEGRITY == 0 || f.metadata().ok()?.len() < h.min_file_len() {
            return None;
        }
        let mut k = vec![0u8; key.len()];
        f.read_exact(&mut k).ok()?;
        f.seek(SeekFrom::End(-(INTEGRITY_LEN as i64))).ok()?;
        let mut tail = [0u8; INTEGRITY_LEN];
        f.read_exact(&mut tail).ok()?;
        let i = Integrity::decode(&tail).ok()?;
        (k == key.as_bytes() && i.fingerprint == self.fingerprint).then_some((h, i))
    }

    /// Deletes the lowest-scoring files until the total fits the budget; `protect` (the
    /// file just stored) goes last unless it alone exceeds the budget.
    pub fn evict(&self, protect: Option<&Path>) {
        let mut entries = self.scan();
        // Temp files of live writers occupy the disk too (#18 item 6).
        let temps: u64 = temp_files(&self.cfg.dir)
            .iter()
            .filter_map(|(p, _, _)| fs::metadata(p).ok())
            .map(|m| m.len())
            .sum();
        let mut total: u64 = entries.iter().map(|e| e.file_size).sum::<u64>() + temps;
        let now = now_secs();
        while total > self.cfg.budget_bytes && !entries.is_empty() {
            let pick = entries
                .iter()
                .enumerate()
                .min_by(|(_, a), (_, b)| {
                    let sa = if Some(a.path.as_path()) == protect {
                        f64::INFINITY
                    } else {
                        score(&a.header, a.file_size, now)
                    };
                    let sb = if Some(b.path.as_path()) == protect {
                        f64::INFINITY
                    } else {
                        score(&b.header, b.file_size, now)
                    };
                    sa.total_cmp(&sb)
                        .then(a.header.last_used.cmp(&b.header.last_used))
                })
                .map(|(i, _)| i);
            let Some(i) = pick else { break };
            let e = entries.remove(i);
            if Some(e.path.as_path()) == protect
                && total - e.file_size <= self.cfg.budget_bytes
                && !entries.is_empty()
            {
                // Unreachable in practice (protected scores +inf); kept for clarity.
                continue;
            }
            log!(
                "kv cache: evicting {}.kv ({} tokens, {} bytes)",
                e.name,
                e.header.tokens,
                e.file_size
            );
            let _ = fs::remove_file(&e.path);
            total -= e.file_size;
        }
    }

    /// Every id → DSML mapping stored in the cache files (loaded into the replay memory
    /// at startup, so tool calls replay exactly across restarts).
    pub fn read_tool_maps(&self, max_ids: usize) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for e in self.scan() {
            if e.header.ext & EXT_TOOL_MAP == 0 {
                continue;
            }
            let res = (|| -> std::io::Result<Vec<u8>> {
                let mut f = fs::File::open(&e.path)?;
                f.seek(SeekFrom::Start(e.header.body_len()))?;
                let mut v = Vec::new();
                f.read_to_end(&mut v)?;
                Ok(v)
            })();
            match res
                .map_err(|e| e.to_string())
                .and_then(|b| decode_tool_map(&b, 4 * max_ids))
            {
                Ok(m) => out.extend(m),
                Err(err) => self.report(&e.name, &format!("tool map: {err}")),
            }
        }
        out
    }
}

fn read_up_to(f: &mut fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let k = f.read(&mut buf[n..])?;
        if k == 0 {
            break;
        }
        n += k;
    }
    Ok(n)
}

/// Updates hits and last-used in place.
fn touch(path: &Path, hits: u32, now: u64) -> std::io::Result<()> {
    let mut f = fs::OpenOptions::new().write(true).open(path)?;
    f.seek(SeekFrom::Start(12))?;
    f.write_all(&hits.to_le_bytes())?;
    f.seek(SeekFrom::Start(32))?;
    f.write_all(&now.to_le_bytes())
}

fn rewrite_trailer(
    path: &Path,
    h: &Header,
    map: &[u8],
    integrity: &Integrity,
    now: u64,
) -> std::io::Result<()> {
    let mut f = fs::OpenOptions::new().write(true).open(path)?;
    f.set_len(h.body_len())?;
    f.seek(SeekFrom::End(0))?;
    f.write_all(map)?;
    f.write_all(&integrity.encode())?;
    let ext = if map.is_empty() {
        h.ext & !EXT_TOOL_MAP
    } else {
        h.ext | EXT_TOOL_MAP
    };
    f.seek(SeekFrom::Start(6))?;
    f.write_all(&[ext | EXT_INTEGRITY])?;
    f.seek(SeekFrom::Start(32))?;
    f.write_all(&now.to_le_bytes())?;
    f.sync_all()
}

/// `<name>.kv.tmp.<pid>` files in `dir`: (path, pid, age).
fn temp_files(dir: &Path) -> Vec<(PathBuf, u32, Duration)> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let now = SystemTime::now();
    rd.flatten()
        .filter_map(|de| {
            let fname = de.file_name().to_string_lossy().into_owned();
            let (_, pid) = fname.split_once(".kv.tmp.")?;
            let pid: u32 = pid.parse().ok()?;
            let age = de
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .unwrap_or_default();
            Some((de.path(), pid, age))
        })
        .collect()
}

/// Whether process `pid` exists (Linux: `/proc/<pid>`; elsewhere assume alive and rely
/// on the age limit).
fn pid_alive(pid: u32) -> bool {
    let proc = Path::new("/proc");
    !proc.is_dir() || proc.join(pid.to_string()).exists()
}

/// The directory the cache files go to (#18 item 3). A missing one is created with mode
/// 0700; an existing one is used as is, never chmodded. A world-writable one (like /tmp)
/// gets a private subdirectory `ds4-kvcache-<uid>`, since anyone could plant or replace
/// files there; that subdirectory must be ours and 0700.
pub fn prepare_dir(dir: &Path) -> std::io::Result<PathBuf> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        let mut b = fs::DirBuilder::new();
        b.recursive(true).mode(0o700);
        b.create(dir)?;
        let md = fs::metadata(dir)?;
        if md.permissions().mode() & 0o002 == 0 {
            return Ok(dir.to_path_buf());
        }
        // The owner of a directory we just created is our effective uid.
        let probe = dir.join(format!(".ds4-uid-probe.{}", std::process::id()));
        let _ = fs::remove_dir(&probe);
        fs::DirBuilder::new().mode(0o700).create(&probe)?;
        let uid = fs::symlink_metadata(&probe)?.uid();
        fs::remove_dir(&probe)?;
        let sub = dir.join(format!("ds4-kvcache-{uid}"));
        match fs::DirBuilder::new().mode(0o700).create(&sub) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let smd = fs::symlink_metadata(&sub)?;
        if !smd.is_dir() || smd.uid() != uid || smd.permissions().mode() & 0o077 != 0 {
            return Err(std::io::Error::other(format!(
                "{} is world-writable and {} is not a private directory of ours",
                dir.display(),
                sub.display()
            )));
        }
        log!(
            "kv cache: {} is world-writable; using {}",
            dir.display(),
            sub.display()
        );
        Ok(sub)
    }
    #[cfg(not(unix))]
    {
        fs::create_dir_all(dir)?;
        Ok(dir.to_path_buf())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha1_abc() {
        assert_eq!(sha1_hex(b"abc"), "a9993e364706816aba3e25717850c26c9cd0d89d");
    }

    #[test]
    fn budget_headroom() {
        // Reference test: budget 1100, payloads 1030 (fits) and 1038 (does not), with
        // the 52-byte header included in the size.
        assert!(fits_budget(52 + 1030, 1100));
        assert!(!fits_budget(52 + 1038, 1100));
    }

    #[test]
    fn header_roundtrip() {
        let h = Header {
            quant: 2,
            reason: 1,
            ext: 1,
            tokens: 7,
            hits: 3,
            ctx: 4096,
            created: 10,
            last_used: 20,
            payload_len: 99,
            key_len: 5,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[4] = 3;
        assert!(Header::decode(&bad).is_err());
        assert!(Header::decode(&bad[..20]).is_err());
    }

    #[test]
    fn score_decay_and_order() {
        let now = 1_000_000;
        let mut h = Header {
            quant: 2,
            reason: 1,
            ext: 0,
            tokens: 100,
            hits: 4,
            ctx: 1,
            created: now,
            last_used: now,
            payload_len: 0,
            key_len: 0,
        };
        let fresh = score(&h, 1000, now);
        h.last_used = now - 21600;
        let old = score(&h, 1000, now);
        assert!((fresh - 0.5).abs() < 1e-9);
        assert!((old - 0.3).abs() < 1e-9);
    }

    #[test]
    fn tool_map_roundtrip() {
        let m = vec![("call_1".to_string(), Arc::<str>::from("\n\n<x>"))];
        let b = encode_tool_map(&m);
        assert_eq!(
            decode_tool_map(&b, 10).unwrap(),
            vec![("call_1".to_string(), "\n\n<x>".to_string())]
        );
        assert!(decode_tool_map(&b[..b.len() - 1], 10).is_err());
        assert!(decode_tool_map(&b, 0).is_err());
    }
}
