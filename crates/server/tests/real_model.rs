//! The real engine on fixtures/tiny/tiny-q2.gguf: generation, live reuse, and a disk
//! checkpoint with the DSV4 session payload that a restarted server loads.

mod common;

use common::*;
use ds4_engine::{BackendChoice, Engine, EngineOptions};
use ds4_server::config::KvDiskConfig;
use ds4_server::engine::RealEngine;
use ds4_server::{ServerConfig, TestServer};
use serde_json::json;

fn server(dir: &std::path::Path) -> TestServer {
    let engine = Engine::open(
        root().join("fixtures/tiny/tiny-q2.gguf"),
        EngineOptions {
            backend: BackendChoice::Cpu { threads: None },
            ..EngineOptions::default()
        },
    )
    .expect("tiny model");
    let tok = engine.tokenizer().expect("tokenizer");
    let mut cfg = ServerConfig::for_tests(1024);
    cfg.kv_disk = Some(KvDiskConfig {
        budget_bytes: 256 << 20,
        reject_different_quant: true,
        ..KvDiskConfig::for_tests(dir.to_path_buf())
    });
    let session = engine.new_session(1024).expect("session");
    TestServer::start(cfg, tok, Box::new(RealEngine::new(&engine, session)))
}

#[test]
fn tiny_model_reuse_and_disk_restart() {
    let dir = std::env::temp_dir().join(format!("ds4-real-kv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let system = "Rules: be short. ".repeat(4);
    let body = |q: &str| json!({"model": "deepseek-chat", "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}], "max_tokens": 6, "seed": 7});
    let s = server(&dir);
    let r1 = post(s.addr, "/v1/chat/completions", &body("one")).json();
    assert_eq!(r1["choices"][0]["message"]["role"], "assistant");
    let r2 = post(s.addr, "/v1/chat/completions", &body("one")).json();
    // Same prompt again: rewinds to the snapshot instead of re-prefilling.
    assert_eq!(
        r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        r2["usage"]["prompt_tokens"].as_u64().unwrap() - 1
    );
    s.stop();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(!files.is_empty());
    for f in &files {
        let b = std::fs::read(f).unwrap();
        let key_len = u32::from_le_bytes(b[48..52].try_into().unwrap()) as usize;
        assert_eq!(
            &b[52 + key_len..52 + key_len + 4],
            b"DSV4",
            "{}",
            f.display()
        );
    }
    let s = server(&dir);
    let r3 = post(s.addr, "/v1/chat/completions", &body("two")).json();
    assert!(
        r3["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 16,
        "{r3}"
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
