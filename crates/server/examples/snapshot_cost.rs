//! Measures what a live-session snapshot (the worker's rewind point, `Session::try_clone`)
//! and a KVC payload cost as the context grows, and extrapolates the per-token cost to
//! the full DeepSeek V4 Flash layout (docs/server.md, "Snapshot cost").
//!
//! `cargo run --release -p ds4-server --example snapshot_cost -- [--cuda] [MODEL] [MAX_TOKENS]`
//! (default: fixtures/tiny/tiny-q2.gguf, 8192; the CPU backend unless `--cuda`).

use std::time::Instant;

use ds4_engine::{BackendChoice, Engine, EngineOptions};
use ds4_server::engine::{EngineBackend, RealEngine};

/// Payload bytes of a DSV4 session with `n` tokens for a layout (server.md §4.4): the
/// fixed part (header, logits, counts, raw windows, compressor states) and the part
/// that grows with the context (token ids, compressed rows, indexer rows).
fn payload_model(
    n: usize,
    layers: usize,
    head: usize,
    idx: usize,
    vocab: usize,
    window: usize,
    ratios: &[usize],
) -> (usize, f64) {
    let mut fixed = 13 * 4 + vocab * 4 + 2 * layers * 4;
    let mut per_token = 4.0; // the token id
    for &r in ratios.iter().take(layers) {
        fixed += window.min(n) * head * 4;
        if r == 0 {
            continue;
        }
        let coff = if r == 4 { 2 } else { 1 };
        fixed += 2 * coff * head * coff * r * 4;
        per_token += (head * 4) as f64 / r as f64;
        if r == 4 {
            fixed += 2 * coff * idx * coff * 4 * 4;
            per_token += (idx * 4) as f64 / 4.0;
        }
    }
    (fixed, per_token)
}

fn main() {
    let mut args = std::env::args().skip(1).peekable();
    let cuda = args.next_if(|a| a == "--cuda").is_some();
    let path = args.next().unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/tiny/tiny-q2.gguf"
        )
        .to_string()
    });
    let max: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(8192);
    let backend = if cuda {
        BackendChoice::Cuda { device: 0 }
    } else {
        BackendChoice::Cpu { threads: None }
    };
    let engine = Engine::open(
        &path,
        EngineOptions {
            backend,
            ..EngineOptions::default()
        },
    )
    .expect("model");
    let c = engine.info().hparams.clone();
    println!(
        "model {path}: layers {} head_dim {} idx_dim {} vocab {} window {} ratios {:?}",
        c.n_layer, c.head_dim, c.idx_head_dim, c.vocab, c.window, c.compress_ratios
    );
    let session = engine.new_session(max + 1).expect("session");
    println!("backend: {}", engine.backend());
    let mut eng = RealEngine::new(&engine, session);
    println!("tokens  clone_ms  payload_bytes  payload_ms  clone_GB/s");
    let mut rows = Vec::new();
    let mut n = 256;
    while n <= max {
        let have = eng.tokens().len();
        let add: Vec<u32> = (have..n)
            .map(|i| (i * 7919 % (c.vocab - 1) + 1) as u32)
            .collect();
        eng.prefill(&add).expect("prefill");
        let reps = 5;
        let t0 = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(eng.snapshot().expect("snapshot"));
        }
        let clone_s = t0.elapsed().as_secs_f64() / reps as f64;
        let mut buf = Vec::new();
        let t1 = Instant::now();
        eng.save_payload(&mut buf).expect("payload");
        let pay_s = t1.elapsed().as_secs_f64();
        println!(
            "{n:6}  {:8.3}  {:13}  {:10.3}  {:10.2}",
            clone_s * 1e3,
            buf.len(),
            pay_s * 1e3,
            buf.len() as f64 / clone_s / 1e9
        );
        rows.push((n, clone_s, buf.len()));
        n *= 2;
    }
    if let (Some(a), Some(b)) = (rows.first(), rows.last()) {
        let bpt = (b.2 - a.2) as f64 / (b.0 - a.0) as f64;
        let spt = (b.1 - a.1) / (b.0 - a.0) as f64;
        let (_, model_bpt) = payload_model(
            b.0,
            c.n_layer,
            c.head_dim,
            c.idx_head_dim,
            c.vocab,
            c.window,
            &c.compress_ratios,
        );
        println!(
            "measured: {bpt:.1} payload bytes/token (layout formula: {model_bpt:.1}), clone {:.3} us/token",
            spt * 1e6
        );
        // The published model: 43 layers, head 512, indexer 128, vocab 129280, window
        // 128, ratios 0,0 then 4/128 alternating.
        let ratios: Vec<usize> = (0..43)
            .map(|il| match il {
                0 | 1 => 0,
                il if il % 2 == 0 => 4,
                _ => 128,
            })
            .collect();
        let (fixed, full_bpt) = payload_model(100_000, 43, 512, 128, 129_280, 128, &ratios);
        let bw = b.2 as f64 / b.1; // bytes per second of a clone at the largest size
        println!(
            "full layout: {full_bpt:.0} bytes/token + {:.1} MB fixed; at the measured clone bandwidth ({:.1} GB/s): {:.3} us/token, {:.0} ms at 100k tokens",
            fixed as f64 / 1e6,
            bw / 1e9,
            full_bpt / bw * 1e6,
            (fixed as f64 + full_bpt * 1e5) / bw * 1e3
        );
    }
}
