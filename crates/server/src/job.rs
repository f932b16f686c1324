//! A generation job as the worker sees it, and the events it sends back.

use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::api::Prepared;
use crate::render::ThinkMode;

/// Which endpoint a job came from (logs, metrics, tool-id prefixes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiKind {
    Chat,
    Completions,
    Responses,
    Anthropic,
}

impl ApiKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ApiKind::Chat => "chat",
            ApiKind::Completions => "completions",
            ApiKind::Responses => "responses",
            ApiKind::Anthropic => "messages",
        }
    }
    /// Prefix of generated tool-call ids.
    pub fn call_id_prefix(self) -> &'static str {
        match self {
            ApiKind::Anthropic => "toolu_",
            _ => "call_",
        }
    }
}

/// Sampling knobs after the thinking-mode override (§2.2, §7).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    /// 0: derived from the time and a counter.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.05,
            seed: 0,
        }
    }
}

impl Sampling {
    /// In thinking mode the model's recommended settings are forced; only the seed stays.
    pub fn for_mode(self, mode: ThinkMode) -> Sampling {
        if mode.thinking() {
            Sampling {
                seed: self.seed,
                ..Sampling::default()
            }
        } else {
            self
        }
    }
}

pub struct GenJob {
    pub id: u64,
    /// What to generate (a copy of the request the API layer prepared).
    pub req: Prepared,
    pub tx: UnboundedSender<GenEvent>,
    pub enqueued: Instant,
}

/// Why generation ended (internal; each API maps it, §2.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    ToolCalls,
    Error,
}

impl Finish {
    pub fn openai(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
            Finish::Error => "error",
        }
    }
    pub fn anthropic(self) -> &'static str {
        match self {
            Finish::Stop | Finish::Error => "end_turn",
            Finish::Length => "max_tokens",
            Finish::ToolCalls => "tool_use",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Effective prompt tokens synced.
    pub prompt: usize,
    /// Generated tokens (EOS excluded).
    pub completion: usize,
    /// Prompt tokens reused from the live session or the disk cache.
    pub cached: usize,
}

/// A parsed tool call with the id the client saw.
#[derive(Clone, Debug, PartialEq)]
pub struct OutCall {
    pub id: String,
    pub name: String,
    /// Compact JSON object text.
    pub arguments: String,
}

#[derive(Clone, Debug)]
pub struct GenResult {
    pub finish: Finish,
    pub error: Option<String>,
    /// Some in thinking mode.
    pub reasoning: Option<String>,
    /// Whether `</think>` was seen.
    pub reasoning_closed: bool,
    pub content: String,
    pub tool_calls: Vec<OutCall>,
    /// How many calls were announced while streaming (the rest go out at the end).
    pub streamed_calls: usize,
    /// The stop sequence that ended generation.
    pub stop_sequence: Option<String>,
    /// A complete tool block failed to parse and came back as text.
    pub malformed: bool,
    pub usage: Usage,
}

/// Worker → HTTP handler.
#[derive(Clone, Debug)]
pub enum GenEvent {
    /// Prefill is running (sent after every chunk; streams answer with a keepalive).
    Progress {
        done: usize,
        total: usize,
    },
    /// Prefill finished; generation starts.
    Started {
        prompt: usize,
        cached: usize,
    },
    Reasoning(String),
    Content(String),
    ToolStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolArgs {
        index: usize,
        delta: String,
    },
    Done(Box<GenResult>),
    /// Failed before generating (prefill error, shutdown, live state gone).
    Failed {
        status: u16,
        message: String,
    },
}
