//! The disk KV cache (server.md §4.4): KVC files named by the SHA-1 of their key text.
//!
//! ```text
//! 0 "KVC" | 3 version=1 | 4 quant bits | 5 reason | 6 ext flags | 7 reserved
//! 8 u32 tokens | 12 u32 hits | 16 u32 ctx | 20 u32 reserved
//! 24 u64 created | 32 u64 last used | 40 u64 payload bytes | 48 u32 key length T
//! 52 key text | 52+T payload (DSV4) | optional tool-id map ("KTM", ext bit0)
//! ```
//! Files are written to `<name>.tmp.<pid>` and renamed, so a crash never leaves a torn
//! file under a valid name; anything invalid is ignored with a log line.

use std::collections::HashSet;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use sha1::{Digest, Sha1};

use crate::config::KvDiskConfig;
use crate::engine::EngineBackend;
use crate::log;

pub const HEADER_LEN: usize = 52;
const MAGIC: &[u8; 3] = b"KVC";
const VERSION: u8 = 1;
pub const EXT_TOOL_MAP: u8 = 1;
const MAX_TOOL_ID: usize = 256;
const MAX_TOOL_DSML: usize = 512 << 20;
/// Hit-decay half-life in seconds (6 h, fixed).
const HALF_LIFE: f64 = 21600.0;

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

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub quant: u8,
    pub reason: u8,
    pub ext: u8,
    pub tokens: u32,
    pub hits: u32,
    pub ctx: u32,
    pub created: u64,
    pub last_used: u64,
    pub payload_len: u64,
    pub key_len: u32,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..3].copy_from_slice(MAGIC);
        b[3] = VERSION;
        b[4] = self.quant;
        b[5] = self.reason;
        b[6] = self.ext;
        b[8..12].copy_from_slice(&self.tokens.to_le_bytes());
        b[12..16].copy_from_slice(&self.hits.to_le_bytes());
        b[16..20].copy_from_slice(&self.ctx.to_le_bytes());
        b[24..32].copy_from_slice(&self.created.to_le_bytes());
        b[32..40].copy_from_slice(&self.last_used.to_le_bytes());
        b[40..48].copy_from_slice(&self.payload_len.to_le_bytes());
        b[48..52].copy_from_slice(&self.key_len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Header, String> {
        if b.len() < HEADER_LEN {
            return Err(format!("truncated header ({} bytes)", b.len()));
        }
        if &b[..3] != MAGIC {
            return Err("bad magic".into());
        }
        if b[3] != VERSION {
            return Err(format!("unsupported version {}", b[3]));
        }
        let u32at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64at = |o: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(x)
        };
        let h = Header {
            quant: b[4],
            reason: if b[5] > 6 { 0 } else { b[5] },
            ext: b[6],
            tokens: u32at(8),
            hits: u32at(12),
            ctx: u32at(16),
            created: u64at(24),
            last_used: u64at(32),
            payload_len: u64at(40),
            key_len: u32at(48),
        };
        if h.quant != 2 && h.quant != 4 {
            return Err(format!("quant bits {} (expected 2 or 4)", h.quant));
        }
        if h.tokens == 0 {
            return Err("zero tokens".into());
        }
        Ok(h)
    }

    /// Bytes of header + key + payload (the minimum valid file size).
    pub fn body_len(&self) -> u64 {
        HEADER_LEN as u64 + self.key_len as u64 + self.payload_len
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
    /// Files already reported as invalid (log once each).
    reported: Mutex<HashSet<String>>,
}

impl DiskCache {
    /// Creates the directory (mode 0700) and trims the cache to its budget.
    pub fn open(cfg: KvDiskConfig, ctx: usize, quant: u8) -> std::io::Result<DiskCache> {
        fs::create_dir_all(&cfg.dir)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = fs::set_permissions(&cfg.dir, fs::Permissions::from_mode(0o700));
        }
        let c = DiskCache {
            cfg,
            ctx,
            quant,
            reported: Mutex::new(HashSet::new()),
        };
        c.evict(None);
        Ok(c)
    }

    fn report(&self, name: &str, why: &str) {
        let mut r = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        if r.insert(format!("{name}:{why}")) {
            log!("kv cache: ignoring {name}: {why}");
        }
    }

    /// Valid entries (`<40 hex>.kv` with a good header and a large enough file).
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
                Ok(h) if size >= h.body_len() => out.push(Entry {
                    path,
                    name: name.to_string(),
                    header: h,
                    file_size: size,
                }),
                Ok(h) => self.report(
                    &fname,
                    &format!("truncated ({size} bytes, need {})", h.body_len()),
                ),
                Err(e) => self.report(&fname, &e),
            }
        }
        out
    }

    /// Finds the longest checkpoint whose key is a prefix of `text` and loads it into
    /// `engine`. On failure the engine is reset and the file is skipped (or deleted).
    pub fn lookup(&self, text: &str, engine: &mut dyn EngineBackend) -> Option<Hit> {
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
                Ok(hit) => return Some(hit),
                Err((msg, delete)) => {
                    engine.reset();
                    log!("kv cache: cannot load {}: {msg}", e.name);
                    if delete {
                        let _ = fs::remove_file(&e.path);
                    }
                }
            }
        }
        None
    }

    fn load(
        &self,
        e: &Entry,
        text: &str,
        engine: &mut dyn EngineBackend,
    ) -> Result<Hit, (String, bool)> {
        let h = &e.header;
        let data = fs::read(&e.path).map_err(|err| (err.to_string(), false))?;
        let kl = h.key_len as usize;
        let key_end = HEADER_LEN + kl;
        let pay_end = key_end + h.payload_len as usize;
        if data.len() < pay_end || Header::decode(&data).ok().as_ref() != Some(h) {
            return Err(("file changed or truncated".into(), false));
        }
        let key = &data[HEADER_LEN..key_end];
        if sha1_hex(key) != e.name || key != &text.as_bytes()[..kl] {
            return Err(("key does not match its name".into(), false));
        }
        let mut payload = &data[key_end..pay_end];
        engine.reset();
        engine
            .load_payload(&mut payload)
            .map_err(|err| (err.to_string(), false))?;
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
            if let Some(h) = self.compatible_same_key(f, key) {
                return rewrite_trailer(&path, &h, &map, now)
                    .map(|_| path)
                    .map_err(|e| e.to_string());
            }
        }
        let mut payload = Vec::new();
        engine
            .save_payload(&mut payload)
            .map_err(|e| e.to_string())?;
        let h = Header {
            quant: engine.quant_bits(),
            reason: reason as u8,
            ext: (key_ext & !EXT_TOOL_MAP) | if map.is_empty() { 0 } else { EXT_TOOL_MAP },
            tokens: n as u32,
            hits: 0,
            ctx: self.ctx as u32,
            created: now,
            last_used: now,
            payload_len: payload.len() as u64,
            key_len: key.len() as u32,
        };
        let size = h.body_len() + map.len() as u64;
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
            drop(f);
            fs::rename(&tmp, &path)
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

    fn compatible_same_key(&self, mut f: fs::File, key: &str) -> Option<Header> {
        let mut head = [0u8; HEADER_LEN];
        let n = read_up_to(&mut f, &mut head).ok()?;
        let h = Header::decode(&head[..n]).ok()?;
        if h.ctx as usize > self.ctx || h.key_len as usize != key.len() {
            return None;
        }
        if self.cfg.reject_different_quant && h.quant != self.quant {
            return None;
        }
        let mut k = vec![0u8; key.len()];
        f.read_exact(&mut k).ok()?;
        (k == key.as_bytes()).then_some(h)
    }

    /// Deletes the lowest-scoring files until the total fits the budget; `protect` (the
    /// file just stored) goes last unless it alone exceeds the budget.
    pub fn evict(&self, protect: Option<&Path>) {
        let mut entries = self.scan();
        let mut total: u64 = entries.iter().map(|e| e.file_size).sum();
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

fn rewrite_trailer(path: &Path, h: &Header, map: &[u8], now: u64) -> std::io::Result<()> {
    let mut f = fs::OpenOptions::new().write(true).open(path)?;
    f.set_len(h.body_len())?;
    f.seek(SeekFrom::End(0))?;
    f.write_all(map)?;
    let ext = if map.is_empty() {
        h.ext & !EXT_TOOL_MAP
    } else {
        h.ext | EXT_TOOL_MAP
    };
    f.seek(SeekFrom::Start(6))?;
    f.write_all(&[ext])?;
    f.seek(SeekFrom::Start(32))?;
    f.write_all(&now.to_le_bytes())
}

/// `KTM`, version 1, u32 count, then (u32 id len, u32 dsml len, id, dsml) per entry.
pub fn encode_tool_map(entries: &[(String, Arc<str>)]) -> Vec<u8> {
    let entries: Vec<&(String, Arc<str>)> = entries
        .iter()
        .filter(|(id, b)| {
            (1..=MAX_TOOL_ID).contains(&id.len()) && (1..=MAX_TOOL_DSML).contains(&b.len())
        })
        .collect();
    if entries.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    out.extend_from_slice(b"KTM");
    out.push(1);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (id, b) in entries {
        out.extend_from_slice(&(id.len() as u32).to_le_bytes());
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(b.as_bytes());
    }
    out
}

pub fn decode_tool_map(b: &[u8], max: usize) -> Result<Vec<(String, String)>, String> {
    if b.len() < 8 || &b[..3] != b"KTM" || b[3] != 1 {
        return Err("bad tool map header".into());
    }
    let count = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
    if count > max {
        return Err(format!("{count} entries exceed the limit {max}"));
    }
    let mut pos = 8;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        if pos + 8 > b.len() {
            return Err("truncated".into());
        }
        let il = u32::from_le_bytes([b[pos], b[pos + 1], b[pos + 2], b[pos + 3]]) as usize;
        let dl = u32::from_le_bytes([b[pos + 4], b[pos + 5], b[pos + 6], b[pos + 7]]) as usize;
        pos += 8;
        if !(1..=MAX_TOOL_ID).contains(&il)
            || !(1..=MAX_TOOL_DSML).contains(&dl)
            || pos + il + dl > b.len()
        {
            return Err("bad entry".into());
        }
        let id = String::from_utf8(b[pos..pos + il].to_vec()).map_err(|_| "id not UTF-8")?;
        let dsml =
            String::from_utf8(b[pos + il..pos + il + dl].to_vec()).map_err(|_| "DSML not UTF-8")?;
        pos += il + dl;
        out.push((id, dsml));
    }
    Ok(out)
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
