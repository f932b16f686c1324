//! Live protocol bindings (server.md §4.2): what the worker remembers about the live
//! session so the next request of the same client continues it without a re-prefill,
//! even when the client's replayed history is not a text prefix of the live tokens
//! (reasoning the client drops, tool outputs sent without their calls).
//!
//! * **Responses**: after every Responses turn that did not fail or hit the length
//!   limit: the live length, the ids of the calls of the turn, and the visible
//!   transcript (the request's rendering plus the turn as the client replays it).
//! * **Anthropic**: after an Anthropic turn with tool calls: the live length and ids.
//! * **Thinking**: after a tool-less thinking turn (chat or Anthropic): the visible
//!   transcript with the reasoning dropped, which is what the next request renders.
//!
//! A binding is valid only while the live session is exactly `pos` tokens long and no
//! other request ran in between (the worker clears every binding after each sync).
//! The visible texts end *before* the EOS that closes the turn: the live KV never holds
//! that EOS (it is sampled, not evaluated), so a continuation starts its suffix at the
//! EOS and the model sees it, as in a full rendering (§4.1 quirk, fixed; docs/server.md).

use std::collections::HashSet;

use ds4_tokenizer::chat::Message;
use ds4_tokenizer::markers::EOS;
use ds4_tokenizer::MarkedText;

use crate::error::ApiError;
use crate::render::{render_continuation, Conversation, ThinkMode};
use crate::toolmem::ToolMemory;

/// KVC ext flag: the key is a Responses visible transcript.
pub const EXT_RESPONSES_VISIBLE: u8 = 2;
/// KVC ext flag: the key is a thinking visible transcript.
pub const EXT_THINKING_VISIBLE: u8 = 4;

#[derive(Clone, Debug, PartialEq)]
pub struct ResponsesBinding {
    pub pos: usize,
    pub ids: Vec<String>,
    /// With its client-text marks: a prompt continues it only with the same marks.
    pub visible: MarkedText,
}

#[derive(Clone, Debug, PartialEq)]
pub struct AnthropicBinding {
    pub pos: usize,
    pub ids: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ThinkingBinding {
    pub pos: usize,
    pub visible: MarkedText,
}

#[derive(Clone, Debug, Default)]
pub struct Bindings {
    pub responses: Option<ResponsesBinding>,
    pub anthropic: Option<AnthropicBinding>,
    pub thinking: Option<ThinkingBinding>,
}

impl Bindings {
    pub fn clear(&mut self) {
        *self = Bindings::default();
    }

    /// The key of an evict/shutdown save of a live session of `pos` tokens (§4.4): the
    /// Responses visible text when that binding is at `pos`, else the thinking one.
    pub fn visible_key(&self, pos: usize) -> Option<(&MarkedText, u8)> {
        if let Some(b) = self.responses.as_ref().filter(|b| b.pos == pos) {
            return Some((&b.visible, EXT_RESPONSES_VISIBLE));
        }
        self.thinking
            .as_ref()
            .filter(|b| b.pos == pos)
            .map(|b| (&b.visible, EXT_THINKING_VISIBLE))
    }
}

/// Whether two id lists hold the same set.
pub fn same_ids(a: &[String], b: &[String]) -> bool {
    let sa: HashSet<&str> = a.iter().map(String::as_str).collect();
    let sb: HashSet<&str> = b.iter().map(String::as_str).collect();
    !sa.is_empty() && sa == sb
}

/// The request side of a live continuation (§4.2).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiveRequest {
    /// The call ids the trailing tool outputs answer (the request's live-call-id set).
    pub ids: Vec<String>,
    /// EOS + the rendering of the trailing tool outputs + the assistant prefix: what
    /// follows the live tokens when the binding's ids match (client text marked plain).
    pub tail: Option<MarkedText>,
    /// Some tool output has no call earlier in the request: only the live session
    /// can serve it (409 when the binding is gone at execution time).
    pub requires_live: bool,
    /// Thinking mode and the last call turn came back without its reasoning: a live
    /// or visible-keyed checkpoint keeps the model's own reasoning (§2.5).
    pub requires_live_reasoning: bool,
}

fn tail_text(
    conv: &Conversation,
    mode: ThinkMode,
    memory: Option<&ToolMemory>,
    from: usize,
) -> Result<MarkedText, ApiError> {
    let mut t = MarkedText::trusted(EOS);
    t.append(&render_continuation(conv, mode, memory, from)?);
    Ok(t)
}

fn call_ids(m: &Message) -> Vec<String> {
    m.tool_calls
        .iter()
        .flatten()
        .filter_map(|c| c.id.clone())
        .collect()
}

/// Whether the tool result for call `id` needs the live binding: false when it answers
/// a call earlier in the request (`seen`), true when it answers a live call, otherwise
/// a 400 with the API's `unknown` message.
fn answers_live_call(
    id: &str,
    seen: &HashSet<String>,
    live_ids: Option<&[String]>,
    unknown: impl FnOnce() -> String,
) -> Result<bool, ApiError> {
    if seen.contains(id) {
        Ok(false)
    } else if live_ids.is_some_and(|l| l.iter().any(|x| x == id)) {
        Ok(true)
    } else {
        Err(ApiError::bad_request(unknown()))
    }
}

/// Responses (§2.5, §4.2): every tool output must answer a call earlier in the input or
/// a call of the live binding (`live_ids`); otherwise 400. The live-call-id set is the
/// calls of the assistant message right before the trailing outputs, or the outputs'
/// own ids when the input is only tool outputs.
pub fn responses_live(
    conv: &Conversation,
    mode: ThinkMode,
    memory: Option<&ToolMemory>,
    live_ids: Option<&[String]>,
) -> Result<LiveRequest, ApiError> {
    let mut live = LiveRequest::default();
    let mut seen: HashSet<String> = HashSet::new();
    for m in &conv.messages {
        seen.extend(call_ids(m));
        if m.role != "tool" {
            continue;
        }
        let Some(id) = m.tool_call_id.as_deref() else {
            continue;
        };
        live.requires_live |= answers_live_call(id, &seen, live_ids, || {
            format!("Responses continuation state is not available for call_id {id}; retry by replaying the full input history")
        })?;
    }
    let msgs = &conv.messages;
    let start = msgs
        .iter()
        .rposition(|m| m.role != "tool")
        .map_or(0, |i| i + 1);
    if start < msgs.len() {
        if start == 0 {
            live.ids = msgs.iter().filter_map(|m| m.tool_call_id.clone()).collect();
        } else if msgs[start - 1].role == "assistant" {
            let prev = &msgs[start - 1];
            live.ids = call_ids(prev);
            live.requires_live_reasoning = mode.thinking()
                && !live.ids.is_empty()
                && prev.reasoning_content.as_deref().is_none_or(str::is_empty);
        }
        if !live.ids.is_empty() {
            live.tail = Some(tail_text(conv, mode, memory, start)?);
        }
    }
    Ok(live)
}

/// One Anthropic message as far as the live frontier is concerned.
#[derive(Clone, Debug)]
pub struct AnthropicTurn {
    /// Index of its first message in `Conversation::messages`.
    pub first: usize,
    pub assistant: bool,
    /// `tool_result` ids it carries.
    pub results: Vec<String>,
}

/// Anthropic (§2.6, §4.2): every `tool_result` id must be a `tool_use` earlier in the
/// request or a call of the live frontier (`live_ids`); otherwise 400. The live-call-id
/// set is every id of the trailing run of user messages that carry tool results.
pub fn anthropic_live(
    conv: &Conversation,
    mode: ThinkMode,
    memory: Option<&ToolMemory>,
    live_ids: Option<&[String]>,
    turns: &[AnthropicTurn],
) -> Result<LiveRequest, ApiError> {
    let mut live = LiveRequest::default();
    let mut seen: HashSet<String> = HashSet::new();
    for (i, t) in turns.iter().enumerate() {
        let end = turns.get(i + 1).map_or(conv.messages.len(), |n| n.first);
        for m in &conv.messages[t.first..end] {
            seen.extend(call_ids(m));
        }
        for id in &t.results {
            live.requires_live |= answers_live_call(id, &seen, live_ids, || {
                format!("Anthropic continuation state is not available for tool_use_id {id}; retry by replaying the full messages history")
            })?;
        }
    }
    let run = turns
        .iter()
        .rposition(|t| t.assistant || t.results.is_empty())
        .map_or(0, |i| i + 1);
    if run < turns.len() {
        live.ids = turns[run..]
            .iter()
            .flat_map(|t| t.results.iter().cloned())
            .collect();
        let from = turns[run].first;
        if let Some(prev) = conv.messages[..from].last() {
            live.requires_live_reasoning = mode.thinking()
                && prev.role == "assistant"
                && prev.tool_calls.is_some()
                && prev.reasoning_content.as_deref().is_none_or(str::is_empty);
        }
        live.tail = Some(tail_text(conv, mode, memory, from)?);
    }
    Ok(live)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_tokenizer::chat::ToolCall;

    fn conv(msgs: Vec<Message>) -> Conversation {
        Conversation {
            system: vec!["SYS".into()],
            messages: msgs,
            tools: vec![
                serde_json::json!({"type": "function", "name": "bash", "parameters": {"type": "object"}}),
            ],
            tools_disabled: false,
        }
    }

    fn call(id: &str) -> Message {
        let mut m = Message::new("assistant", "");
        m.tool_calls = Some(vec![ToolCall::new(Some(id), "bash", "{\"c\":\"ls\"}")]);
        m
    }

    fn out(id: &str, text: &str) -> Message {
        let mut m = Message::new("tool", text);
        m.tool_call_id = Some(id.into());
        m
    }

    #[test]
    fn responses_unknown_id_is_400_and_replay_accepts_it() {
        let c = conv(vec![Message::new("user", "u"), out("call_x", "r")]);
        let e = responses_live(&c, ThinkMode::High, None, None).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("call_id call_x; retry by replaying"));
        // Known to the live binding: accepted, and only the live session can serve it.
        let ids = vec!["call_x".to_string()];
        let l = responses_live(&c, ThinkMode::High, None, Some(&ids)).unwrap();
        assert!(l.requires_live);
        // A full replay (the call is earlier in the input) needs nothing live.
        let c = conv(vec![
            Message::new("user", "u"),
            call("call_x"),
            out("call_x", "r"),
        ]);
        let l = responses_live(&c, ThinkMode::High, None, None).unwrap();
        assert!(!l.requires_live);
        assert_eq!(l.ids, vec!["call_x".to_string()]);
        assert!(l.requires_live_reasoning);
        let tail = l.tail.unwrap().text().to_string();
        assert!(tail.starts_with(EOS), "{tail}");
        assert!(tail.ends_with("<｜Assistant｜><think>"), "{tail}");
        assert!(tail.contains("<tool_result>r</tool_result>"), "{tail}");
        assert!(
            !tail.contains("SYS") && !tail.contains("<｜begin"),
            "{tail}"
        );
    }

    #[test]
    fn tail_is_the_end_of_the_full_rendering() {
        let c = conv(vec![
            Message::new("user", "u"),
            call("a"),
            out("a", "r1"),
            out("a", "r2"),
        ]);
        let (marked, _) = crate::render::render_chat(&c, ThinkMode::None, None).unwrap();
        let full = marked.text();
        let l = responses_live(&c, ThinkMode::None, None, None).unwrap();
        let marked_tail = l.tail.unwrap();
        let tail = marked_tail.text();
        let rest = &tail[EOS.len()..];
        assert!(
            full.ends_with(&format!("{EOS}{rest}")),
            "{full}\n---\n{tail}"
        );
        // The tool outputs are client text in both, at the same places.
        assert_eq!(
            marked.ranges_from(full.len() - rest.len()),
            marked_tail.ranges_from(EOS.len())
        );
        assert!(!marked_tail.plain_ranges().is_empty());
    }

    #[test]
    fn only_tool_outputs_use_their_own_ids() {
        let c = conv(vec![out("a", "r"), out("b", "s")]);
        let ids = vec!["b".to_string(), "a".to_string()];
        let l = responses_live(&c, ThinkMode::High, None, Some(&ids)).unwrap();
        assert!(l.requires_live);
        assert!(same_ids(&l.ids, &ids));
        assert!(!same_ids(&l.ids, &ids[..1]));
        assert!(l
            .tail
            .unwrap()
            .text()
            .starts_with(&format!("{EOS}<｜User｜>")));
    }

    #[test]
    fn anthropic_frontier_validation() {
        let c = conv(vec![Message::new("user", "u"), out("toolu_1", "r")]);
        let turns = vec![
            AnthropicTurn {
                first: 0,
                assistant: false,
                results: vec![],
            },
            AnthropicTurn {
                first: 1,
                assistant: false,
                results: vec!["toolu_1".into()],
            },
        ];
        let e = anthropic_live(&c, ThinkMode::High, None, None, &turns).unwrap_err();
        assert!(e
            .message
            .contains("tool_use_id toolu_1; retry by replaying the full messages history"));
        let ids = vec!["toolu_1".to_string()];
        let l = anthropic_live(&c, ThinkMode::High, None, Some(&ids), &turns).unwrap();
        assert!(l.requires_live);
        assert_eq!(l.ids, ids);
    }

    #[test]
    fn visible_key_prefers_responses() {
        let mut b = Bindings {
            thinking: Some(ThinkingBinding {
                pos: 5,
                visible: MarkedText::trusted("T"),
            }),
            ..Default::default()
        };
        assert_eq!(
            b.visible_key(5).map(|(k, e)| (k.text(), e)),
            Some(("T", EXT_THINKING_VISIBLE))
        );
        assert_eq!(b.visible_key(6).map(|(k, e)| (k.text(), e)), None);
        b.responses = Some(ResponsesBinding {
            pos: 5,
            ids: vec![],
            visible: MarkedText::trusted("R"),
        });
        assert_eq!(
            b.visible_key(5).map(|(k, e)| (k.text(), e)),
            Some(("R", EXT_RESPONSES_VISIBLE))
        );
    }
}
