//! `--mtp` in the generation loop, on the tiny fixture model (CPU, Exact numerics) with
//! a synthetic MTP block: greedy replies are the plain server's token for token, also
//! when a stop string ends the reply inside a speculative cycle (the session is then
//! rewound to the plain loop's, which the next request's KV reuse shows), and the
//! `ds4_mtp_*` counters move.
//!
//! Random MTP weights draft almost nothing the target accepts, so the speculative
//! server's drafts go through a hook that proposes the plain server's own greedy token
//! at that position (recorded by hooks around its engine): cycles then accept several
//! drafts and the multi-token path is what runs. The verify still decides.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use common::*;
use ds4_engine::{BackendChoice, Engine, EngineOptions, Numerics, SpecOptions, Speculator};
use ds4_server::engine::RealEngine;
use ds4_server::{ServerConfig, TestServer};
use serde_json::{json, Value};

/// Position → the token the plain server decoded there.
type Truth = Arc<Mutex<HashMap<usize, u32>>>;

/// Reports the live session's length after every change in `len` and, for the plain
/// server, records every decoded token by position in `truth`.
#[derive(Clone, Default)]
struct Watch {
    truth: Option<Truth>,
    len: Arc<AtomicUsize>,
}

impl EngineHooks for Watch {
    fn before_decode(&mut self, held: &[u32], token: u32) {
        if let Some(truth) = &self.truth {
            truth.lock().unwrap().insert(held.len(), token);
        }
    }
    fn after_change(&mut self, held: &[u32]) {
        self.len.store(held.len(), Relaxed);
    }
}

fn engine() -> Engine {
    Engine::open(
        root().join(TINY_MODEL),
        EngineOptions {
            backend: BackendChoice::Cpu { threads: None },
            numerics: Numerics::Exact,
            ..EngineOptions::default()
        },
    )
    .expect("tiny model")
}

struct Served {
    server: TestServer,
    /// The live session's length.
    len: Arc<AtomicUsize>,
}

/// The plain server (recording into `truth`) and the speculative one (3 drafts per
/// cycle, no margin gate, drafts proposed from `truth` where it has them).
fn servers(truth: &Truth) -> (Served, Served) {
    servers_with(truth, |_| ServerConfig::for_tests(1024))
}

/// [`servers`] with the configuration `cfg(i)` (0: plain, 1: speculative).
fn servers_with(truth: &Truth, cfg: impl Fn(usize) -> ServerConfig) -> (Served, Served) {
    let e = engine();
    let tok = e.tokenizer().expect("tokenizer");
    let serve = |inner: RealEngine, truth: Option<Truth>| {
        let i = usize::from(truth.is_none());
        let hooks = Watch {
            truth,
            ..Watch::default()
        };
        Served {
            len: hooks.len.clone(),
            server: TestServer::start(
                cfg(i),
                tok.clone(),
                Box::new(Hooked {
                    inner: Box::new(inner),
                    hooks,
                }),
            ),
        }
    };
    let plain = serve(
        RealEngine::new(&e, e.new_session(1024).unwrap()),
        Some(truth.clone()),
    );

    // One directory per server: the tests of this file run in parallel.
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = temp_dir(&format!("mtp-file-{}", N.fetch_add(1, Relaxed)));
    let mtp = e
        .load_mtp(write_mtp_file(&dir, None))
        .expect("matching MTP file");
    let _ = std::fs::remove_dir_all(&dir);
    let opts = SpecOptions {
        draft: 3,
        margin: 0.0,
    };
    let mut spec = Speculator::new(mtp, opts).unwrap();
    let t = truth.clone();
    spec.set_draft_hook(Box::new(move |pos| t.lock().unwrap().get(&pos).copied()));
    let real = RealEngine::new(&e, e.new_session(1024).unwrap()).with_speculator(spec);
    (plain, serve(real, None))
}

const PROMPT: &str = "The quick brown fox jumps over the lazy dog. Once upon a time";

fn complete(s: &Served, prompt: &str, max: u64, stop: Option<&str>) -> Value {
    let mut body =
        json!({"model": "deepseek-chat", "prompt": prompt, "max_tokens": max, "temperature": 0});
    if let Some(st) = stop {
        body["stop"] = json!([st]);
    }
    let r = post(s.server.addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// `name`'s value in the /metrics text.
fn metric(s: &Served, name: &str) -> f64 {
    let text = get(s.server.addr, "/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
        .parse()
        .unwrap()
}

fn reply(v: &Value) -> (String, String, u64) {
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

#[test]
fn greedy_replies_are_the_plain_ones_and_stops_inside_a_cycle_rewind() {
    let truth = Truth::default();
    let (plain, fast) = servers(&truth);
    let want = complete(&plain, PROMPT, 40, None);
    let got = complete(&fast, PROMPT, 40, None);
    assert_eq!(reply(&got), reply(&want));
    let (text, _, n) = reply(&want);
    assert_eq!(n, 40, "{text:?}");

    let cycles = metric(&fast, "ds4_mtp_cycles_total");
    let drafted = metric(&fast, "ds4_mtp_drafted_total");
    let accepted = metric(&fast, "ds4_mtp_accepted_total");
    // 40 tokens in far fewer cycles: the drafts were accepted.
    assert!(cycles > 0.0 && cycles < 20.0, "cycles {cycles}");
    assert!(
        accepted >= 20.0 && accepted <= drafted,
        "accepted {accepted} of {drafted}"
    );
    assert!(metric(&fast, "ds4_mtp_tokens_per_cycle") > 2.0);
    assert_eq!(metric(&plain, "ds4_mtp_cycles_total"), 0.0);

    // Stop strings at several places of the reply: same text, and the session ends
    // where the plain one does (so the next request reuses the same KV).
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut tried = 0;
    for k in [4, 9, 15, 22, 30] {
        let (Some(&(a, _)), Some(&(b, _))) = (chars.get(k), chars.get(k + 2)) else {
            continue;
        };
        let stop = &text[a..b];
        if stop.trim().is_empty() {
            continue;
        }
        tried += 1;
        let want = complete(&plain, PROMPT, 40, Some(stop));
        let got = complete(&fast, PROMPT, 40, Some(stop));
        assert_eq!(reply(&got), reply(&want), "stop {stop:?}");
        let live = |s: &Served| s.len.load(Relaxed);
        assert_eq!(
            live(&fast),
            live(&plain),
            "session length after stop {stop:?}"
        );
        let next = format!("{PROMPT}{} and then", reply(&want).0);
        let want = complete(&plain, &next, 2, None);
        let got = complete(&fast, &next, 2, None);
        assert_eq!(reply(&got), reply(&want), "after stop {stop:?}");
        let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        assert_eq!(cached(&got), cached(&want), "after stop {stop:?}");
    }
    assert!(tried >= 3, "reply {text:?}");
    // At least one stop fell inside a cycle's tokens (deterministic for this model).
    assert!(metric(&fast, "ds4_mtp_rewinds_total") >= 1.0);
    plain.server.stop();
    fast.server.stop();
}

#[test]
fn sampled_requests_speculate_unless_tools_make_the_sampler_change_per_token() {
    let truth = Truth::default();
    let (plain, fast) = servers(&truth);
    let cycles = || metric(&fast, "ds4_mtp_cycles_total");
    let chat = |tools: bool| {
        let mut body = json!({
            "model": "deepseek-chat",
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 12, "temperature": 0.9, "seed": 3,
        });
        if tools {
            body["tools"] = json!([weather_tool()]);
        }
        let r = post(fast.server.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let before = cycles();
    let v = chat(false);
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    assert!(
        cycles() > before,
        "a sampled request without tools speculates"
    );
    let before = cycles();
    chat(true);
    assert_eq!(
        cycles(),
        before,
        "with tools the DSML rule may switch to greedy mid-cycle: plain steps"
    );
    plain.server.stop();
    fast.server.stop();
}

#[test]
fn continued_checkpoints_land_where_the_plain_loop_saves_them() {
    use ds4_server::config::KvDiskConfig;
    let dirs = [temp_dir("mtp-kv-plain"), temp_dir("mtp-kv-fast")];
    let truth = Truth::default();
    let (plain, fast) = servers_with(&truth, |i| {
        let mut cfg = ServerConfig::for_tests(1024);
        cfg.kv_disk = Some(KvDiskConfig {
            continued_interval: 8,
            align: 0,
            ..KvDiskConfig::for_tests(dirs[i].clone())
        });
        cfg
    });
    let want = complete(&plain, PROMPT, 40, None);
    let got = complete(&fast, PROMPT, 40, None);
    assert_eq!(reply(&got), reply(&want));
    assert!(metric(&fast, "ds4_mtp_accepted_total") >= 20.0);
    // A checkpoint every 8 positions of the reply: a cycle never steps over one.
    let saves = metric(&plain, "ds4_disk_cache_saves_total");
    assert!(saves >= 4.0, "{saves}");
    assert_eq!(metric(&fast, "ds4_disk_cache_saves_total"), saves);
    let files = |d: &std::path::Path| {
        let mut v: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        v.sort();
        v
    };
    // The file names are the SHA-1 of each checkpoint's text: the same token prefixes.
    assert_eq!(files(&dirs[1]), files(&dirs[0]));
    plain.server.stop();
    fast.server.stop();
    for d in &dirs {
        let _ = std::fs::remove_dir_all(d);
    }
}
