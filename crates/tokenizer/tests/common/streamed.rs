//! What a client that concatenates the deltas of a DSML event stream sees. Shared by
//! the fixture tests and the fuzz target (which includes this file by path).

use ds4_tokenizer::dsml_stream::StreamEvent;

/// The concatenated reasoning and content deltas and each tool call's argument deltas.
#[derive(Default)]
pub struct Streamed {
    pub reasoning: String,
    pub content: String,
    pub args: Vec<String>,
}

impl Streamed {
    /// Adds up `events`; panics when a call starts out of order.
    pub fn of(events: &[StreamEvent]) -> Streamed {
        let mut s = Streamed::default();
        for e in events {
            match e {
                StreamEvent::Reasoning(r) => s.reasoning.push_str(r),
                StreamEvent::Content(c) => s.content.push_str(c),
                StreamEvent::ToolCallStart { index, .. } => {
                    assert_eq!(*index, s.args.len(), "tool calls start in order");
                    s.args.push(String::new());
                }
                StreamEvent::ToolCallArgs { index, delta } => s.args[*index].push_str(delta),
                StreamEvent::ToolCallEnd { .. } | StreamEvent::ToolCallsAborted => {}
            }
        }
        s
    }
}
