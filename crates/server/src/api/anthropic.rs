//! Anthropic `/v1/messages` and `/v1/messages/count_tokens` (server.md §2.6).

use ds4_tokenizer::chat::{FunctionCall, Message, ToolCall};
use serde_json::{json, Map, Value};

use super::*;
use crate::bindings::{anthropic_live, AnthropicTurn, LiveRequest};
use crate::job::{Finish, Usage};
use crate::render::{self, resolve_think, thinking_flag, Conversation, ThinkControls};
use crate::sse::{named, SseFormatter};

fn block_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(items) => items
            .iter()
            .filter_map(|b| match b {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("text").and_then(Value::as_str).map(str::to_string),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// Image and document blocks (also inside a `tool_result`) are a 400: this model reads
/// text only.
fn reject_media(b: &Value) -> Result<(), ApiError> {
    match b
        .get("type")
        .and_then(Value::as_str)
        .and_then(media_part_error)
    {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn parse_system(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let parts: Vec<String> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|b| match b {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("text").and_then(Value::as_str).map(str::to_string),
                _ => None,
            })
            .collect(),
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid JSON request: `system` must be a string or an array",
            ))
        }
    };
    // Claude Code's billing header changes every request and would defeat KV reuse.
    let mut out = String::new();
    for p in parts.iter().filter(|p| !p.starts_with("x-anthropic-")) {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(p);
    }
    Ok(if out.is_empty() {
        Vec::new()
    } else {
        vec![out]
    })
}

/// The conversation, and per Anthropic message where it starts in it and which
/// `tool_result` ids it carries (for the live frontier, §4.2).
pub fn parse_conversation(
    o: &Map<String, Value>,
) -> Result<(Conversation, Vec<AnthropicTurn>), ApiError> {
    let msgs =
        get_array(o, "messages")?.ok_or_else(|| ApiError::bad_request("missing messages"))?;
    let mut conv = Conversation {
        system: parse_system(o.get("system"))?,
        ..Default::default()
    };
    if msgs.is_empty() {
        return Err(empty_messages("messages"));
    }
    let mut turns = Vec::with_capacity(msgs.len());
    for m in msgs {
        let m = m.as_object().ok_or_else(|| {
            ApiError::bad_request("invalid JSON request: each message must be an object")
        })?;
        let role = get_str(m, "role")?.unwrap_or("user");
        if role != "user" && role != "assistant" {
            return Err(unknown_role(role));
        }
        let blocks: Vec<Value> = match m.get("content") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(a)) => a.clone(),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "invalid JSON request: `content` must be a string or an array",
                ))
            }
        };
        turns.push(AnthropicTurn {
            first: conv.messages.len(),
            assistant: role == "assistant",
            results: Vec::new(),
        });
        if role == "assistant" {
            let mut content = String::new();
            let mut reasoning = String::new();
            let mut calls = Vec::new();
            for b in &blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => content.push_str(str_or_empty(b, "text")),
                    Some("thinking") => reasoning.push_str(str_or_empty(b, "thinking")),
                    Some("tool_use") => calls.push(ToolCall {
                        id: b.get("id").and_then(Value::as_str).map(str::to_string),
                        kind: Some("function".into()),
                        function: FunctionCall {
                            name: str_or_empty(b, "name").to_string(),
                            arguments: Value::String(
                                b.get("input")
                                    .cloned()
                                    .unwrap_or_else(|| json!({}))
                                    .to_string(),
                            ),
                            id: None,
                        },
                    }),
                    _ => {}
                }
            }
            let mut msg = Message::new("assistant", &content);
            msg.reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
            msg.tool_calls = (!calls.is_empty()).then_some(calls);
            conv.messages.push(msg);
        } else {
            // Blocks are classified by their own type (tool results become tool turns that
            // the encoder merges into the user turn).
            let mut text = String::new();
            for b in &blocks {
                reject_media(b)?;
                if let Some(Value::Array(inner)) = b.get("content") {
                    inner.iter().try_for_each(reject_media)?;
                }
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => text.push_str(str_or_empty(b, "text")),
                    Some("tool_result") => {
                        let mut t = Message::new(
                            "tool",
                            &block_text(b.get("content").unwrap_or(&Value::Null)),
                        );
                        t.tool_call_id = b
                            .get("tool_use_id")
                            .and_then(Value::as_str)
                            .map(str::to_string);
                        if let (Some(id), Some(turn)) = (&t.tool_call_id, turns.last_mut()) {
                            turn.results.push(id.clone());
                        }
                        conv.messages.push(t);
                    }
                    _ => {}
                }
            }
            if !text.is_empty()
                || !blocks
                    .iter()
                    .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
            {
                conv.messages.push(Message::new("user", &text));
            }
        }
    }
    if let Some(tools) = get_array(o, "tools")? {
        conv.tools = tools.clone();
    }
    conv.tools_disabled = o
        .get("tool_choice")
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        == Some("none");
    Ok((conv, turns))
}

fn think_controls(o: &Map<String, Value>) -> Result<ThinkControls, ApiError> {
    let mut c = ThinkControls::default();
    if let Some(v) = o.get("thinking") {
        c.enabled = thinking_flag(v)?;
    }
    if let Some(oc) = get_object(o, "output_config")? {
        c.effort = get_str(oc, "effort")?.map(str::to_string);
    }
    if c.effort.is_none() {
        c.effort = get_str(o, "reasoning_effort")?.map(str::to_string);
    }
    Ok(c)
}

struct Rendered {
    conv: Conversation,
    text: ds4_tokenizer::MarkedText,
    mode: crate::render::ThinkMode,
    model: String,
    live: LiveRequest,
}

/// Parses, validates tool results against the live frontier, and renders.
fn render_request(
    shared: &Shared,
    o: &Map<String, Value>,
    validate: bool,
) -> Result<Rendered, ApiError> {
    let (conv, turns) = parse_conversation(o)?;
    let model = get_str(o, "model")?
        .unwrap_or("deepseek-v4-flash")
        .to_string();
    let mode = resolve_think(&think_controls(o)?, &model, shared.cfg.ctx)?;
    let live_ids = shared.live_call_ids(crate::job::ApiKind::Anthropic);
    let mem = shared.cfg.exact_dsml_replay.then(|| shared.tool_memory());
    let live = if validate {
        anthropic_live(&conv, mode, mem.as_deref(), live_ids.as_deref(), &turns)?
    } else {
        LiveRequest::default()
    };
    let (text, _) = render::render_chat(&conv, mode, mem.as_deref())?;
    drop(mem);
    Ok(Rendered {
        conv,
        text,
        mode,
        model,
        live,
    })
}

pub fn prepare(shared: &Shared, body: &[u8]) -> Result<Prepared, ApiError> {
    let o = parse_body(body)?;
    let Rendered {
        conv,
        text,
        mode,
        model,
        live,
    } = render_request(shared, &o, true)?;
    let prompt_tokens = tokenize_checked(shared, &text, "messages")?;
    // Required, as in Anthropic's API (#18 item 12).
    let max_tokens = get_max_tokens(&o, &["max_tokens"], shared.cfg.max_tokens)?
        .ok_or_else(|| ApiError::bad_request("max_tokens: Field required"))?;
    Ok(Prepared {
        stream: get_bool(&o, "stream")?.unwrap_or(false),
        sampling: get_sampling(&o, false)?.for_mode(mode),
        stops: get_stops(shared, &o, "stop_sequences")?,
        live,
        max_tokens,
        raw: raw_request(shared, body),
        ..Prepared::structured(ApiKind::Anthropic, model, mode, conv, text, prompt_tokens)
    })
}

/// `/v1/messages/count_tokens`: the rendered prompt's token count.
pub fn count_tokens(shared: &Shared, body: &[u8]) -> Result<Value, ApiError> {
    let o = parse_body(body)?;
    // Counting needs no live state: unknown tool ids are not an error here.
    let text = render_request(shared, &o, false)?.text;
    let n = shared
        .tok
        .encode_marked(text.text(), text.plain_ranges())
        .len();
    Ok(json!({"input_tokens": n}))
}

/// (quirk fixed, §10.4) `input_tokens` counts the uncached prompt tokens instead of ≈0.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt - u.cached.min(u.prompt),
        "output_tokens": u.completion,
        "cache_read_input_tokens": u.cached,
        "cache_creation_input_tokens": 0,
    })
}

fn input_of(args: &str) -> Value {
    serde_json::from_str::<Value>(args)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}))
}

pub fn message_body(id: &str, model: &str, r: &GenResult) -> Value {
    let mut content = Vec::new();
    if let Some(rs) = r.reasoning.as_ref().filter(|s| !s.is_empty()) {
        content.push(json!({"type": "thinking", "thinking": rs, "signature": signature(id)}));
    }
    if !r.content.is_empty() {
        content.push(json!({"type": "text", "text": r.content}));
    }
    for c in &r.tool_calls {
        content.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input_of(&c.arguments)}));
    }
    if content.iter().all(|b| b["type"] == "thinking") {
        content.push(json!({"type": "text", "text": ""}));
    }
    json!({
        "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason(r), "stop_sequence": r.stop_sequence, "usage": usage_json(&r.usage),
    })
}

/// Thinking signatures are opaque to clients; ours only has to be stable per message.
fn signature(id: &str) -> String {
    format!("ds4:{id}")
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    None,
    Thinking,
    Text,
    Tool,
}

/// message_start … content_block_* (thinking, text, tool_use) … message_delta, message_stop.
pub struct MessageStream {
    pub id: String,
    pub model: String,
    open: Block,
    index: usize,
    started: bool,
    sent_text: bool,
}

impl MessageStream {
    pub fn new(id: String, model: String) -> MessageStream {
        MessageStream {
            id,
            model,
            open: Block::None,
            index: 0,
            started: false,
            sent_text: false,
        }
    }

    fn ev(name: &str, mut body: Value) -> String {
        let mut m = Map::new();
        m.insert("type".into(), json!(name));
        if let Some(o) = body.as_object_mut() {
            for (k, v) in std::mem::take(o) {
                m.insert(k, v);
            }
        }
        named(name, &Value::Object(m))
    }

    fn close(&mut self, out: &mut Vec<String>) {
        if self.open == Block::None {
            return;
        }
        if self.open == Block::Thinking {
            out.push(Self::ev("content_block_delta", json!({"index": self.index, "delta": {"type": "signature_delta", "signature": signature(&self.id)}})));
        }
        out.push(Self::ev("content_block_stop", json!({"index": self.index})));
        self.index += 1;
        self.open = Block::None;
    }

    fn open_block(&mut self, out: &mut Vec<String>, kind: Block, block: Value) {
        self.close(out);
        out.push(Self::ev(
            "content_block_start",
            json!({"index": self.index, "content_block": block}),
        ));
        self.open = kind;
    }

    fn start(&mut self, out: &mut Vec<String>, prompt: usize, cached: usize) {
        if self.started {
            return;
        }
        self.started = true;
        let usage = usage_json(&Usage {
            prompt,
            completion: 0,
            cached,
        });
        out.push(Self::ev("message_start", json!({"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": usage,
        }})));
    }
}

impl SseFormatter for MessageStream {
    fn event(&mut self, ev: GenEvent) -> Vec<String> {
        let mut out = Vec::new();
        match ev {
            GenEvent::Started { prompt, cached } => self.start(&mut out, prompt, cached),
            GenEvent::Reasoning(s) => {
                if self.open != Block::Thinking {
                    self.open_block(
                        &mut out,
                        Block::Thinking,
                        json!({"type": "thinking", "thinking": "", "signature": ""}),
                    );
                }
                out.push(Self::ev("content_block_delta", json!({"index": self.index, "delta": {"type": "thinking_delta", "thinking": s}})));
            }
            GenEvent::Content(s) => {
                if self.open != Block::Text {
                    self.open_block(&mut out, Block::Text, json!({"type": "text", "text": ""}));
                }
                self.sent_text = true;
                out.push(Self::ev(
                    "content_block_delta",
                    json!({"index": self.index, "delta": {"type": "text_delta", "text": s}}),
                ));
            }
            GenEvent::ToolStart { id, name, .. } => {
                self.open_block(
                    &mut out,
                    Block::Tool,
                    json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                );
            }
            GenEvent::ToolArgs { delta, .. } => {
                out.push(Self::ev("content_block_delta", json!({"index": self.index, "delta": {"type": "input_json_delta", "partial_json": delta}})));
            }
            GenEvent::Done(r) => {
                self.start(&mut out, r.usage.prompt, r.usage.cached);
                self.close(&mut out);
                for c in r.tool_calls.iter().skip(r.streamed_calls) {
                    self.open_block(
                        &mut out,
                        Block::Tool,
                        json!({"type": "tool_use", "id": c.id, "name": c.name, "input": {}}),
                    );
                    out.push(Self::ev("content_block_delta", json!({"index": self.index, "delta": {"type": "input_json_delta", "partial_json": c.arguments}})));
                    self.close(&mut out);
                }
                if !self.sent_text && r.tool_calls.is_empty() {
                    self.open_block(&mut out, Block::Text, json!({"type": "text", "text": ""}));
                    self.close(&mut out);
                }
                if r.finish == Finish::Error {
                    let msg = r
                        .error
                        .clone()
                        .unwrap_or_else(|| "generation failed".into());
                    out.push(Self::ev(
                        "error",
                        json!({"error": {"type": "api_error", "message": msg}}),
                    ));
                }
                out.push(Self::ev(
                    "message_delta",
                    json!({
                        "delta": {"stop_reason": stop_reason(&r), "stop_sequence": r.stop_sequence},
                        "usage": {"output_tokens": r.usage.completion},
                    }),
                ));
                out.push(Self::ev("message_stop", json!({})));
            }
            GenEvent::Failed { message, .. } => {
                out.push(Self::ev(
                    "error",
                    json!({"error": {"type": "api_error", "message": message}}),
                ));
            }
            GenEvent::Progress { .. } => {}
        }
        out
    }
}

/// Anthropic's `stop_reason`: `stop_sequence` when one of the request's
/// `stop_sequences` ended the reply (named in `stop_sequence`), else the finish's.
fn stop_reason(r: &crate::job::GenResult) -> &'static str {
    if r.finish == Finish::Stop && r.stop_sequence.is_some() {
        "stop_sequence"
    } else {
        r.finish.anthropic()
    }
}
