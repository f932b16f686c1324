//! OpenAI `/v1/responses` (server.md §2.5): Codex CLI and pi.

use std::collections::HashMap;

use ds4_tokenizer::chat::{FunctionCall, Message, ToolCall};
use serde_json::{json, Map, Value};

use super::*;
use crate::gen::random_hex;
use crate::job::{Finish, Usage};
use crate::render::{self, resolve_think, Conversation, ThinkControls};
use crate::sse::{data, SseFormatter};

/// Output-side naming of flattened tools: flat name → (namespace, wire name, kind).
#[derive(Clone, Debug, Default)]
pub struct ToolNames {
    map: HashMap<String, (Option<String>, String, bool)>,
}

impl ToolNames {
    fn item(&self, id: &str, c: &crate::job::OutCall, status: &str) -> Value {
        let (ns, wire, search) =
            self.map
                .get(&c.name)
                .cloned()
                .unwrap_or((None, c.name.clone(), false));
        let fc_id = format!("fc_{}", &id[id.len().saturating_sub(24)..]);
        if search {
            let args: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
            return json!({"id": fc_id, "type": "tool_search_call", "status": status, "call_id": c.id, "execution": "client", "arguments": args});
        }
        let mut m = Map::new();
        m.insert("id".into(), json!(fc_id));
        m.insert("type".into(), json!("function_call"));
        m.insert("status".into(), json!(status));
        m.insert("name".into(), json!(wire));
        if let Some(ns) = ns {
            m.insert("namespace".into(), json!(ns));
        }
        m.insert("call_id".into(), json!(c.id));
        m.insert("arguments".into(), json!(c.arguments));
        Value::Object(m)
    }
}

fn flatten_tools(tools: &[Value], names: &mut ToolNames) -> Vec<Value> {
    let mut out = Vec::new();
    for t in tools {
        match t.get("type").and_then(Value::as_str) {
            Some("namespace") => {
                let ns = t.get("name").and_then(Value::as_str).unwrap_or("");
                for f in t
                    .get("tools")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let name = f.get("name").and_then(Value::as_str).unwrap_or("");
                    let flat = format!("{ns}{name}");
                    let params = f
                        .get("parameters")
                        .or(f.get("input_schema"))
                        .cloned()
                        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
                    out.push(json!({"name": flat, "description": f.get("description").cloned().unwrap_or(json!("")), "parameters": params}));
                    names
                        .map
                        .insert(flat, (Some(ns.to_string()), name.to_string(), false));
                }
            }
            Some("tool_search") => {
                out.push(json!({
                    "name": "tool_search",
                    "description": t.get("description").cloned().unwrap_or(json!("Search available tools.")),
                    "parameters": t.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object", "properties": {}})),
                }));
                names
                    .map
                    .insert("tool_search".into(), (None, "tool_search".into(), true));
            }
            Some("function") | Some("custom") | None => out.push(t.clone()),
            // Hosted tools (web_search, file_search, …) cannot run here.
            Some(_) => {}
        }
    }
    out
}

fn part_text(v: &Value) -> Result<String, ApiError> {
    crate::render::concat_parts(
        v,
        |p| match p {
            Value::String(s) => Ok(s),
            Value::Object(o) => match o.get("type").and_then(Value::as_str) {
                Some("input_text" | "output_text" | "text" | "summary_text" | "reasoning_text") => {
                    Ok(o.get("text").and_then(Value::as_str).unwrap_or(""))
                }
                Some(other) => Err(media_part_error(other).unwrap_or_else(|| {
                    ApiError::bad_request(format!("unsupported content part type {other}"))
                })),
                None => Err(ApiError::bad_request("content part without type")),
            },
            _ => Err(ApiError::bad_request("invalid content part")),
        },
        || ApiError::bad_request("invalid JSON request: `content` must be a string or an array"),
    )
}

fn output_text(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str).map(str::to_string))
            .collect::<Vec<_>>()
            .join(""),
        Some(other) => other.to_string(),
    }
}

fn push_call(conv: &mut Conversation, pending: &mut Option<String>, call: ToolCall) {
    if let Some(last) = conv.messages.last_mut().filter(|m| m.role == "assistant") {
        last.tool_calls.get_or_insert_with(Vec::new).push(call);
        return;
    }
    let mut m = Message::new("assistant", "");
    m.reasoning_content = pending.take();
    m.tool_calls = Some(vec![call]);
    conv.messages.push(m);
}

fn flush_reasoning(conv: &mut Conversation, pending: &mut Option<String>) {
    if let Some(r) = pending.take() {
        let mut m = Message::new("assistant", "");
        m.reasoning_content = Some(r);
        conv.messages.push(m);
    }
}

fn parse_input(
    o: &Map<String, Value>,
    conv: &mut Conversation,
    names: &mut ToolNames,
) -> Result<(), ApiError> {
    let input = o
        .get("input")
        .ok_or_else(|| ApiError::bad_request("missing input"))?;
    let items = match input {
        Value::String(s) => {
            conv.messages.push(Message::new("user", s));
            return Ok(());
        }
        Value::Array(a) if a.is_empty() => return Err(empty_messages("input")),
        Value::Array(a) => a,
        Value::Null => return Err(ApiError::bad_request("missing input")),
        _ => {
            return Err(ApiError::bad_request(
                "invalid JSON request: `input` must be a string or an array",
            ))
        }
    };
    let mut pending: Option<String> = None;
    for it in items {
        let it = it.as_object().ok_or_else(|| {
            ApiError::bad_request("invalid JSON request: input items must be objects")
        })?;
        if let Some(st) = get_str(it, "status")? {
            if !st.is_empty() && st != "completed" && st != "in_progress" {
                return Err(ApiError::bad_request(format!(
                    "input item status {st} is not supported"
                )));
            }
        }
        let ty = get_str(it, "type")?.unwrap_or("message");
        match ty {
            "message" => {
                let role = get_str(it, "role")?.unwrap_or("user");
                let text = part_text(it.get("content").unwrap_or(&Value::Null))?;
                match role {
                    "system" | "developer" => conv.system.push(text),
                    "assistant" => {
                        let mut m = Message::new("assistant", &text);
                        m.reasoning_content = pending.take();
                        conv.messages.push(m);
                    }
                    "user" => {
                        flush_reasoning(conv, &mut pending);
                        conv.messages.push(Message::new("user", &text));
                    }
                    other => return Err(unknown_role(other)),
                }
            }
            "reasoning" => {
                let mut parts = Vec::new();
                for key in ["summary", "content"] {
                    let t = output_text(it.get(key));
                    if !t.is_empty() {
                        parts.push(t);
                    }
                }
                let joined = parts.join("\n");
                pending = Some(match pending.take() {
                    Some(p) if !p.is_empty() => format!("{p}\n{joined}"),
                    _ => joined,
                });
            }
            "function_call"
            | "custom_tool_call"
            | "local_shell_call"
            | "web_search_call"
            | "tool_search_call"
            | "image_generation_call" => {
                let id = get_str(it, "call_id")?
                    .or(get_str(it, "id")?)
                    .map(str::to_string);
                let name = match ty {
                    "function_call" => {
                        let n = get_str(it, "name")?.unwrap_or("");
                        match get_str(it, "namespace")? {
                            Some(ns) => format!("{ns}{n}"),
                            None => n.to_string(),
                        }
                    }
                    "custom_tool_call" => get_str(it, "name")?.unwrap_or("").to_string(),
                    "local_shell_call" => "local_shell".into(),
                    "tool_search_call" => "tool_search".into(),
                    other => other.to_string(),
                };
                let args = ["arguments", "input", "action"]
                    .iter()
                    .find_map(|k| it.get(*k).filter(|v| !v.is_null()))
                    .map(|v| match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    })
                    .unwrap_or_else(|| "{}".into());
                let call = ToolCall {
                    id,
                    kind: Some("function".into()),
                    function: FunctionCall {
                        name,
                        arguments: Value::String(args),
                        id: None,
                    },
                };
                push_call(conv, &mut pending, call);
            }
            t if t.ends_with("_call_output") || t == "tool_search_output" => {
                flush_reasoning(conv, &mut pending);
                if t == "tool_search_output" {
                    let tools = it.get("tools").and_then(Value::as_array).ok_or_else(|| {
                        ApiError::bad_request("tool_search_output.tools must be an array")
                    })?;
                    let flat = flatten_tools(tools, names);
                    conv.tools.extend(flat);
                }
                let content = if t == "tool_search_output" {
                    it.get("tools").map(Value::to_string).unwrap_or_default()
                } else {
                    output_text(it.get("output").or(it.get("result")))
                };
                let mut m = Message::new("tool", &content);
                m.tool_call_id = get_str(it, "call_id")?.map(str::to_string);
                conv.messages.push(m);
            }
            "compaction" | "context_compaction" | "item_reference" => {}
            other => {
                return Err(ApiError::bad_request(format!(
                    "input item type {other} is not supported"
                )))
            }
        }
    }
    flush_reasoning(conv, &mut pending);
    Ok(())
}

/// Per-request state the Responses output needs.
pub struct ResponsesExtra {
    pub names: ToolNames,
    pub summary: bool,
}

pub fn prepare(shared: &Shared, body: &[u8]) -> Result<(Prepared, ResponsesExtra), ApiError> {
    let o = parse_body(body)?;
    for key in ["previous_response_id", "conversation"] {
        if o.get(key).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad_request(format!(
                "{key} is not supported; replay full input instead"
            )));
        }
    }
    let mut names = ToolNames::default();
    let mut conv = Conversation::default();
    if let Some(i) = get_str(&o, "instructions")? {
        if !i.is_empty() {
            conv.system.push(i.to_string());
        }
    }
    if let Some(tools) = get_array(&o, "tools")? {
        conv.tools = flatten_tools(tools, &mut names);
    }
    parse_input(&o, &mut conv, &mut names)?;
    match o.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "none" => conv.tools_disabled = true,
        Some(Value::String(s)) if s == "auto" || s == "required" => {}
        Some(Value::String(s)) => {
            return Err(ApiError::bad_request(format!(
                "tool_choice={s} not supported"
            )))
        }
        Some(_) => return Err(ApiError::bad_request("forced tool_choice not supported")),
    }
    let model = get_str(&o, "model")?
        .unwrap_or("deepseek-v4-flash")
        .to_string();
    let mut tc = ThinkControls::default();
    let mut summary = false;
    if let Some(r) = get_object(&o, "reasoning")? {
        if let Some(e) = get_str(r, "effort")? {
            tc.enabled = Some(e != "none");
            tc.effort = Some(e.to_string());
        }
        summary = matches!(
            get_str(r, "summary")?,
            Some("auto" | "concise" | "detailed")
        );
    }
    let mode = resolve_think(&tc, &model, shared.cfg.ctx)?;
    let live_ids = shared.live_call_ids(crate::job::ApiKind::Responses);
    let (text, live) = {
        let mem = shared.cfg.exact_dsml_replay.then(|| shared.tool_memory());
        let live =
            crate::bindings::responses_live(&conv, mode, mem.as_deref(), live_ids.as_deref())?;
        (render::render_chat(&conv, mode, mem.as_deref())?.0, live)
    };
    let prompt_tokens = tokenize_checked(shared, &text, "input")?;
    let cap = shared.cfg.max_tokens;
    let max_tokens = get_max_tokens(&o, &["max_output_tokens", "max_tokens"], cap)?.unwrap_or(cap);
    let mut sampling = Sampling::default();
    if let Some(t) = get_f32(&o, "temperature")? {
        sampling.temperature = t;
    }
    if let Some(t) = get_f32(&o, "top_p")? {
        sampling.top_p = t;
    }
    let p = Prepared {
        stream: get_bool(&o, "stream")?.unwrap_or(false),
        sampling: sampling.for_mode(mode),
        summary,
        live,
        max_tokens,
        raw: raw_request(shared, body),
        ..Prepared::structured(ApiKind::Responses, model, mode, conv, text, prompt_tokens)
    };
    Ok((p, ResponsesExtra { names, summary }))
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt,
        "input_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": u.prompt - u.cached.min(u.prompt)},
        "output_tokens": u.completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt + u.completion,
    })
}

fn status_of(f: Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::ToolCalls => "completed",
        Finish::Length => "incomplete",
        Finish::Error => "failed",
    }
}

/// Ids of one response's items.
pub struct Ids {
    pub resp: String,
    pub rs: String,
    pub msg: String,
    pub created: u64,
}

impl Ids {
    pub fn new() -> Ids {
        Ids {
            resp: random_hex("resp_", 12),
            rs: random_hex("rs_", 12),
            msg: random_hex("msg_", 12),
            created: unix_now(),
        }
    }
}

impl Default for Ids {
    fn default() -> Self {
        Ids::new()
    }
}

fn reasoning_item(ids: &Ids, text: &str, closed: bool) -> Value {
    json!({"id": ids.rs, "type": "reasoning", "status": if closed {"completed"} else {"incomplete"}, "summary": [{"type": "summary_text", "text": text}]})
}

fn message_item(ids: &Ids, text: &str, status: &str) -> Value {
    json!({"id": ids.msg, "type": "message", "status": status, "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

fn response_object(
    ids: &Ids,
    model: &str,
    status: &str,
    output: Vec<Value>,
    r: Option<&GenResult>,
) -> Value {
    let mut m = Map::new();
    m.insert("id".into(), json!(ids.resp));
    m.insert("object".into(), json!("response"));
    m.insert("created_at".into(), json!(ids.created));
    m.insert("status".into(), json!(status));
    m.insert("model".into(), json!(model));
    m.insert("output".into(), Value::Array(output));
    m.insert("parallel_tool_calls".into(), json!(true));
    m.insert("tool_choice".into(), json!("auto"));
    m.insert("tools".into(), json!([]));
    m.insert("error".into(), Value::Null);
    m.insert("incomplete_details".into(), Value::Null);
    if let Some(r) = r {
        match r.finish {
            Finish::Length => {
                m.insert(
                    "incomplete_details".into(),
                    json!({"reason": "max_output_tokens"}),
                );
            }
            Finish::Error => {
                m.insert("error".into(), json!({"code": "server_error", "message": r.error.clone().unwrap_or_else(|| "generation failed".into())}));
            }
            _ => {}
        }
        m.insert("usage".into(), usage_json(&r.usage));
    }
    Value::Object(m)
}

fn final_output(ids: &Ids, extra: &ResponsesExtra, r: &GenResult) -> Vec<Value> {
    let item_status = if matches!(r.finish, Finish::Length | Finish::Error) {
        "incomplete"
    } else {
        "completed"
    };
    let mut out = Vec::new();
    if let Some(rs) = r
        .reasoning
        .as_ref()
        .filter(|s| extra.summary && !s.is_empty())
    {
        out.push(reasoning_item(ids, rs, r.reasoning_closed));
    }
    if !r.content.is_empty() {
        out.push(message_item(ids, &r.content, item_status));
    }
    for c in &r.tool_calls {
        out.push(extra.names.item(&c.id, c, "completed"));
    }
    out
}

pub fn response_body(ids: &Ids, model: &str, extra: &ResponsesExtra, r: &GenResult) -> Value {
    response_object(
        ids,
        model,
        status_of(r.finish),
        final_output(ids, extra, r),
        Some(r),
    )
}

/// The Responses event lifecycle. Reasoning (with a summary opt-in) and text stream as
/// deltas; tool calls are announced at the end with their full arguments.
pub struct ResponseStream {
    pub ids: Ids,
    pub model: String,
    pub extra: ResponsesExtra,
    seq: u64,
    next_index: usize,
    reasoning: Option<(usize, String)>,
    reasoning_done: bool,
    message: Option<(usize, String)>,
}

impl ResponseStream {
    pub fn new(ids: Ids, model: String, extra: ResponsesExtra) -> ResponseStream {
        ResponseStream {
            ids,
            model,
            extra,
            seq: 0,
            next_index: 0,
            reasoning: None,
            reasoning_done: false,
            message: None,
        }
    }

    fn ev(&mut self, ty: &str, body: Value) -> String {
        let mut m = Map::new();
        m.insert("type".into(), json!(ty));
        m.insert("sequence_number".into(), json!(self.seq));
        self.seq += 1;
        if let Value::Object(o) = body {
            for (k, v) in o {
                m.insert(k, v);
            }
        }
        data(&Value::Object(m))
    }

    /// (quirk fixed, §10.8) the reasoning item is closed as soon as text starts.
    fn close_reasoning(&mut self, out: &mut Vec<String>, closed: bool) {
        let Some((idx, text)) = self.reasoning.take() else {
            return;
        };
        self.reasoning_done = true;
        let id = self.ids.rs.clone();
        out.push(self.ev(
            "response.reasoning_summary_text.done",
            json!({"item_id": id, "output_index": idx, "summary_index": 0, "text": text}),
        ));
        out.push(self.ev("response.reasoning_summary_part.done", json!({"item_id": id, "output_index": idx, "summary_index": 0, "part": {"type": "summary_text", "text": text}})));
        let item = reasoning_item(&self.ids, &text, closed);
        out.push(self.ev(
            "response.output_item.done",
            json!({"output_index": idx, "item": item}),
        ));
    }

    fn close_message(&mut self, out: &mut Vec<String>, status: &str) {
        let Some((idx, text)) = self.message.take() else {
            return;
        };
        let id = self.ids.msg.clone();
        out.push(self.ev(
            "response.output_text.done",
            json!({"item_id": id, "output_index": idx, "content_index": 0, "text": text}),
        ));
        out.push(self.ev("response.content_part.done", json!({"item_id": id, "output_index": idx, "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}})));
        let item = message_item(&self.ids, &text, status);
        out.push(self.ev(
            "response.output_item.done",
            json!({"output_index": idx, "item": item}),
        ));
    }
}

impl SseFormatter for ResponseStream {
    fn open(&mut self) -> Vec<String> {
        let resp = response_object(&self.ids, &self.model, "in_progress", Vec::new(), None);
        vec![
            self.ev("response.created", json!({"response": resp.clone()})),
            self.ev("response.in_progress", json!({"response": resp})),
        ]
    }

    fn event(&mut self, ev: GenEvent) -> Vec<String> {
        let mut out = Vec::new();
        match ev {
            GenEvent::Reasoning(s) if self.extra.summary && !self.reasoning_done => {
                if self.reasoning.is_none() {
                    let idx = self.next_index;
                    self.next_index += 1;
                    let id = self.ids.rs.clone();
                    out.push(self.ev("response.output_item.added", json!({"output_index": idx, "item": {"id": id, "type": "reasoning", "status": "in_progress", "summary": []}})));
                    out.push(self.ev("response.reasoning_summary_part.added", json!({"item_id": id, "output_index": idx, "summary_index": 0, "part": {"type": "summary_text", "text": ""}})));
                    self.reasoning = Some((idx, String::new()));
                }
                if let Some((_, t)) = self.reasoning.as_mut() {
                    t.push_str(&s);
                }
                let idx = self.reasoning.as_ref().map_or(0, |r| r.0);
                let id = self.ids.rs.clone();
                out.push(self.ev(
                    "response.reasoning_summary_text.delta",
                    json!({"item_id": id, "output_index": idx, "summary_index": 0, "delta": s}),
                ));
            }
            GenEvent::Content(s) => {
                self.close_reasoning(&mut out, true);
                if self.message.is_none() {
                    let idx = self.next_index;
                    self.next_index += 1;
                    let id = self.ids.msg.clone();
                    out.push(self.ev("response.output_item.added", json!({"output_index": idx, "item": {"id": id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}})));
                    out.push(self.ev("response.content_part.added", json!({"item_id": id, "output_index": idx, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})));
                    self.message = Some((idx, String::new()));
                }
                if let Some((_, t)) = self.message.as_mut() {
                    t.push_str(&s);
                }
                let idx = self.message.as_ref().map_or(0, |m| m.0);
                let id = self.ids.msg.clone();
                out.push(self.ev("response.output_text.delta", json!({"item_id": id, "output_index": idx, "content_index": 0, "delta": s, "logprobs": []})));
            }
            GenEvent::Done(r) => {
                let item_status = if matches!(r.finish, Finish::Length | Finish::Error) {
                    "incomplete"
                } else {
                    "completed"
                };
                self.close_reasoning(&mut out, r.reasoning_closed);
                self.close_message(&mut out, item_status);
                for c in &r.tool_calls {
                    let idx = self.next_index;
                    self.next_index += 1;
                    let mut added = self.extra.names.item(&c.id, c, "in_progress");
                    let is_fn = added["type"] == "function_call";
                    if is_fn {
                        added["arguments"] = json!("");
                    }
                    let item_id = added["id"].clone();
                    out.push(self.ev(
                        "response.output_item.added",
                        json!({"output_index": idx, "item": added}),
                    ));
                    if is_fn {
                        out.push(self.ev(
                            "response.function_call_arguments.delta",
                            json!({"item_id": item_id, "output_index": idx, "delta": c.arguments}),
                        ));
                        out.push(self.ev("response.function_call_arguments.done", json!({"item_id": item_id, "output_index": idx, "name": c.name, "arguments": c.arguments})));
                    }
                    let done = self.extra.names.item(&c.id, c, "completed");
                    out.push(self.ev(
                        "response.output_item.done",
                        json!({"output_index": idx, "item": done}),
                    ));
                }
                let body = response_body(&self.ids, &self.model, &self.extra, &r);
                let ty = match r.finish {
                    Finish::Length => "response.incomplete",
                    Finish::Error => "response.failed",
                    _ => "response.completed",
                };
                out.push(self.ev(ty, json!({"response": body})));
            }
            GenEvent::Failed { message, .. } => {
                out.push(self.ev(
                    "error",
                    json!({"code": "server_error", "message": message, "param": null}),
                ));
                let mut resp = response_object(&self.ids, &self.model, "failed", Vec::new(), None);
                resp["error"] = json!({"code": "server_error", "message": message});
                out.push(self.ev("response.failed", json!({"response": resp})));
            }
            _ => {}
        }
        out
    }
}
