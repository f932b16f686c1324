//! The disk KV cache across restarts, its file format read back byte by byte, and
//! garbage files in the cache directory.

mod common;

use std::path::Path;

use common::*;
use ds4_server::config::KvDiskConfig;
use ds4_server::ServerConfig;
use serde_json::json;

fn cfg(dir: &Path) -> ServerConfig {
    let mut c = ServerConfig::for_tests(4096);
    c.kv_disk = Some(KvDiskConfig {
        min_tokens: 32,
        ..KvDiskConfig::for_tests(dir.to_path_buf())
    });
    c
}

fn kv_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "kv"))
        .collect();
    v.sort();
    v
}

/// Reads a KVC header without the server's code (offsets from the format table).
fn read_header(bytes: &[u8]) -> (u8, u8, u8, u32, u32, u64, u32) {
    assert_eq!(&bytes[..3], b"KVC");
    assert_eq!(bytes[3], 1, "version");
    let u32at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
    let u64at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
    (
        bytes[4],
        bytes[5],
        bytes[6],
        u32at(8),
        u32at(16),
        u64at(40),
        u32at(48),
    )
}

#[test]
fn restart_serves_the_prefix_from_disk() {
    let dir = temp_dir("restart");
    let system = "You are a careful assistant. ".repeat(20);
    let ask = |s: &ds4_server::TestServer, q: &str| {
        post(s.addr, "/v1/chat/completions", &json!({"model": "deepseek-chat", "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}], "max_tokens": 5})).json()
    };
    let s = fake_server(cfg(&dir));
    let r = ask(&s, "first question");
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    s.stop();
    let files = kv_files(&dir);
    // A cold save (system prefix, cut at the last <｜User｜>) and the shutdown save.
    assert!(files.len() >= 2, "{files:?}");
    let mut reasons = Vec::new();
    for f in &files {
        let b = std::fs::read(f).unwrap();
        let (quant, reason, ext, tokens, ctx, payload, key_len) = read_header(&b);
        assert_eq!(quant, 2);
        assert_eq!(ctx, 4096);
        assert!(tokens >= 32);
        // #18 item 5: our files end with the 68-byte integrity section (ext bit 3).
        assert_eq!(ext & 8, 8);
        assert_eq!(b.len() as u64, 52 + key_len as u64 + payload + 68);
        assert_eq!(&b[b.len() - 68..b.len() - 64], b"KVI\x01");
        let key = &b[52..52 + key_len as usize];
        assert!(key.starts_with("<｜begin▁of▁sentence｜>".as_bytes()));
        assert_eq!(
            &b[52 + key_len as usize..52 + key_len as usize + 4],
            b"FAKE"
        );
        reasons.push(reason);
    }
    assert!(
        reasons.contains(&1) && reasons.contains(&4),
        "cold and shutdown saves: {reasons:?}"
    );
    // A fresh server (empty live session) reuses the shared system prefix from disk.
    let s = fake_server(cfg(&dir));
    let r = ask(&s, "another question");
    let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 32, "{r}");
    let m = get(s.addr, "/metrics").text();
    assert!(m.contains("ds4_cache_hits_total{kind=\"disk\"} 1"), "{m}");
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn garbage_cache_files_are_ignored() {
    let dir = temp_dir("garbage");
    std::fs::create_dir_all(&dir).unwrap();
    let name = |c: char| dir.join(format!("{}.kv", c.to_string().repeat(40)));
    std::fs::write(name('a'), b"not a cache file at all").unwrap();
    let mut h = vec![0u8; 52];
    h[..4].copy_from_slice(b"KVC\x01");
    h[4] = 3; // bad quant
    h[8] = 5;
    std::fs::write(name('b'), &h).unwrap();
    h[4] = 2;
    h[40] = 200; // payload longer than the file
    std::fs::write(name('c'), &h).unwrap();
    std::fs::write(dir.join("README.kv"), b"ignored name").unwrap();
    let s = fake_server(cfg(&dir));
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert_eq!(r.status, 200);
    drop(s);
    // #18 item 4: invalid `.kv` files are deleted (never retried, also not after a
    // restart); files of other names are not the cache's to touch.
    for c in ['a', 'b', 'c'] {
        assert!(!name(c).exists(), "{c}");
    }
    assert!(dir.join("README.kv").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
