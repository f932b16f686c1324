//! Test helpers: an in-process server over the fake engine and a minimal HTTP/1.1 client
//! (loopback only, bounded timeouts).
#![allow(dead_code)]

#[path = "../../../../tests-support/record_skip.rs"]
mod record_skip;
#[allow(unused_imports)]
pub use record_skip::record_skip;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use ds4_server::engine::{default_script, EngineBackend, FakeEngine};
use ds4_server::error::ServerError;
use ds4_server::{ServerConfig, TestServer};
use ds4_tokenizer::Tokenizer;
use serde_json::Value;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A scratch path for this process and `tag`, removed if a previous run left it.
pub fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ds4-server-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Stops a `ds4-server` process with SIGTERM (the clean shutdown path, which saves the
/// live session) and reaps it.
pub fn stop(mut child: Child) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let _ = child.wait();
}

pub fn tokenizer() -> Arc<Tokenizer> {
    let bytes =
        std::fs::read(root().join("fixtures/tiny/tokenizer.json")).expect("tiny tokenizer.json");
    Arc::new(Tokenizer::from_tokenizer_json(&bytes).expect("tokenizer"))
}

pub fn fake_server(cfg: ServerConfig) -> TestServer {
    fake_server_delay(cfg, 0)
}

pub fn fake_server_delay(cfg: ServerConfig, delay_ms: u64) -> TestServer {
    let tok = tokenizer();
    let eng = FakeEngine::new(tok.clone(), cfg.ctx, default_script())
        .with_delay(Duration::from_millis(delay_ms));
    TestServer::start(cfg, tok, Box::new(eng))
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// SSE frames as (event name, data).
    pub fn sse(&self) -> Vec<(Option<String>, String)> {
        let text = self.text();
        let mut out = Vec::new();
        for frame in text.split("\n\n") {
            let mut ev = None;
            let mut data = None;
            for line in frame.lines() {
                if let Some(e) = line.strip_prefix("event: ") {
                    ev = Some(e.to_string());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = Some(d.to_string());
                }
            }
            if let Some(d) = data {
                out.push((ev, d));
            }
        }
        out
    }
    pub fn sse_json(&self) -> Vec<Value> {
        self.sse()
            .into_iter()
            .filter(|(_, d)| d != "[DONE]")
            .map(|(_, d)| serde_json::from_str(&d).expect("event JSON"))
            .collect()
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        b = &b[nl + 2..];
        if size == 0 || b.len() < size {
            out.extend_from_slice(&b[..size.min(b.len())]);
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[(size + 2).min(b.len())..];
    }
    out
}

pub fn raw(addr: SocketAddr, request: &[u8]) -> Resp {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    // A server may answer (413) and close before reading a body it refuses: the
    // answer is still there to read.
    let _ = s.write_all(request);
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    parse(&buf)
}

pub fn parse(buf: &[u8]) -> Resp {
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end: {:?}", String::from_utf8_lossy(buf)));
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            l.split_once(": ")
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    let body = &buf[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    Resp {
        status,
        body: if chunked {
            dechunk(body)
        } else {
            body.to_vec()
        },
        headers,
    }
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in extra_headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    raw(addr, &bytes)
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(addr, "POST", path, &[], body.to_string().as_bytes())
}

/// `post`, the answer read as JSON.
pub fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Value {
    post(addr, path, body).json()
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"")
}

/// The first item of the JSON array `list` whose `type` is `ty` (an output item, a
/// content block); panics naming `ty` when there is none.
pub fn first_of<'a>(list: &'a Value, ty: &str) -> &'a Value {
    list.as_array()
        .unwrap_or_else(|| panic!("not an array: {list}"))
        .iter()
        .find(|o| o["type"] == ty)
        .unwrap_or_else(|| panic!("no {ty} item in {list}"))
}

pub fn weather_tool() -> Value {
    serde_json::json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

/// What a test adds around the engine's own work: called before each prefill call and
/// before each decode step, with the tokens the engine holds at that moment. Cloned with
/// the engine's snapshots, so a restored snapshot behaves like the engine it came from.
pub trait EngineHooks: Clone + Send + 'static {
    fn before_prefill(&mut self, _held: &[u32], _tokens: &[u32]) {}
    fn before_decode(&mut self, _held: &[u32], _token: u32) {}
    /// After every change of the held tokens (prefill, decode, a speculative cycle, reset,
    /// payload load), with the tokens now held.
    fn after_change(&mut self, _held: &[u32]) {}
}

/// An engine (the fake one, in these tests) with `EngineHooks` around prefill and decode;
/// everything else is the inner engine's.
pub struct Hooked<H: EngineHooks> {
    pub inner: Box<dyn EngineBackend>,
    pub hooks: H,
}

impl<H: EngineHooks> Hooked<H> {
    /// The fake engine for `cfg` over `tok`, with `hooks` around it.
    pub fn fake(cfg: &ServerConfig, tok: &Arc<Tokenizer>, hooks: H) -> Hooked<H> {
        Hooked {
            inner: Box::new(FakeEngine::new(tok.clone(), cfg.ctx, default_script())),
            hooks,
        }
    }
}

impl<H: EngineHooks> EngineBackend for Hooked<H> {
    fn ctx(&self) -> usize {
        self.inner.ctx()
    }
    fn quant_bits(&self) -> u8 {
        self.inner.quant_bits()
    }
    fn fingerprint(&self) -> [u8; 32] {
        self.inner.fingerprint()
    }
    fn tokens(&self) -> &[u32] {
        self.inner.tokens()
    }
    fn logits(&self) -> &[f32] {
        self.inner.logits()
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<(), ServerError> {
        self.hooks.before_prefill(self.inner.tokens(), tokens);
        let r = self.inner.prefill(tokens);
        self.changed(r)
    }
    fn decode(&mut self, token: u32) -> Result<(), ServerError> {
        self.hooks.before_decode(self.inner.tokens(), token);
        let r = self.inner.decode(token);
        self.changed(r)
    }
    fn reset(&mut self) {
        self.inner.reset();
        self.changed(())
    }
    fn snapshot(&self) -> Result<Box<dyn EngineBackend>, ServerError> {
        Ok(Box::new(Hooked {
            inner: self.inner.snapshot()?,
            hooks: self.hooks.clone(),
        }))
    }
    fn save_payload(&self, w: &mut dyn Write) -> Result<(), ServerError> {
        self.inner.save_payload(w)
    }
    fn load_payload(&mut self, r: &mut dyn Read) -> Result<(), ServerError> {
        let r = self.inner.load_payload(r);
        self.changed(r)
    }
    fn preferred_batch(&self) -> usize {
        self.inner.preferred_batch()
    }
    fn speculative(&self) -> bool {
        self.inner.speculative()
    }
    fn advance(
        &mut self,
        sampler: &mut ds4_engine::Sampler,
        token: u32,
        max: usize,
        stop: &[u32],
    ) -> Result<Vec<u32>, ServerError> {
        let r = self.inner.advance(sampler, token, max, stop);
        self.changed(r)
    }
    fn take_spec_stats(&mut self) -> ds4_engine::SpecStats {
        self.inner.take_spec_stats()
    }
}

impl<H: EngineHooks> Hooked<H> {
    /// Runs `after_change` and passes `r` through.
    fn changed<T>(&mut self, r: T) -> T {
        self.hooks.after_change(self.inner.tokens());
        r
    }
}

/// The tiny fixture model the real-engine tests run.
pub const TINY_MODEL: &str = "fixtures/tiny/tiny-q2.gguf";

/// Writes a synthetic MTP file (random weights, the published layout) into `dir`:
/// matching the tiny fixture model, or with `n_embd` another width (a file for another
/// model, which the engine refuses).
pub fn write_mtp_file(dir: &std::path::Path, n_embd: Option<usize>) -> PathBuf {
    use ds4_engine::dev::layout::ExpertQuant;
    use ds4_engine::dev::EngineExt;
    let opts = ds4_engine::EngineOptions {
        backend: ds4_engine::BackendChoice::Cpu { threads: None },
        ..Default::default()
    };
    let engine = ds4_engine::Engine::open(root().join(TINY_MODEL), opts).expect("tiny model");
    let mut cfg = engine.model().config().clone();
    if let Some(n) = n_embd {
        cfg.n_embd = n;
    }
    let image = ds4_synth::Plan::mtp(cfg, ExpertQuant::Q4, "ds4-server test MTP")
        .expect("MTP plan")
        .build(5, &|_| {});
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("mtp-{}.gguf", n_embd.unwrap_or(0)));
    std::fs::write(&path, image).unwrap();
    path
}
