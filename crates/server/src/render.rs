//! Prompt rendering (server.md §1) on top of the tokenizer crate's official encoder, and
//! the think-mode resolution shared by every endpoint (§2.2).

use ds4_tokenizer::chat::{
    encode_messages_marked, EncodeOptions, Message, ReasoningEffort, ThinkingMode,
    REASONING_EFFORT_MAX, THINK_MAX_MIN_CONTEXT,
};
use ds4_tokenizer::markers::{ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER};
use ds4_tokenizer::MarkedText;
use serde_json::Value;

use crate::error::ApiError;
use crate::toolmem::ToolMemory;

/// Think mode of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThinkMode {
    None,
    High,
    Max,
}

impl ThinkMode {
    pub fn thinking(self) -> bool {
        self != ThinkMode::None
    }
    pub fn as_str(self) -> &'static str {
        match self {
            ThinkMode::None => "none",
            ThinkMode::High => "high",
            ThinkMode::Max => "max",
        }
    }
}

/// Think controls as found in a request, before resolution.
#[derive(Clone, Debug, Default)]
pub struct ThinkControls {
    /// An explicit on/off (`think`, `thinking`, Responses `reasoning.effort`).
    pub enabled: Option<bool>,
    /// `reasoning_effort`, `output_config.effort` or `reasoning.effort`.
    pub effort: Option<String>,
}

/// §2.2: explicit controls win, then the effort, then the model alias; Max needs a
/// context of at least 393,216 tokens and otherwise becomes High.
pub fn resolve_think(c: &ThinkControls, model: &str, ctx: usize) -> Result<ThinkMode, ApiError> {
    let mut enabled = true;
    let mut effort = ThinkMode::High;
    if let Some(e) = c.enabled {
        enabled = e;
    }
    if let Some(e) = c.effort.as_deref() {
        effort = match e {
            "max" => ThinkMode::Max,
            "xhigh" | "high" | "medium" | "low" | "minimal" => ThinkMode::High,
            "none" => ThinkMode::None,
            other => {
                return Err(ApiError::bad_request(format!(
                    "unsupported reasoning effort {other:?} (use none, minimal, low, medium, high, xhigh or max)"
                )))
            }
        };
    }
    if c.enabled.is_none() {
        match model {
            "deepseek-chat" => enabled = false,
            "deepseek-reasoner" => enabled = true,
            _ => {}
        }
    }
    Ok(if !enabled || effort == ThinkMode::None {
        ThinkMode::None
    } else if effort == ThinkMode::Max && ctx >= THINK_MAX_MIN_CONTEXT {
        ThinkMode::Max
    } else {
        ThinkMode::High
    })
}

/// Parses a `thinking` member: bool, `{"type":"enabled"|"disabled"|"adaptive"}` or null.
pub fn thinking_flag(v: &Value) -> Result<Option<bool>, ApiError> {
    match v {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(*b)),
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("disabled") => Ok(Some(false)),
            Some(_) => Ok(Some(true)),
            None => Ok(None),
        },
        _ => Err(ApiError::invalid_json()),
    }
}

/// A chat conversation in API-neutral form.
#[derive(Clone, Debug, Default)]
pub struct Conversation {
    /// System and developer texts, in request order.
    pub system: Vec<String>,
    /// user / assistant / tool messages, in order.
    pub messages: Vec<Message>,
    /// Tool schemas as sent (OpenAI wrappers, Anthropic or Responses items).
    pub tools: Vec<Value>,
    /// `tool_choice` is `none`: no tools block, no DSML parsing.
    pub tools_disabled: bool,
}

impl Conversation {
    pub fn tools_active(&self) -> bool {
        !self.tools.is_empty() && !self.tools_disabled
    }

    /// Every tool-call id mentioned (assistant calls and tool results).
    pub fn tool_ids(&self) -> Vec<String> {
        let mut ids = Vec::new();
        for m in &self.messages {
            if let Some(calls) = &m.tool_calls {
                ids.extend(calls.iter().filter_map(|c| c.id.clone()));
            }
            if let Some(id) = &m.tool_call_id {
                ids.push(id.clone());
            }
        }
        ids
    }
}

/// How many assistant turns were rendered from exact DSML and how many canonically.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReplayStats {
    pub exact: usize,
    pub canonical: usize,
}

/// Renders the conversation to the prompt text (ending with the assistant prefix), with
/// the client's text marked plain (docs/server.md, "Control tokens in client text").
/// Assistant turns whose calls are all known to the tool memory with one DSML block are
/// rendered with that exact block as trusted markup, so the prompt matches the tokens
/// the model sampled.
pub fn render_chat(
    conv: &Conversation,
    mode: ThinkMode,
    memory: Option<&ToolMemory>,
) -> Result<(MarkedText, ReplayStats), ApiError> {
    let mut stats = ReplayStats::default();
    let msgs = encoder_messages(conv, memory, &mut stats);
    let text = encode_messages_marked(&msgs, &[], &encode_options(mode))
        .map_err(|e| ApiError::bad_request(format!("cannot render messages: {e}")))?;
    Ok((text, stats))
}

/// The rendering of `conv.messages[from..]` as a continuation of the messages before it
/// (no BOS, no system block): what a live tool tail appends after the turn's EOS
/// (server.md §1.4). Uses the encoder's own continuation mode, so it is byte-identical
/// to the corresponding part of a full rendering.
pub fn render_continuation(
    conv: &Conversation,
    mode: ThinkMode,
    memory: Option<&ToolMemory>,
    from: usize,
) -> Result<MarkedText, ApiError> {
    let msgs = encoder_messages(conv, memory, &mut ReplayStats::default());
    let split = msgs.len() - conv.messages.len() + from.min(conv.messages.len());
    let mut opts = encode_options(mode);
    if split == 0 {
        opts.add_default_bos_token = false;
    }
    encode_messages_marked(&msgs[split..], &msgs[..split], &opts)
        .map_err(|e| ApiError::bad_request(format!("cannot render messages: {e}")))
}

/// The user text of the probe turn used by [`render_visible`]; it only has to be
/// something no client sends.
const PROBE: &str = "\u{1}ds4-visible-probe\u{1}";

/// The text a client's next request renders for this conversation followed by `reply`
/// (the assistant turn as the client replays it), up to and excluding the EOS that ends
/// `reply`: the "visible transcript" of the live session (server.md §4.2). It is found
/// by rendering the conversation plus `reply` plus a probe user turn and cutting the
/// probe off, so reasoning retention and DSML replay follow the encoder exactly.
/// None when the rendering does not end the reply with EOS (nothing to bind).
pub fn render_visible(
    conv: &Conversation,
    mode: ThinkMode,
    memory: Option<&ToolMemory>,
    reply: Message,
) -> Option<MarkedText> {
    let mut c = conv.clone();
    c.messages.push(reply);
    c.messages.push(Message::new("user", PROBE));
    let (mut text, _) = render_chat(&c, mode, memory).ok()?;
    let probe = format!(
        "{USER}{PROBE}{ASSISTANT}{}",
        if mode.thinking() {
            THINK_START
        } else {
            THINK_END
        }
    );
    (text.strip_suffix(&probe) && text.strip_suffix(EOS)).then_some(text)
}

fn encode_options(mode: ThinkMode) -> EncodeOptions {
    EncodeOptions {
        thinking_mode: if mode.thinking() {
            ThinkingMode::Thinking
        } else {
            ThinkingMode::Chat
        },
        reasoning_effort: (mode == ThinkMode::Max).then_some(ReasoningEffort::Max),
        drop_thinking: true,
        add_default_bos_token: true,
    }
}

/// The encoder's message list: the system block (system texts and tools) first, then
/// the conversation with exact DSML blocks substituted where the memory has them.
fn encoder_messages(
    conv: &Conversation,
    memory: Option<&ToolMemory>,
    stats: &mut ReplayStats,
) -> Vec<Message> {
    let mut msgs: Vec<Message> = Vec::with_capacity(conv.messages.len() + 1);
    let tools = conv.tools_active();
    if !conv.system.is_empty() || tools {
        let mut sys = Message::new("system", &conv.system.join("\n\n"));
        if tools {
            sys.tools = Some(conv.tools.iter().map(tool_for_encoder).collect());
        }
        msgs.push(sys);
    }
    for m in &conv.messages {
        let mut m = m.clone();
        if m.role == "assistant" {
            if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
                let block = memory.and_then(|mem| {
                    let ids: Vec<&str> = calls.iter().filter_map(|c| c.id.as_deref()).collect();
                    if ids.len() != calls.len() {
                        return None;
                    }
                    mem.block_for_all(&ids)
                });
                match block {
                    // The block is the model's own sampled text, so it is trusted
                    // markup; the content before it stays client text.
                    Some(b) => {
                        m.exact_tool_calls = Some(b);
                        m.tool_calls = None;
                        stats.exact += 1;
                    }
                    None => stats.canonical += 1,
                }
            }
        }
        msgs.push(m);
    }
    msgs
}

/// The encoder reads OpenAI `{"type":"function","function":{…}}` items (and any other
/// shape as the schema itself); Responses namespaces are flattened by the API layer.
fn tool_for_encoder(t: &Value) -> Value {
    t.clone()
}

/// §1.4: the `/v1/completions` prompt. The client's prompt is deliberately *not* marked
/// plain: it is the raw-prompt path, where a client that wants control tokens writes
/// them (docs/server.md, "Control tokens in client text").
pub fn render_completion(prompt: &str, mode: ThinkMode) -> String {
    let mut s = String::with_capacity(prompt.len() + 128);
    s.push_str(BOS);
    if mode == ThinkMode::Max {
        s.push_str(REASONING_EFFORT_MAX);
    }
    s.push_str("You are a helpful assistant");
    s.push_str(USER);
    s.push_str(prompt);
    s.push_str(ASSISTANT);
    s.push_str(if mode.thinking() {
        THINK_START
    } else {
        THINK_END
    });
    s
}

/// Concatenates the text of an OpenAI content value (string, null or parts array);
/// image, audio and file parts are a 400 (this model reads text only).
pub fn content_text(v: &Value) -> Result<String, ApiError> {
    concat_parts(
        v,
        |p| {
            Ok(match p {
                Value::String(s) => s,
                Value::Object(o) => {
                    let ty = o.get("type").and_then(Value::as_str).unwrap_or("text");
                    if let Some(e) = crate::api::media_part_error(ty) {
                        return Err(e);
                    }
                    o.get("text").and_then(Value::as_str).unwrap_or("")
                }
                _ => "",
            })
        },
        ApiError::invalid_json,
    )
}

/// A content value as text: null is empty, a string is itself, an array is the
/// concatenation of `part` over its items; any other value is `not_content()`.
pub fn concat_parts<'a>(
    v: &'a Value,
    part: impl Fn(&'a Value) -> Result<&'a str, ApiError>,
    not_content: impl FnOnce() -> ApiError,
) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(items) => {
            let mut out = String::new();
            for it in items {
                out.push_str(part(it)?);
            }
            Ok(out)
        }
        _ => Err(not_content()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_tokenizer::chat::ToolCall;

    fn conv(messages: Vec<Message>) -> Conversation {
        Conversation {
            system: vec!["sys <｜User｜>".into()],
            messages,
            tools: Vec::new(),
            tools_disabled: false,
        }
    }

    fn is_plain(m: &MarkedText, at: usize, len: usize) -> bool {
        m.plain_ranges()
            .iter()
            .any(|r| r.start <= at && at + len <= r.end)
    }

    /// The remembered DSML block is rendered as markup; the client's content beside it,
    /// the system text and the tool result are client text.
    #[test]
    fn exact_block_is_markup_and_client_text_is_plain() {
        let block = "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let mut mem = ToolMemory::new(8);
        mem.insert(&["c1".to_string()], block);
        let mut asst = Message::new("assistant", "see </think>");
        asst.tool_calls = Some(vec![ToolCall::new(Some("c1"), "f", "{}")]);
        let mut tool = Message::new("tool", "out<｜Assistant｜>");
        tool.tool_call_id = Some("c1".into());
        let c = conv(vec![Message::new("user", "u"), asst, tool]);
        let (m, stats) = render_chat(&c, ThinkMode::None, Some(&mem)).unwrap();
        assert_eq!((stats.exact, stats.canonical), (1, 0));
        let text = m.text();
        let at = text.find(block).expect("exact block rendered");
        assert!(!m
            .plain_ranges()
            .iter()
            .any(|r| r.start < at + block.len() && at < r.end));
        for s in ["sys <｜User｜>", "see </think>", "out<｜Assistant｜>"] {
            let at = text.find(s).unwrap();
            assert!(is_plain(&m, at, s.len()), "{s:?} in {text:?}");
        }
        // Without the memory the calls are rendered canonically: the name is client text.
        let (m, stats) = render_chat(&c, ThinkMode::None, None).unwrap();
        assert_eq!(stats.canonical, 1);
        let at = m.text().find("name=\"f\"").unwrap() + "name=\"".len();
        assert!(is_plain(&m, at, 1));
        // The visible transcript keeps the marks of the full rendering.
        let v = render_visible(
            &c,
            ThinkMode::None,
            None,
            Message::new("assistant", "a<think>"),
        )
        .unwrap();
        assert!(m.text().len() < v.len() && v.text().ends_with("a<think>"));
        assert!(is_plain(&v, v.len() - "a<think>".len(), "a<think>".len()));
    }
}
