//! The KVC file format (server.md §4.4) as pure functions over bytes: no model, no I/O
//! and no other module of this crate, so `fuzz/fuzz_targets/kvc_read.rs` includes this
//! file as is (a reader bug must be findable without building the server).
//!
//! ```text
//! 0 "KVC" | 3 version=1 | 4 quant bits | 5 reason | 6 ext flags | 7 reserved
//! 8 u32 tokens | 12 u32 hits | 16 u32 ctx | 20 u32 reserved
//! 24 u64 created | 32 u64 last used | 40 u64 payload bytes | 48 u32 key length T
//! 52 key text | 52+T payload (DSV4) | optional tool-id map ("KTM", ext bit0)
//! | optional integrity section ("KVI", ext bit3): the file's last 68 bytes
//! ```
//! The integrity section sits at the very end so the reference, which reads the payload
//! at 52+T and the count-prefixed tool map after it, still reads our files.

use std::sync::Arc;

use sha2::{Digest, Sha256};

pub const HEADER_LEN: usize = 52;
const MAGIC: &[u8; 3] = b"KVC";
const VERSION: u8 = 1;
pub const EXT_TOOL_MAP: u8 = 1;
/// The file ends with an integrity section (ours; the reference never sets it).
pub const EXT_INTEGRITY: u8 = 8;
/// `KVI`, version u8 = 1, 32-byte model fingerprint, 32-byte SHA-256 checksum.
pub const INTEGRITY_LEN: usize = 4 + 32 + 32;
const INTEGRITY_MAGIC: &[u8; 4] = b"KVI\x01";
const MAX_TOOL_ID: usize = 256;
const MAX_TOOL_DSML: usize = 512 << 20;

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
        // #18 item 4: a huge payload length must not wrap the size arithmetic.
        if h.checked_body_len().is_none() {
            return Err(format!("payload length {} overflows", h.payload_len));
        }
        Ok(h)
    }

    fn checked_body_len(&self) -> Option<u64> {
        (HEADER_LEN as u64 + self.key_len as u64).checked_add(self.payload_len)
    }

    /// Bytes of header + key + payload (the minimum valid file size; saturates for a
    /// header that `decode` would have refused).
    pub fn body_len(&self) -> u64 {
        self.checked_body_len().unwrap_or(u64::MAX)
    }

    /// The smallest valid file size: the body plus the integrity section when flagged.
    pub fn min_file_len(&self) -> u64 {
        let extra = if self.ext & EXT_INTEGRITY != 0 {
            INTEGRITY_LEN as u64
        } else {
            0
        };
        self.body_len().saturating_add(extra)
    }
}

/// The integrity section: which model wrote the file and a checksum of its content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Integrity {
    pub fingerprint: [u8; 32],
    pub checksum: [u8; 32],
}

impl Integrity {
    pub fn encode(&self) -> [u8; INTEGRITY_LEN] {
        let mut b = [0u8; INTEGRITY_LEN];
        b[..4].copy_from_slice(INTEGRITY_MAGIC);
        b[4..36].copy_from_slice(&self.fingerprint);
        b[36..].copy_from_slice(&self.checksum);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Integrity, String> {
        if b.len() != INTEGRITY_LEN || &b[..4] != INTEGRITY_MAGIC {
            return Err("bad integrity section".into());
        }
        let mut i = Integrity {
            fingerprint: [0; 32],
            checksum: [0; 32],
        };
        i.fingerprint.copy_from_slice(&b[4..36]);
        i.checksum.copy_from_slice(&b[36..]);
        Ok(i)
    }
}

/// SHA-256 over what never changes after the save: the header with the fields that
/// lookups rewrite in place (hits, last used, the tool-map and integrity bits) zeroed,
/// the key and the payload. The tool map is rewritten on re-saves and is checked by its
/// own parser instead.
pub fn checksum(h: &Header, key: &[u8], payload: &[u8]) -> [u8; 32] {
    let fixed = Header {
        hits: 0,
        last_used: 0,
        ext: h.ext & !(EXT_TOOL_MAP | EXT_INTEGRITY),
        ..h.clone()
    };
    let mut d = Sha256::new();
    d.update(fixed.encode());
    d.update(key);
    d.update(payload);
    d.finalize().into()
}

/// A whole KVC file split into its sections.
#[derive(Debug)]
pub struct Parsed<'a> {
    pub header: Header,
    pub key: &'a [u8],
    pub payload: &'a [u8],
    /// The bytes between the payload and the integrity section (empty without bit0).
    pub tool_map: &'a [u8],
    /// `None` for files without the section (the reference's).
    pub integrity: Option<Integrity>,
}

/// Parses and checks a whole file: every length against the real size and, when the
/// file has an integrity section, its checksum. The model fingerprint is the caller's.
pub fn parse_file(data: &[u8]) -> Result<Parsed<'_>, String> {
    let header = Header::decode(data)?;
    let len = data.len() as u64;
    if len < header.min_file_len() {
        return Err(format!(
            "truncated ({len} bytes, need {})",
            header.min_file_len()
        ));
    }
    // Both fit in usize now: they are at most the length of a slice.
    let key_end = HEADER_LEN + header.key_len as usize;
    let body_end = header.body_len() as usize;
    let (rest_end, integrity) = if header.ext & EXT_INTEGRITY != 0 {
        let start = data.len() - INTEGRITY_LEN;
        (start, Some(Integrity::decode(&data[start..])?))
    } else {
        (data.len(), None)
    };
    let p = Parsed {
        key: &data[HEADER_LEN..key_end],
        payload: &data[key_end..body_end],
        tool_map: if header.ext & EXT_TOOL_MAP != 0 {
            &data[body_end..rest_end]
        } else {
            &[]
        },
        integrity,
        header,
    };
    if let Some(i) = &p.integrity {
        if checksum(&p.header, p.key, p.payload) != i.checksum {
            return Err("checksum mismatch".into());
        }
    }
    Ok(p)
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
    let mut out = Vec::with_capacity(count.min(b.len() / 10));
    for _ in 0..count {
        if b.len() - pos < 8 {
            return Err("truncated".into());
        }
        let il = u32::from_le_bytes([b[pos], b[pos + 1], b[pos + 2], b[pos + 3]]) as usize;
        let dl = u32::from_le_bytes([b[pos + 4], b[pos + 5], b[pos + 6], b[pos + 7]]) as usize;
        pos += 8;
        if !(1..=MAX_TOOL_ID).contains(&il)
            || !(1..=MAX_TOOL_DSML).contains(&dl)
            || b.len() - pos < il + dl
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

    fn seeds() -> Vec<(String, Vec<u8>)> {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/kvc_read");
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| {
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    }

    // The fuzz seeds (written by fuzz/kvc_seeds.py, an independent writer) parse, and the
    // integrity ones verify: the checksum definition matches on both sides.
    #[test]
    fn fuzz_seeds_parse() {
        let all = seeds();
        assert_eq!(all.len(), 4);
        for (name, b) in &all {
            let p = parse_file(b).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                p.integrity.is_some(),
                name.starts_with("integrity"),
                "{name}"
            );
            assert_eq!(
                !p.tool_map.is_empty(),
                name.ends_with("toolmap.kv"),
                "{name}"
            );
            if !p.tool_map.is_empty() {
                assert_eq!(decode_tool_map(p.tool_map, 4).unwrap().len(), 1);
            }
        }
    }

    // #18 item 4: every length is checked against the real size, with checked
    // arithmetic; a cut anywhere is an error, never a panic.
    #[test]
    fn truncations_and_huge_lengths_are_errors() {
        for (name, b) in seeds() {
            for cut in 0..b.len() {
                // Only a reference file cut inside its tool map still parses; then the
                // tool map itself is refused.
                if let Ok(p) = parse_file(&b[..cut]) {
                    assert!(p.integrity.is_none(), "{name} cut at {cut}");
                    assert!(cut as u64 >= p.header.body_len(), "{name} cut at {cut}");
                    assert!(
                        decode_tool_map(p.tool_map, 4).is_err(),
                        "{name} cut at {cut}"
                    );
                }
            }
            for (off, width) in [(40, 8), (48, 4)] {
                let mut bad = b.clone();
                bad[off..off + width].fill(0xff);
                assert!(parse_file(&bad).is_err(), "{name} at {off}");
            }
        }
    }

    /// Header bytes outside the checksum: the ext flags (bit0 is rewritten in place),
    /// the reserved bytes (never read), hits and last used (rewritten on every hit).
    fn unchecked(i: usize) -> bool {
        matches!(i, 6 | 7 | 12..=15 | 20..=23 | 32..=39)
    }

    // #18 item 5: a changed byte anywhere in the checked part fails the checksum; the
    // fields rewritten in place (hits, last used) do not.
    #[test]
    fn checksum_covers_header_key_and_payload() {
        let (_, b) = seeds()
            .into_iter()
            .find(|(n, _)| n == "integrity.kv")
            .unwrap();
        let body = parse_file(&b).unwrap().header.body_len() as usize;
        for i in (0..body).filter(|&i| !unchecked(i)) {
            let mut bad = b.clone();
            bad[i] ^= 0x01;
            assert!(parse_file(&bad).is_err(), "byte {i}");
        }
        let mut touched = b.clone();
        touched[12] = 9;
        touched[33] = 9;
        assert!(parse_file(&touched).is_ok());
    }
}
