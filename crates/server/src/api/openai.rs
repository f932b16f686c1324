//! OpenAI `/v1/chat/completions` and `/v1/completions` (server.md §2.3, §2.4).

use ds4_tokenizer::chat::{FunctionCall, Message, ToolCall};
use serde_json::{json, Map, Value};

use super::*;
use crate::job::{Finish, Usage};
use crate::render::{self, resolve_think, thinking_flag, Conversation, ThinkControls};
use crate::sse::{data, SseFormatter};

fn think_controls(o: &Map<String, Value>) -> Result<ThinkControls, ApiError> {
    let mut c = ThinkControls::default();
    if let Some(b) = get_bool(o, "think")? {
        c.enabled = Some(b);
    }
    if let Some(v) = o.get("thinking") {
        if let Some(b) = thinking_flag(v)? {
            c.enabled = Some(b);
        }
    }
    c.effort = get_str(o, "reasoning_effort")?.map(str::to_string);
    Ok(c)
}

/// `arguments` as JSON text: a string is kept, an object is serialised.
fn arguments_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn parse_messages(o: &Map<String, Value>) -> Result<Conversation, ApiError> {
    let msgs =
        get_array(o, "messages")?.ok_or_else(|| ApiError::bad_request("missing messages"))?;
    if msgs.is_empty() {
        return Err(empty_messages("messages"));
    }
    let mut conv = Conversation::default();
    for m in msgs {
        let m = m.as_object().ok_or_else(|| {
            ApiError::bad_request("invalid JSON request: each message must be an object")
        })?;
        let role = get_str(m, "role")?.unwrap_or("user");
        let content = render::content_text(m.get("content").unwrap_or(&Value::Null))?;
        match role {
            "system" | "developer" => conv.system.push(content),
            "user" => conv.messages.push(Message::new("user", &content)),
            "tool" | "function" => {
                let mut msg = Message::new("tool", &content);
                msg.tool_call_id = get_str(m, "tool_call_id")?.map(str::to_string);
                conv.messages.push(msg);
            }
            "assistant" => {
                let mut msg = Message::new("assistant", &content);
                msg.reasoning_content = get_str(m, "reasoning_content")?
                    .or(get_str(m, "reasoning")?)
                    .map(str::to_string);
                if let Some(calls) = get_array(m, "tool_calls")? {
                    let mut out = Vec::new();
                    for c in calls {
                        let Some(f) = c.get("function").and_then(Value::as_object) else {
                            continue;
                        };
                        let (Some(name), Some(args)) =
                            (f.get("name").and_then(Value::as_str), f.get("arguments"))
                        else {
                            continue;
                        };
                        out.push(ToolCall {
                            id: c.get("id").and_then(Value::as_str).map(str::to_string),
                            kind: Some("function".into()),
                            function: FunctionCall {
                                name: name.to_string(),
                                arguments: Value::String(arguments_text(args)),
                                id: None,
                            },
                        });
                    }
                    if !out.is_empty() {
                        msg.tool_calls = Some(out);
                    }
                }
                conv.messages.push(msg);
            }
            other => return Err(unknown_role(other)),
        }
    }
    if let Some(tools) = get_array(o, "tools")? {
        conv.tools = tools.clone();
    }
    conv.tools_disabled = matches!(o.get("tool_choice"), Some(Value::String(s)) if s == "none");
    Ok(conv)
}

/// Fields shared by chat and completions.
type Common = (
    String,
    crate::render::ThinkMode,
    Sampling,
    usize,
    Vec<String>,
    bool,
    bool,
);

fn common(shared: &Shared, o: &Map<String, Value>, kind: ApiKind) -> Result<Common, ApiError> {
    let model = get_str(o, "model")?
        .unwrap_or("deepseek-v4-flash")
        .to_string();
    let mode = resolve_think(&think_controls(o)?, &model, shared.cfg.ctx)?;
    let sampling = get_sampling(o, true)?.for_mode(mode);
    let cap = shared.cfg.max_tokens;
    let max_tokens =
        get_max_tokens(o, &["max_completion_tokens", "max_tokens"], cap)?.unwrap_or(cap);
    check_single_choice(o)?;
    let stops = get_stops(shared, o, "stop")?;
    let stream = get_bool(o, "stream")?.unwrap_or(false);
    let include_usage = match get_object(o, "stream_options")? {
        Some(so) => get_bool(so, "include_usage")?.unwrap_or(false),
        None => false,
    };
    let _ = kind;
    Ok((
        model,
        mode,
        sampling,
        max_tokens,
        stops,
        stream,
        include_usage,
    ))
}

pub fn prepare_chat(shared: &Shared, body: &[u8]) -> Result<Prepared, ApiError> {
    let o = parse_body(body)?;
    let conv = parse_messages(&o)?;
    let (model, mode, sampling, max_tokens, stops, stream, include_usage) =
        common(shared, &o, ApiKind::Chat)?;
    let (text, _) = {
        let mem = shared.cfg.exact_dsml_replay.then(|| shared.tool_memory());
        render::render_chat(&conv, mode, mem.as_deref())?
    };
    let prompt_tokens = tokenize_checked(shared, &text, "messages")?;
    Ok(Prepared {
        stream,
        include_usage,
        sampling,
        stops,
        max_tokens,
        raw: raw_request(shared, body),
        ..Prepared::structured(ApiKind::Chat, model, mode, conv, text, prompt_tokens)
    })
}

pub fn prepare_completion(shared: &Shared, body: &[u8]) -> Result<Prepared, ApiError> {
    let o = parse_body(body)?;
    let prompt = match o.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => match a.first() {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(ApiError::bad_request("missing prompt")),
        },
        None | Some(Value::Null) => return Err(ApiError::bad_request("missing prompt")),
        Some(_) => {
            return Err(ApiError::bad_request(
                "invalid JSON request: `prompt` must be a string",
            ))
        }
    };
    let (model, mode, sampling, max_tokens, stops, stream, include_usage) =
        common(shared, &o, ApiKind::Completions)?;
    // The raw-prompt path: markers the client writes are control tokens.
    let text = ds4_tokenizer::MarkedText::trusted(&render::render_completion(&prompt, mode));
    let prompt_tokens = tokenize_checked(shared, &text, "prompt")?;
    Ok(Prepared {
        kind: ApiKind::Completions,
        model,
        stream,
        include_usage,
        prompt_text: text.into_parts().0,
        prompt_plain: Vec::new(),
        prompt_tokens,
        mode,
        structured: false,
        tools_active: false,
        max_tokens,
        sampling,
        stops,
        raw: raw_request(shared, body),
        conv: None,
        summary: false,
        live: Default::default(),
    })
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt,
        "completion_tokens": u.completion,
        "total_tokens": u.prompt + u.completion,
        "prompt_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": u.prompt - u.cached.min(u.prompt)},
    })
}

fn calls_json(r: &GenResult, from: usize, with_index: bool) -> Vec<Value> {
    r.tool_calls
        .iter()
        .enumerate()
        .skip(from)
        .map(|(i, c)| {
            let mut v = json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}});
            if with_index {
                v.as_object_mut().map(|m| m.insert("index".into(), json!(i)));
            }
            v
        })
        .collect()
}

pub fn chat_body(id: &str, model: &str, r: &GenResult) -> Value {
    let mut msg = Map::new();
    msg.insert("role".into(), json!("assistant"));
    msg.insert("content".into(), json!(r.content));
    if let Some(rs) = r.reasoning.as_ref().filter(|s| !s.is_empty()) {
        msg.insert("reasoning_content".into(), json!(rs));
    }
    if !r.tool_calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(calls_json(r, 0, false)));
    }
    json!({
        "id": id, "object": "chat.completion", "created": unix_now(), "model": model,
        "choices": [{"index": 0, "message": msg, "logprobs": null, "finish_reason": r.finish.openai()}],
        "usage": usage_json(&r.usage),
    })
}

pub fn completion_body(id: &str, model: &str, r: &GenResult) -> Value {
    json!({
        "id": id, "object": "text_completion", "created": unix_now(), "model": model,
        "choices": [{"text": r.content, "index": 0, "logprobs": null, "finish_reason": r.finish.openai()}],
        "usage": usage_json(&r.usage),
    })
}

fn error_frame(message: &str) -> String {
    data(&json!({"error": {"message": message, "type": "server_error"}}))
}

/// Chat stream: role chunk, reasoning/content deltas, tool-call deltas as soon as an
/// invocation is recognised, the finish chunk, optional usage, `[DONE]`.
pub struct ChatStream(pub StreamHead);

/// What every frame of an OpenAI stream names, and whether the client asked for a
/// usage frame at the end.
pub struct StreamHead {
    pub id: String,
    pub model: String,
    pub include_usage: bool,
    pub created: u64,
}

impl StreamHead {
    /// The head of a stream answering `p`, created now.
    pub fn new(id: String, p: &Prepared) -> StreamHead {
        StreamHead {
            id,
            model: p.model.clone(),
            include_usage: p.include_usage,
            created: unix_now(),
        }
    }

    /// One frame of stream object type `object` carrying `choices`.
    fn frame(&self, object: &str, choices: Value) -> String {
        data(&json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": choices,
        }))
    }

    /// The closing frames: the usage frame when asked for, then `[DONE]`.
    fn close(&self, object: &str, usage: &Usage, out: &mut Vec<String>) {
        if self.include_usage {
            out.push(data(&json!({
                "id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage_json(usage),
            })));
        }
        out.push("data: [DONE]\n\n".into());
    }
}

impl ChatStream {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> String {
        let choices =
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
        self.0.frame("chat.completion.chunk", choices)
    }
}

impl SseFormatter for ChatStream {
    fn event(&mut self, ev: GenEvent) -> Vec<String> {
        match ev {
            GenEvent::Started { .. } => vec![self.chunk(json!({"role": "assistant", "content": ""}), None)],
            GenEvent::Reasoning(s) => vec![self.chunk(json!({"reasoning_content": s}), None)],
            GenEvent::Content(s) => vec![self.chunk(json!({"content": s}), None)],
            GenEvent::ToolStart { index, id, name } => vec![self.chunk(
                json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                None,
            )],
            GenEvent::ToolArgs { index, delta } => {
                vec![self.chunk(json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}), None)]
            }
            GenEvent::Done(r) => {
                let mut out = Vec::new();
                if r.tool_calls.len() > r.streamed_calls {
                    out.push(self.chunk(json!({"tool_calls": calls_json(&r, r.streamed_calls, true)}), None));
                }
                if r.finish == Finish::Error {
                    if let Some(e) = &r.error {
                        out.push(error_frame(e));
                    }
                }
                out.push(self.chunk(json!({}), Some(r.finish.openai())));
                self.0.close("chat.completion.chunk", &r.usage, &mut out);
                out
            }
            GenEvent::Failed { message, .. } => vec![error_frame(&message)],
            GenEvent::Progress { .. } => Vec::new(),
        }
    }
}

/// Legacy completions stream: raw text deltas.
pub struct CompletionStream(pub StreamHead);

impl CompletionStream {
    fn chunk(&self, text: &str, finish: Option<&str>) -> String {
        let choices =
            json!([{"text": text, "index": 0, "logprobs": null, "finish_reason": finish}]);
        self.0.frame("text_completion", choices)
    }
}

impl SseFormatter for CompletionStream {
    fn event(&mut self, ev: GenEvent) -> Vec<String> {
        match ev {
            GenEvent::Content(s) | GenEvent::Reasoning(s) => vec![self.chunk(&s, None)],
            GenEvent::Done(r) => {
                let mut out = vec![self.chunk("", Some(r.finish.openai()))];
                self.0.close("text_completion", &r.usage, &mut out);
                out
            }
            GenEvent::Failed { message, .. } => vec![error_frame(&message)],
            _ => Vec::new(),
        }
    }
}
