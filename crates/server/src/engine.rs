//! The engine behind the worker: a small trait so the HTTP, streaming and cache logic can
//! be tested with a deterministic fake, and its implementation over `ds4_engine::Session`.

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ds4_engine::{Engine, EngineError, Sampler, Session, SpecStats, Speculator};
use ds4_tokenizer::Tokenizer;

use crate::error::ServerError;

/// One live timeline: tokens evaluated so far and the logits after the last one.
pub trait EngineBackend: Send {
    /// Context capacity in tokens.
    fn ctx(&self) -> usize;
    /// Routed-expert quantisation bits of the model (2 or 4), written into KVC headers.
    fn quant_bits(&self) -> u8;
    /// The model's identity ([`ds4_engine::ModelInfo::fingerprint`]), written into and
    /// checked against the integrity section of KVC files.
    fn fingerprint(&self) -> [u8; 32];
    fn tokens(&self) -> &[u32];
    /// Next-token logits (empty before the first token).
    fn logits(&self) -> &[f32];
    /// Evaluates `tokens` after the current ones.
    fn prefill(&mut self, tokens: &[u32]) -> Result<(), ServerError>;
    /// Evaluates one token.
    fn decode(&mut self, token: u32) -> Result<(), ServerError>;
    /// Forgets every token.
    fn reset(&mut self);
    /// An independent copy of the whole state (for rewinding without a re-prefill);
    /// fails when the device has no memory for a second state.
    fn snapshot(&self) -> Result<Box<dyn EngineBackend>, ServerError>;
    /// The DSV4 session payload (model-spec.md §6).
    fn save_payload(&self, w: &mut dyn Write) -> Result<(), ServerError>;
    /// Replaces the state with a payload written by `save_payload`.
    fn load_payload(&mut self, r: &mut dyn Read) -> Result<(), ServerError>;
    /// Tokens per prefill call that keep the engine efficient.
    fn preferred_batch(&self) -> usize {
        512
    }
    /// Whether [`EngineBackend::advance`] drafts (an MTP block is loaded).
    fn speculative(&self) -> bool {
        false
    }
    /// One speculative cycle ([`Speculator::advance`]): decodes `token` and the accepted
    /// drafts, returns the tokens after `token` (at most `max`, the last one not
    /// decoded, ending at a token of `stop`). Only called when `speculative()`.
    fn advance(
        &mut self,
        _sampler: &mut Sampler,
        _token: u32,
        _max: usize,
        _stop: &[u32],
    ) -> Result<Vec<u32>, ServerError> {
        Err(ServerError::Invalid("this engine has no MTP block".into()))
    }
    /// The speculative counters since the last call (zero without MTP).
    fn take_spec_stats(&mut self) -> SpecStats {
        SpecStats::default()
    }
    /// The engine session behind this timeline, for a batched decode over several of
    /// them ([`decode_batch`]); `None` for engines that decode one at a time.
    fn session_mut(&mut self) -> Option<&mut Session> {
        None
    }
    /// Whether [`EngineBackend::session_mut`] answers (checked first, so that a row
    /// without one can still be used after the check).
    fn has_session(&self) -> bool {
        false
    }
    /// Bytes of KV state this timeline holds, when the engine can tell cheaply
    /// (`/metrics`).
    fn kv_bytes(&self) -> Option<u64> {
        None
    }
    /// Whether the KV state lives in device memory (sizes the default session pool).
    fn on_device(&self) -> bool {
        false
    }
    /// (free device bytes, bytes of one more session) when sessions live on a GPU.
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }
}

/// One decode token for each of several timelines (the continuous-batching worker's
/// step): rows backed by an engine [`Session`] go through [`Session::decode_batch`] (one
/// pass over the weights for all of them where the backend implements it), the others
/// decode one by one. Results are per row and in order; a failed row is unchanged.
pub fn decode_batch(rows: Vec<(&mut dyn EngineBackend, u32)>) -> Vec<Result<(), ServerError>> {
    let mut out: Vec<Option<Result<(), ServerError>>> = (0..rows.len()).map(|_| None).collect();
    let mut batch: Vec<(&mut Session, u32)> = Vec::new();
    let mut at: Vec<usize> = Vec::new();
    for (i, (e, t)) in rows.into_iter().enumerate() {
        if e.has_session() {
            let s = e.session_mut().expect("has_session said so");
            batch.push((s, t));
            at.push(i);
        } else {
            out[i] = Some(e.decode(t));
        }
    }
    for (i, r) in at.into_iter().zip(Session::decode_batch(&mut batch)) {
        out[i] = Some(r.map_err(ServerError::from));
    }
    out.into_iter()
        .map(|r| r.expect("every row answered"))
        .collect()
}

/// The real engine: a `ds4_engine::Session` on the CPU or CUDA backend.
pub struct RealEngine {
    session: Session,
    quant_bits: u8,
    fingerprint: [u8; 32],
    /// `--mtp`: shared with the snapshots, which take over as the live session on a
    /// rewind (the draft state itself lives in each session's backend).
    spec: Option<Arc<Mutex<Speculator>>>,
}

impl RealEngine {
    /// A session of `engine`; `quant_bits` is [`Engine::routed_quant_bits`].
    pub fn new(engine: &Engine, session: Session) -> RealEngine {
        RealEngine {
            session,
            quant_bits: engine.routed_quant_bits(),
            fingerprint: engine.info().fingerprint,
            spec: None,
        }
    }

    /// Decodes speculatively with `spec` (`--mtp`).
    pub fn with_speculator(mut self, spec: Speculator) -> RealEngine {
        self.spec = Some(Arc::new(Mutex::new(spec)));
        self
    }

    fn spec(&self) -> Option<std::sync::MutexGuard<'_, Speculator>> {
        // Only the engine thread locks it; a poisoned lock still holds valid counters.
        self.spec
            .as_ref()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl EngineBackend for RealEngine {
    fn preferred_batch(&self) -> usize {
        self.session.preferred_batch()
    }
    fn speculative(&self) -> bool {
        self.spec.is_some()
    }
    fn advance(
        &mut self,
        sampler: &mut Sampler,
        token: u32,
        max: usize,
        stop: &[u32],
    ) -> Result<Vec<u32>, ServerError> {
        let Some(spec) = self.spec.clone() else {
            return Err(ServerError::Invalid("this engine has no MTP block".into()));
        };
        let mut spec = spec.lock().unwrap_or_else(|e| e.into_inner());
        Ok(spec.advance(&mut self.session, sampler, token, max, stop)?)
    }
    fn session_mut(&mut self) -> Option<&mut Session> {
        Some(&mut self.session)
    }
    fn on_device(&self) -> bool {
        self.session.backend_name() != "cpu"
    }
    fn kv_bytes(&self) -> Option<u64> {
        self.session.kv_bytes()
    }
    fn device_memory(&self) -> Option<(u64, u64)> {
        self.session.device_memory()
    }
    fn has_session(&self) -> bool {
        true
    }
    fn take_spec_stats(&mut self) -> SpecStats {
        let Some(mut spec) = self.spec() else {
            return SpecStats::default();
        };
        let s = spec.stats();
        spec.reset_stats();
        s
    }
    fn ctx(&self) -> usize {
        self.session.ctx()
    }
    fn quant_bits(&self) -> u8 {
        self.quant_bits
    }
    fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }
    fn tokens(&self) -> &[u32] {
        self.session.tokens()
    }
    fn logits(&self) -> &[f32] {
        self.session.logits()
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<(), ServerError> {
        Ok(self.session.prefill(tokens)?)
    }
    fn decode(&mut self, token: u32) -> Result<(), ServerError> {
        self.session.decode(token)?;
        Ok(())
    }
    fn reset(&mut self) {
        self.session.reset();
    }
    fn snapshot(&self) -> Result<Box<dyn EngineBackend>, ServerError> {
        Ok(Box::new(RealEngine {
            session: self.session.try_clone()?,
            quant_bits: self.quant_bits,
            fingerprint: self.fingerprint,
            spec: self.spec.clone(),
        }))
    }
    fn save_payload(&self, mut w: &mut dyn Write) -> Result<(), ServerError> {
        Ok(self.session.save_payload(&mut w)?)
    }
    fn load_payload(&mut self, mut r: &mut dyn Read) -> Result<(), ServerError> {
        let res = self.session.load_payload(&mut r);
        if res.is_err() {
            // A failed load may leave partial state behind: start clean.
            self.session.reset();
        }
        Ok(res?)
    }
}

/// The fake engine's model identity unless a test picks another.
pub const FAKE_FINGERPRINT: [u8; 32] = *b"ds4 fake engine fingerprint v1\0\0";

/// What the fake engine answers to a prompt (the decoded prompt text → the reply text).
pub type Script = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// A deterministic engine for tests: after each prefill it renders `script(prompt)` into
/// tokens and makes them the argmax, one by one, followed by EOS. Logits are one-hot with
/// a large margin, so every sampler setting picks the scripted token.
#[derive(Clone)]
pub struct FakeEngine {
    tok: Arc<Tokenizer>,
    script: Script,
    ctx: usize,
    tokens: Vec<u32>,
    logits: Vec<f32>,
    reply: Vec<u32>,
    gen_start: usize,
    eos: u32,
    delay: Duration,
    fingerprint: [u8; 32],
    /// [`FakeEngine::with_call_log`]: shared by every copy of this engine.
    calls: Option<CallLog>,
}

/// The engine calls of a fake engine and its copies, in order: `Prefill(n)` for a
/// prefill of `n` tokens, `Decode` for one token (tests of the worker's scheduling).
pub type CallLog = Arc<Mutex<Vec<Call>>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Prefill(usize),
    Decode,
}

impl FakeEngine {
    pub fn new(tok: Arc<Tokenizer>, ctx: usize, script: Script) -> FakeEngine {
        let eos = tok.special_ids().map(|s| s.eos).unwrap_or(1);
        FakeEngine {
            tok,
            script,
            ctx,
            tokens: Vec::new(),
            logits: Vec::new(),
            reply: Vec::new(),
            gen_start: 0,
            eos,
            delay: Duration::ZERO,
            fingerprint: FAKE_FINGERPRINT,
            calls: None,
        }
    }

    /// Records every prefill and decode (of this engine and its copies) in `log`.
    pub fn with_call_log(mut self, log: CallLog) -> FakeEngine {
        self.calls = Some(log);
        self
    }

    fn record(&self, c: Call) {
        if let Some(l) = &self.calls {
            l.lock().unwrap_or_else(|e| e.into_inner()).push(c);
        }
    }

    /// Sleep per evaluated token (to test keepalive, cancellation and queueing).
    pub fn with_delay(mut self, delay: Duration) -> FakeEngine {
        self.delay = delay;
        self
    }

    /// Another model identity (tests: a cache file of another model with the same shapes).
    pub fn with_fingerprint(mut self, fingerprint: [u8; 32]) -> FakeEngine {
        self.fingerprint = fingerprint;
        self
    }

    fn update_logits(&mut self) {
        let vocab = self.tok.vocab_size();
        let idx = self.tokens.len() - self.gen_start;
        let next = self.reply.get(idx).copied().unwrap_or(self.eos);
        self.logits = vec![0.0; vocab];
        self.logits[next as usize % vocab] = 100.0;
    }

    fn check_room(&self, n: usize) -> Result<(), ServerError> {
        if self.tokens.len() + n > self.ctx {
            return Err(EngineError::ContextFull {
                ctx: self.ctx,
                have: self.tokens.len(),
                adding: n,
            }
            .into());
        }
        Ok(())
    }
}

impl EngineBackend for FakeEngine {
    fn ctx(&self) -> usize {
        self.ctx
    }
    fn kv_bytes(&self) -> Option<u64> {
        // What its payload holds: one u32 per token.
        Some(4 * self.tokens.len() as u64)
    }
    fn quant_bits(&self) -> u8 {
        2
    }
    fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }
    fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn logits(&self) -> &[f32] {
        &self.logits
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<(), ServerError> {
        self.check_room(tokens.len())?;
        self.record(Call::Prefill(tokens.len()));
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay * tokens.len().min(50) as u32);
        }
        self.tokens.extend_from_slice(tokens);
        let text = self.tok.decode(&self.tokens, false);
        self.reply = self.tok.encode(&(self.script)(&text));
        self.gen_start = self.tokens.len();
        self.update_logits();
        Ok(())
    }
    fn decode(&mut self, token: u32) -> Result<(), ServerError> {
        self.check_room(1)?;
        self.record(Call::Decode);
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        self.tokens.push(token);
        self.update_logits();
        Ok(())
    }
    fn reset(&mut self) {
        self.tokens.clear();
        self.logits.clear();
        self.reply.clear();
        self.gen_start = 0;
    }
    fn snapshot(&self) -> Result<Box<dyn EngineBackend>, ServerError> {
        Ok(Box::new(self.clone()))
    }
    fn save_payload(&self, w: &mut dyn Write) -> Result<(), ServerError> {
        // Same header idea as DSV4 (magic, version, count) so corrupt files are caught.
        let mut out = Vec::with_capacity(12 + 4 * self.tokens.len());
        out.extend_from_slice(b"FAKE");
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&(self.tokens.len() as u32).to_le_bytes());
        for t in &self.tokens {
            out.extend_from_slice(&t.to_le_bytes());
        }
        w.write_all(&out)?;
        Ok(())
    }
    fn load_payload(&mut self, r: &mut dyn Read) -> Result<(), ServerError> {
        let mut all = Vec::new();
        r.read_to_end(&mut all)?;
        let bad = || ServerError::from(EngineError::Payload("not a fake payload".into()));
        if all.len() < 12 || &all[..4] != b"FAKE" {
            return Err(bad());
        }
        let n = u32::from_le_bytes([all[8], all[9], all[10], all[11]]) as usize;
        if all.len() != 12 + 4 * n || n >= self.ctx {
            return Err(bad());
        }
        let toks: Vec<u32> = all[12..]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        self.reset();
        self.prefill(&toks)
    }
}

/// The fake engine's default script, used by `--fake-engine` and the tests: a short
/// reasoning when the prompt opens one, a DSML call of the first tool when the last user
/// message mentions the weather, and a plain answer otherwise (also after tool results).
pub fn default_script() -> Script {
    Arc::new(|prompt: &str| {
        let mut out = String::new();
        if prompt.ends_with("<think>") {
            out.push_str("The user wants an answer. Let me think.</think>");
        }
        let last_user = prompt.rsplit("<｜User｜>").next().unwrap_or("");
        let after_tool = last_user.contains("<tool_result>");
        let tool = first_tool(prompt);
        if let (Some((name, param)), false) = (tool, after_tool) {
            if last_user.to_lowercase().contains("weather") {
                out.push_str("Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"");
                out.push_str(&name);
                out.push_str("\">\n<｜DSML｜parameter name=\"");
                out.push_str(&param);
                out.push_str("\" string=\"true\">Paris & \"Lyon\"</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
                return out;
            }
        }
        if after_tool {
            out.push_str("It is sunny in Paris.");
        } else if last_user.contains("long answer") {
            for i in 0..40 {
                out.push_str(&format!("word{i} "));
            }
        } else {
            out.push_str("Hello! I am a tiny fake model. STOP here.");
        }
        out
    })
}

/// The first tool name and its first property in the rendered tools block.
fn first_tool(prompt: &str) -> Option<(String, String)> {
    let tools = prompt.split("### Available Tool Schemas").nth(1)?;
    let name = quoted_after(tools, "\"name\": \"")?;
    let param = tools
        .split("\"properties\": {\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap_or("arg")
        .to_string();
    Some((name, param))
}

fn quoted_after(s: &str, key: &str) -> Option<String> {
    let rest = s.split(key).nth(1)?;
    Some(rest.split('"').next()?.to_string())
}
