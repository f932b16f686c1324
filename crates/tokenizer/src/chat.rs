//! Chat prompt rendering, following the official `encoding_dsv4.py` (`encode_messages`).
//!
//! Messages use the OpenAI shape so the server can deserialize requests straight into
//! them. Where the reference C engine's renderer differs, this module follows the official
//! encoder; `docs/chat-encoding.md` lists the differences.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::dsml;
use crate::error::ChatError;
use crate::marked::MarkedText;
use crate::pyjson;
use crate::special::{ASSISTANT, BOS, EOS, LATEST_REMINDER, THINK_END, THINK_START, USER};

/// The Think Max paragraph, written after BOS when `reasoning_effort` is `max` in
/// thinking mode. The engine decides whether the context is large enough to ask for it.
pub const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/// Smallest context (tokens) for which ds4 honours `reasoning_effort: max`.
pub const THINK_MAX_MIN_CONTEXT: usize = 393_216;

/// A chat message (OpenAI shape plus the DeepSeek extensions used by the encoder).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Tool definitions (OpenAI `{"type":"function","function":{…}}`), on system or
    /// developer messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<Value>,
    /// Quick-instruction task: action, query, authority, domain, title or read_url.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    /// Leave the assistant turn open (no EOS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wo_eos: Option<bool>,
    /// Server-side only, never read from or written to JSON: the exact DSML block (with
    /// its leading blank line) an assistant turn is replayed with instead of rendering
    /// `tool_calls`, as trusted markup: a server that remembers the block it sampled
    /// replays it token for token. Client text never becomes trusted, so this cannot
    /// come from a request.
    #[serde(skip)]
    pub exact_tool_calls: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: Some(Content::Text(content.to_string())),
            ..Default::default()
        }
    }
}

/// Message content: a string or a list of content parts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Content {
    /// Text blocks joined with a blank line, other blocks as `[Unsupported <type>]` (the
    /// encoder's rule for tool-result blocks).
    pub fn to_text(&self) -> Cow<'_, str> {
        match self {
            Content::Text(s) => Cow::Borrowed(s),
            Content::Parts(parts) => Cow::Owned(
                parts
                    .iter()
                    .map(|p| match p.kind.as_deref() {
                        Some("text") => p.text.clone().unwrap_or_default(),
                        Some(t) => format!("[Unsupported {t}]"),
                        None => "[Unsupported None]".to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("\n\n"),
            ),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Content::Text(s) => s.is_empty(),
            Content::Parts(p) => p.is_empty(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    #[serde(default)]
    pub name: String,
    /// Normally a JSON text; an object is accepted too.
    #[serde(default = "empty_arguments")]
    pub arguments: Value,
    /// Some clients put the call id here; the encoder falls back to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

fn empty_arguments() -> Value {
    Value::String(String::new())
}

impl ToolCall {
    pub fn new(id: Option<&str>, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: id.map(str::to_string),
            kind: Some("function".to_string()),
            function: FunctionCall {
                name: name.to_string(),
                arguments: Value::String(arguments.to_string()),
                id: None,
            },
        }
    }

    fn call_id(&self) -> Option<&str> {
        self.id
            .as_deref()
            .filter(|s| !s.is_empty())
            .or(self.function.id.as_deref())
            .filter(|s| !s.is_empty())
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThinkingMode {
    Chat,
    #[default]
    Thinking,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningEffort {
    High,
    Max,
}

/// Options of `encode_messages`, with the reference defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct EncodeOptions {
    pub thinking_mode: ThinkingMode,
    pub reasoning_effort: Option<ReasoningEffort>,
    pub drop_thinking: bool,
    pub add_default_bos_token: bool,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            thinking_mode: ThinkingMode::Thinking,
            reasoning_effort: None,
            drop_thinking: true,
            add_default_bos_token: true,
        }
    }
}

const TASKS: [(&str, &str); 6] = [
    ("action", "<｜action｜>"),
    ("query", "<｜query｜>"),
    ("authority", "<｜authority｜>"),
    ("domain", "<｜domain｜>"),
    ("title", "<｜title｜>"),
    ("read_url", "<｜read_url｜>"),
];

/// A part of a merged user turn.
#[derive(Clone, Debug)]
enum Block<'a> {
    Text(Cow<'a, str>),
    ToolResult {
        id: Option<&'a str>,
        content: Option<&'a Content>,
    },
}

/// A message after tool results were merged into user turns.
#[derive(Clone, Debug)]
struct Msg<'a> {
    role: &'a str,
    content: Option<&'a Content>,
    /// Present exactly on merged user turns.
    blocks: Option<Vec<Block<'a>>>,
    reasoning: Option<&'a str>,
    tool_calls: Option<&'a [ToolCall]>,
    exact_tool_calls: Option<&'a str>,
    tools: Option<&'a [Value]>,
    response_format: Option<&'a Value>,
    task: Option<&'a str>,
    wo_eos: bool,
}

impl<'a> Msg<'a> {
    fn from(m: &'a Message) -> Msg<'a> {
        Msg {
            role: &m.role,
            content: m.content.as_ref(),
            blocks: None,
            reasoning: m.reasoning_content.as_deref(),
            tool_calls: m.tool_calls.as_deref(),
            exact_tool_calls: m.exact_tool_calls.as_deref(),
            tools: m.tools.as_deref(),
            response_format: m.response_format.as_ref(),
            task: m.task.as_deref(),
            wo_eos: m.wo_eos.unwrap_or(false),
        }
    }

    fn has_tools(&self) -> bool {
        self.tools.is_some_and(|t| !t.is_empty())
    }

    fn content_text(&self) -> Cow<'a, str> {
        self.content.map_or(Cow::Borrowed(""), |c| c.to_text())
    }
}

/// `merge_tool_messages`: tool results become `tool_result` blocks of a user turn, and a
/// user message right after such a turn (or after another user turn) joins it.
fn merge_tool_messages(messages: &[Message]) -> Vec<Msg<'_>> {
    let mut merged: Vec<Msg<'_>> = Vec::with_capacity(messages.len());
    for m in messages {
        match m.role.as_str() {
            "tool" => {
                let block = Block::ToolResult {
                    id: m.tool_call_id.as_deref(),
                    content: m.content.as_ref(),
                };
                match merged.last_mut() {
                    Some(last) if last.role == "user" && last.blocks.is_some() => {
                        if let Some(b) = last.blocks.as_mut() {
                            b.push(block);
                        }
                    }
                    _ => merged.push(Msg {
                        role: "user",
                        content: None,
                        blocks: Some(vec![block]),
                        reasoning: None,
                        tool_calls: None,
                        exact_tool_calls: None,
                        tools: None,
                        response_format: None,
                        task: None,
                        wo_eos: false,
                    }),
                }
            }
            "user" => {
                let text = m
                    .content
                    .as_ref()
                    .map_or(Cow::Borrowed(""), |c| c.to_text());
                match merged.last_mut() {
                    Some(last)
                        if last.role == "user" && last.blocks.is_some() && last.task.is_none() =>
                    {
                        if let Some(b) = last.blocks.as_mut() {
                            b.push(Block::Text(text));
                        }
                    }
                    _ => merged.push(Msg {
                        role: "user",
                        content: m.content.as_ref(),
                        blocks: Some(vec![Block::Text(text)]),
                        reasoning: None,
                        tool_calls: None,
                        exact_tool_calls: None,
                        tools: None,
                        response_format: None,
                        task: m.task.as_deref(),
                        wo_eos: m.wo_eos.unwrap_or(false),
                    }),
                }
            }
            _ => merged.push(Msg::from(m)),
        }
    }
    merged
}

/// `sort_tool_results_by_call_order`: within a user turn, results follow the order of the
/// ids in the latest assistant message with tool calls (unknown ids sort as 0, stably).
fn sort_tool_results(messages: &mut [Msg<'_>]) {
    let mut order: Vec<(&str, usize)> = Vec::new();
    for m in messages.iter_mut() {
        if m.role == "assistant" {
            if let Some(calls) = m.tool_calls.filter(|c| !c.is_empty()) {
                order.clear();
                for (k, tc) in calls.iter().enumerate() {
                    if let Some(id) = tc.call_id() {
                        match order.iter_mut().find(|(i, _)| *i == id) {
                            Some(slot) => slot.1 = k,
                            None => order.push((id, k)),
                        }
                    }
                }
            }
        } else if m.role == "user" {
            let Some(blocks) = m.blocks.as_mut() else {
                continue;
            };
            let results: Vec<Block<'_>> = blocks
                .iter()
                .filter(|b| matches!(b, Block::ToolResult { .. }))
                .cloned()
                .collect();
            if results.len() < 2 || order.is_empty() {
                continue;
            }
            let key = |b: &Block<'_>| match b {
                Block::ToolResult { id: Some(id), .. } => {
                    order.iter().find(|(i, _)| i == id).map_or(0, |&(_, k)| k)
                }
                _ => 0,
            };
            let mut sorted = results;
            sorted.sort_by_key(key);
            let mut it = sorted.into_iter();
            for b in blocks.iter_mut() {
                if matches!(b, Block::ToolResult { .. }) {
                    if let Some(next) = it.next() {
                        *b = next;
                    }
                }
            }
        }
    }
}

fn find_last_user_index(messages: &[Msg<'_>]) -> Option<usize> {
    messages
        .iter()
        .rposition(|m| m.role == "user" || m.role == "developer")
}

/// `_drop_thinking_messages`: before the last user/developer turn, assistant reasoning is
/// removed and developer messages are dropped.
fn drop_thinking_messages<'a>(messages: &[Msg<'a>]) -> Vec<Msg<'a>> {
    let last_user = find_last_user_index(messages);
    let mut out = Vec::with_capacity(messages.len());
    for (idx, m) in messages.iter().enumerate() {
        let keep_role = matches!(
            m.role,
            "user" | "system" | "tool" | "latest_reminder" | "direct_search_results"
        );
        if keep_role || last_user.is_none_or(|l| idx >= l) {
            out.push(m.clone());
        } else if m.role == "assistant" {
            let mut m = m.clone();
            m.reasoning = None;
            out.push(m);
        }
    }
    out
}

/// Renders the `## Tools` block for a list of tool definitions.
pub fn render_tools(tools: &[Value]) -> String {
    render_tools_marked(tools).into_parts().0
}

/// `render_tools` with the schemas (client text) marked plain.
pub fn render_tools_marked(tools: &[Value]) -> MarkedText {
    let schemas: Vec<String> = tools
        .iter()
        .map(|t| pyjson::dumps_serde(t.get("function").unwrap_or(t)))
        .collect();
    dsml::tools_block_marked(&schemas.join("\n"))
}

fn push_response_format(prompt: &mut MarkedText, rf: &Value) {
    prompt.push_str(
        "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n",
    );
    prompt.push_plain(&pyjson::dumps_serde(rf));
}

struct Ctx {
    thinking: bool,
    drop_thinking: bool,
    max_effort: bool,
}

/// The body of a system or developer message: its text, then the tools it declares and
/// the response format, each after a blank line.
fn push_system_text(prompt: &mut MarkedText, msg: &Msg<'_>, response_format: Option<&Value>) {
    prompt.push_plain(&msg.content_text());
    if let Some(tools) = msg.tools.filter(|t| !t.is_empty()) {
        prompt.push_str("\n\n");
        prompt.append(&render_tools_marked(tools));
    }
    if let Some(rf) = response_format {
        prompt.push_str("\n\n");
        push_response_format(prompt, rf);
    }
}

/// One message. Client text (contents, reasoning, tool results, schemas, call names and
/// arguments) is pushed plain; the template's markers and the exact DSML the server
/// remembers are trusted (docs/server.md, "Control tokens in client text").
fn render_message(index: usize, messages: &[Msg<'_>], ctx: &Ctx) -> Result<MarkedText, ChatError> {
    let msg = &messages[index];
    let last_user = find_last_user_index(messages);
    let mut prompt = MarkedText::new();
    if index == 0 && ctx.thinking && ctx.max_effort {
        prompt.push_str(REASONING_EFFORT_MAX);
    }
    let response_format = msg.response_format.filter(|v| pyjson::serde_truthy(v));
    match msg.role {
        "system" => {
            push_system_text(&mut prompt, msg, response_format);
        }
        "developer" => {
            if msg.content.is_none_or(Content::is_empty) {
                return Err(ChatError::InvalidMessage {
                    role: "developer".into(),
                    detail: "content is empty".into(),
                });
            }
            prompt.push_str(USER);
            push_system_text(&mut prompt, msg, response_format);
        }
        "user" => {
            prompt.push_str(USER);
            match msg.blocks.as_ref().filter(|b| !b.is_empty()) {
                Some(blocks) => {
                    for (k, b) in blocks.iter().enumerate() {
                        if k > 0 {
                            prompt.push_str("\n\n");
                        }
                        match b {
                            Block::Text(t) => prompt.push_plain(t),
                            Block::ToolResult { content, .. } => {
                                prompt.push_str("<tool_result>");
                                prompt.push_plain(
                                    &content.map_or(Cow::Borrowed(""), |c| c.to_text()),
                                );
                                prompt.push_str("</tool_result>");
                            }
                        }
                    }
                }
                None => prompt.push_plain(&msg.content_text()),
            }
        }
        "latest_reminder" => {
            prompt.push_str(LATEST_REMINDER);
            prompt.push_plain(&msg.content_text());
        }
        "assistant" => {
            let mut tc_content = MarkedText::new();
            if let Some(block) = msg.exact_tool_calls {
                tc_content.push_str(block);
            } else if let Some(calls) = msg.tool_calls.filter(|c| !c.is_empty()) {
                tc_content.push_str("\n\n");
                tc_content.append(&dsml::render_tool_calls_marked(calls));
            }
            let prev_has_task = index > 0 && messages[index - 1].task.is_some();
            if ctx.thinking
                && !prev_has_task
                && (!ctx.drop_thinking || last_user.is_none_or(|l| index > l))
            {
                prompt.push_plain(msg.reasoning.unwrap_or(""));
                prompt.push_str(THINK_END);
            }
            prompt.push_plain(&msg.content_text());
            prompt.append(&tc_content);
            if !msg.wo_eos {
                prompt.push_str(EOS);
            }
        }
        other => return Err(ChatError::UnknownRole(other.to_string())),
    }

    if let Some(next) = messages.get(index + 1) {
        if next.role != "assistant" && next.role != "latest_reminder" {
            return Ok(prompt);
        }
    }
    let think_token = |p: &mut MarkedText, thinking: bool| {
        p.push_str(if thinking { THINK_START } else { THINK_END });
    };
    if let Some(task) = msg.task {
        let token = TASKS
            .iter()
            .find(|(name, _)| *name == task)
            .map(|(_, t)| *t)
            .ok_or_else(|| ChatError::InvalidTask(task.to_string()))?;
        if task != "action" {
            prompt.push_str(token);
        } else {
            prompt.push_str(ASSISTANT);
            think_token(&mut prompt, ctx.thinking);
            prompt.push_str(token);
        }
    } else if msg.role == "user" || msg.role == "developer" {
        prompt.push_str(ASSISTANT);
        let open = ctx.thinking && (!ctx.drop_thinking || last_user.is_none_or(|l| index >= l));
        think_token(&mut prompt, open);
    }
    Ok(prompt)
}

/// `encode_messages`: the prompt for `messages`. With a non-empty `context` (messages
/// already in the KV cache) only the continuation is returned, without BOS.
pub fn encode_messages(
    messages: &[Message],
    context: &[Message],
    opts: &EncodeOptions,
) -> Result<String, ChatError> {
    Ok(encode_messages_marked(messages, context, opts)?
        .into_parts()
        .0)
}

/// `encode_messages` with the client text marked: tokenize the result with
/// [`Tokenizer::encode_marked`](crate::Tokenizer::encode_marked) so that text in message
/// contents that spells a control token stays plain text.
pub fn encode_messages_marked(
    messages: &[Message],
    context: &[Message],
    opts: &EncodeOptions,
) -> Result<MarkedText, ChatError> {
    let mut ctx_msgs = merge_tool_messages(context);
    let new_msgs = merge_tool_messages(messages);
    let n_ctx = ctx_msgs.len();
    ctx_msgs.extend(new_msgs);
    let mut full = ctx_msgs;
    sort_tool_results(&mut full);

    let mut prompt = MarkedText::new();
    if opts.add_default_bos_token && n_ctx == 0 {
        prompt.push_str(BOS);
    }
    let any_tools = full.iter().any(Msg::has_tools);
    let drop_thinking = opts.drop_thinking && !any_tools;
    let thinking = opts.thinking_mode == ThinkingMode::Thinking;

    let (full, first) = if thinking && drop_thinking {
        let kept_ctx = drop_thinking_messages(&full[..n_ctx]).len();
        let full = drop_thinking_messages(&full);
        // Reproduces the reference's count: the dropped context is measured on its own.
        let n_render = full.len().saturating_sub(kept_ctx);
        let first = full.len() - n_render;
        (full, first)
    } else {
        (full, n_ctx)
    };
    let ctx = Ctx {
        thinking,
        drop_thinking,
        max_effort: opts.reasoning_effort == Some(ReasoningEffort::Max),
    };
    for idx in first..full.len() {
        prompt.append(&render_message(idx, &full, &ctx)?);
    }
    Ok(prompt)
}
