//! Request parsing and response shaping for each API. Parsing is strict about the types
//! of known fields (400 `invalid JSON request`) and ignores unknown fields.

pub mod anthropic;
pub mod openai;
pub mod responses;

use std::time::Instant;

use serde_json::{Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::job::{ApiKind, GenEvent, GenJob, GenResult, Sampling};
use crate::render::ThinkMode;
use crate::worker::Shared;

/// The deepest JSON nesting accepted (a DoS guard; the reference uses 256).
pub const MAX_NESTING: usize = 256;

/// Parses a request body into a JSON object, checking nesting depth first so a hostile
/// body cannot exhaust the stack.
pub fn parse_body(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let mut depth = 0usize;
    let mut in_str = false;
    let mut esc = false;
    for &b in body {
        if in_str {
            if esc {
                esc = false;
            } else if b == b'\\' {
                esc = true;
            } else if b == b'"' {
                in_str = false;
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Err(ApiError::bad_request(format!(
                        "invalid JSON request: nesting deeper than {MAX_NESTING}"
                    )));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    // serde_json's own recursion limit (128) also applies; deeper input is a 400 too.
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON request: {e}")))?;
    match v {
        Value::Object(o) => Ok(o),
        _ => Err(ApiError::bad_request(
            "invalid JSON request: the body must be a JSON object",
        )),
    }
}

fn type_error(key: &str, want: &str) -> ApiError {
    ApiError::bad_request(format!("invalid JSON request: `{key}` must be {want}"))
}

/// `v[key]` when it is a string, else "" (lenient reads of content blocks).
pub fn str_or_empty<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// `o[key]` through `pick`: None when absent or null, 400 ("must be `want`") when
/// `pick` rejects the value's JSON type.
fn typed<'a, T>(
    o: &'a Map<String, Value>,
    key: &str,
    want: &str,
    pick: impl FnOnce(&'a Value) -> Option<T>,
) -> Result<Option<T>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => pick(v).map(Some).ok_or_else(|| type_error(key, want)),
    }
}

pub fn get_str<'a>(o: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, ApiError> {
    typed(o, key, "a string", Value::as_str)
}

pub fn get_bool(o: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    typed(o, key, "a boolean", Value::as_bool)
}

/// Non-finite values (out of f32 range) read as absent.
pub fn get_f32(o: &Map<String, Value>, key: &str) -> Result<Option<f32>, ApiError> {
    let n = typed(o, key, "a number", Value::as_number)?;
    Ok(n.and_then(|n| n.as_f64().map(|f| f as f32).filter(|f| f.is_finite())))
}

/// Integers: any number, negative values clamp to 0 (`max_tokens:-5` → 0).
pub fn get_usize(o: &Map<String, Value>, key: &str) -> Result<Option<usize>, ApiError> {
    let n = typed(o, key, "an integer", Value::as_number)?;
    Ok(n.map(|n| {
        let f = n.as_f64().unwrap_or(0.0);
        if f <= 0.0 {
            0
        } else if f >= usize::MAX as f64 {
            usize::MAX
        } else {
            f as usize
        }
    }))
}

/// The output-token limit: the first of `keys` present, which must be a positive
/// integer (#18 item 12: `max_tokens: -1` used to clamp to 0 and answer an empty 200),
/// capped at `cap`. None when none is given.
pub fn get_max_tokens(
    o: &Map<String, Value>,
    keys: &[&str],
    cap: usize,
) -> Result<Option<usize>, ApiError> {
    for &key in keys {
        let Some(n) = typed(o, key, "an integer", Value::as_number)? else {
            continue;
        };
        if n.as_f64().is_none_or(|f| f < 1.0) {
            return Err(ApiError::bad_request(format!(
                "`{key}` must be a positive integer"
            )));
        }
        return Ok(get_usize(o, key)?.map(|v| v.min(cap)));
    }
    Ok(None)
}

/// `n` (OpenAI): one choice per request is all the engine makes; asking for more is a
/// 400 rather than a silently shorter answer (#18 item 12).
pub fn check_single_choice(o: &Map<String, Value>) -> Result<(), ApiError> {
    match typed(o, "n", "an integer", Value::as_number)? {
        Some(n) if n.as_f64() != Some(1.0) => Err(ApiError::bad_request("only n=1 is supported")),
        _ => Ok(()),
    }
}

/// A 400 for content parts this text-only model cannot read (images, audio, files),
/// None for any other part type. Dropping them silently would answer a question the
/// client did not ask (#18 item 12).
pub fn media_part_error(ty: &str) -> Option<ApiError> {
    let what = match ty {
        "image" | "image_url" | "input_image" => "images are",
        "audio" | "input_audio" => "audio inputs are",
        "file" | "input_file" | "document" => "file inputs are",
        _ => return None,
    };
    Some(ApiError::bad_request(format!(
        "{what} not supported by this model (content part type {ty})"
    )))
}

/// The 400 for a message role an API does not define (#18 item 12: unknown roles used
/// to be skipped, leaving a prompt of BOS alone).
pub fn unknown_role(role: &str) -> ApiError {
    ApiError::bad_request(format!(
        "invalid JSON request: unknown message role {role:?}"
    ))
}

/// The 400 for an empty conversation (#18 item 12).
pub fn empty_messages(key: &str) -> ApiError {
    ApiError::bad_request(format!("`{key}` must not be empty"))
}

pub fn get_u64(o: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    Ok(get_usize(o, key)?.map(|v| v as u64))
}

pub fn get_array<'a>(
    o: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a Vec<Value>>, ApiError> {
    typed(o, key, "an array", Value::as_array)
}

pub fn get_object<'a>(
    o: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>, ApiError> {
    typed(o, key, "an object", Value::as_object)
}

/// `stop`: a string or an array of strings (empty strings ignored), at most
/// `--max-stops` of at most `--max-stop-bytes` each: the stop filter scans every one
/// over a window as long as the longest on each token, on the only engine thread
/// (#18 item 8: 50 × 1 MB stop strings held it 73 s).
pub fn get_stops(
    shared: &Shared,
    o: &Map<String, Value>,
    key: &str,
) -> Result<Vec<String>, ApiError> {
    let stops = stop_list(o, key)?;
    let (max_n, max_len) = (shared.cfg.max_stops, shared.cfg.max_stop_bytes);
    if stops.len() > max_n {
        return Err(ApiError::bad_request(format!(
            "`{key}` has {} entries; at most {max_n} are allowed",
            stops.len()
        )));
    }
    if let Some(s) = stops.iter().find(|s| s.len() > max_len) {
        return Err(ApiError::bad_request(format!(
            "`{key}` has an entry of {} bytes; at most {max_len} bytes are allowed",
            s.len()
        )));
    }
    Ok(stops)
}

fn stop_list(o: &Map<String, Value>, key: &str) -> Result<Vec<String>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| type_error(key, "a string or an array of strings"))
            })
            .filter(|r| !matches!(r, Ok(s) if s.is_empty()))
            .collect(),
        Some(_) => Err(type_error(key, "a string or an array of strings")),
    }
}

/// Sampling fields shared by the OpenAI chat/completions and Anthropic requests.
pub fn get_sampling(o: &Map<String, Value>, min_p_seed: bool) -> Result<Sampling, ApiError> {
    let mut s = Sampling::default();
    if let Some(t) = get_f32(o, "temperature")? {
        s.temperature = t;
    }
    if let Some(t) = get_f32(o, "top_p")? {
        s.top_p = t;
    }
    if let Some(k) = get_usize(o, "top_k")? {
        s.top_k = k;
    }
    if min_p_seed {
        if let Some(m) = get_f32(o, "min_p")? {
            s.min_p = m;
        }
        if let Some(seed) = get_u64(o, "seed")? {
            s.seed = seed;
        }
    }
    Ok(s)
}

/// What the API layer hands to the worker, plus what it needs to shape the answer.
#[derive(Clone)]
pub struct Prepared {
    pub kind: ApiKind,
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    /// The rendered prompt (markers as text), the byte ranges of client text in it
    /// (tokenized with no control-token matching: `Tokenizer::encode_marked`) and its
    /// tokens. Every re-tokenization of a part of the prompt uses the same ranges.
    pub prompt_text: String,
    pub prompt_plain: Vec<std::ops::Range<usize>>,
    pub prompt_tokens: Vec<u32>,
    pub mode: ThinkMode,
    /// Parse the output for reasoning and DSML tool calls (false for /v1/completions).
    pub structured: bool,
    pub tools_active: bool,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub stops: Vec<String>,
    /// Raw request JSON for `--trace`.
    pub raw: Option<String>,
    /// The parsed conversation (chat endpoints): the worker renders the visible
    /// transcript of the turn from it (bindings, canonical rebuild).
    pub conv: Option<std::sync::Arc<crate::render::Conversation>>,
    /// Responses: the client opted into reasoning summaries (it replays reasoning on
    /// tool turns).
    pub summary: bool,
    /// The request side of a live continuation (§4.2).
    pub live: crate::bindings::LiveRequest,
}

impl Prepared {
    /// A structured (chat-style) request over the parsed conversation `conv`, rendered
    /// to `prompt_text` / `prompt_tokens`: usage reported, no stop strings, default
    /// sampling, no live continuation, no trace. Callers override what their API reads.
    pub fn structured(
        kind: ApiKind,
        model: String,
        mode: ThinkMode,
        conv: crate::render::Conversation,
        prompt: ds4_tokenizer::MarkedText,
        prompt_tokens: Vec<u32>,
    ) -> Prepared {
        let (prompt_text, prompt_plain) = prompt.into_parts();
        Prepared {
            kind,
            model,
            stream: false,
            include_usage: true,
            prompt_text,
            prompt_plain,
            prompt_tokens,
            mode,
            structured: true,
            tools_active: conv.tools_active(),
            max_tokens: 0,
            sampling: Sampling::default(),
            stops: Vec::new(),
            raw: None,
            conv: Some(std::sync::Arc::new(conv)),
            summary: false,
            live: Default::default(),
        }
    }
}

/// The generation endpoints, by the API their bodies follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
    /// `/v1/responses`
    Responses,
    /// `/v1/messages`
    Messages,
}

impl Endpoint {
    pub const ALL: [Endpoint; 4] = [
        Endpoint::Chat,
        Endpoint::Completions,
        Endpoint::Responses,
        Endpoint::Messages,
    ];
}

/// Parses, renders and tokenizes one request body exactly as its endpoint does, with no
/// HTTP and no engine: the `request_prompt` fuzz target drives the whole request →
/// prompt path through this.
pub fn prepare_request(shared: &Shared, ep: Endpoint, body: &[u8]) -> Result<Prepared, ApiError> {
    match ep {
        Endpoint::Chat => openai::prepare_chat(shared, body),
        Endpoint::Completions => openai::prepare_completion(shared, body),
        Endpoint::Responses => responses::prepare(shared, body).map(|(p, _)| p),
        Endpoint::Messages => anthropic::prepare(shared, body),
    }
}

/// The raw request body, kept for `--trace` only.
pub fn raw_request(shared: &Shared, body: &[u8]) -> Option<String> {
    shared
        .cfg
        .trace
        .is_some()
        .then(|| String::from_utf8_lossy(body).into_owned())
}

/// Tokenizes the rendered prompt (client text plain) and enforces the context limit
/// (§2.2 errors).
pub fn tokenize_checked(
    shared: &Shared,
    text: &ds4_tokenizer::MarkedText,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let toks = shared.tok.encode_marked(text.text(), text.plain_ranges());
    if toks.len() >= shared.cfg.ctx {
        return Err(ApiError::context_exceeded(
            toks.len(),
            shared.cfg.ctx,
            param,
        ));
    }
    Ok(toks)
}

/// Queues the job and returns the event channel.
pub fn submit(shared: &Shared, p: &Prepared) -> Result<UnboundedReceiver<GenEvent>, ApiError> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let job = GenJob {
        id: shared.next_id(),
        req: p.clone(),
        tx,
        enqueued: Instant::now(),
    };
    shared.submit(job)?;
    Ok(rx)
}

/// Waits for a non-streaming result.
pub async fn collect(mut rx: UnboundedReceiver<GenEvent>) -> Result<GenResult, ApiError> {
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Done(r) => return Ok(*r),
            GenEvent::Failed { status, message } => {
                let kind = if (400..500).contains(&status) {
                    "invalid_request_error"
                } else {
                    "server_error"
                };
                return Err(ApiError::new(status, kind, message));
            }
            _ => {}
        }
    }
    Err(ApiError::internal("the engine stopped before answering"))
}

pub fn unix_now() -> u64 {
    crate::kvcache::disk::now_secs()
}
