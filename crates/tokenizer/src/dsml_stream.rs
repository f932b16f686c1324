//! Incremental DSML parser for streaming completions.
//!
//! Fed the generated text piece by piece (any split, even inside a marker), it classifies
//! text as reasoning, content or tool calls, announces each invocation as soon as its
//! tag is complete, and streams the arguments as JSON fragments so a server can forward
//! them as OpenAI `tool_calls` deltas. It never fails: a block that breaks the grammar is
//! given back as content with [`StreamOutcome::malformed`] set, and a block the model never
//! closed is reported with [`StreamOutcome::unterminated`].
//!
//! Accepted syntaxes (one per block, fixed by its opening tag): the official
//! `<｜DSML｜tool_calls>`, the short `<DSML｜tool_calls>` that models sometimes produce, and
//! plain XML `<tool_calls>`. Inside, `<…invoke name="N">`, `<…parameter name="K"
//! string="true|false">V</…parameter>` (no `string` attribute means a string), `</…invoke>`
//! and `</…tool_calls>`. String values are raw text, as in the official format.

use serde::{Deserialize, Serialize};

use crate::pyjson;
use crate::special::{EOS, THINK_END, THINK_START};

/// Namespace prefixes of the three syntaxes, in the order they are tried.
const SYNTAXES: [&str; 3] = ["｜DSML｜", "DSML｜", ""];
/// Longest tag name we wait for before deciding that text is not a tag.
const MAX_TAG_LEN: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamOptions {
    /// The prompt ended with `<think>`: the completion starts inside reasoning.
    pub thinking: bool,
    /// Look for tool-call blocks in the content. When false everything after the
    /// reasoning is content.
    pub tools: bool,
    /// Also accept the plain-XML `<tool_calls>` syntax.
    pub accept_plain_xml: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            thinking: true,
            tools: true,
            accept_plain_xml: true,
        }
    }
}

/// What became final after a `push`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamEvent {
    Reasoning(String),
    Content(String),
    /// An invocation tag is complete.
    ToolCallStart {
        index: usize,
        name: String,
    },
    /// The next fragment of the call's arguments (together: one JSON object).
    ToolCallArgs {
        index: usize,
        delta: String,
    },
    ToolCallEnd {
        index: usize,
    },
    /// The block broke the grammar: calls announced so far are void, and the block's raw
    /// text follows as `Content`.
    ToolCallsAborted,
}

/// A call as streamed: `arguments` is the concatenation of its `ToolCallArgs` deltas.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamedCall {
    pub name: String,
    pub arguments: String,
    /// Whether `</…invoke>` was seen.
    pub complete: bool,
}

/// The whole completion once the stream ended.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOutcome {
    /// None in chat mode.
    pub reasoning: Option<String>,
    pub content: String,
    /// Complete calls only (a call cut off by the end of the stream is dropped).
    pub tool_calls: Vec<StreamedCall>,
    /// The exact text of the tool-calls block, from the `"\n\n"` before it if present; for
    /// a malformed block, everything from there to the end of the stream.
    pub raw_block: Option<String>,
    /// The block broke the grammar; its text was given back as content.
    pub malformed: bool,
    /// A block was opened but not closed.
    pub unterminated: bool,
    /// Thinking mode and `</think>` never came.
    pub reasoning_unterminated: bool,
    /// `</…tool_calls>` was seen: generation can stop.
    pub block_closed: bool,
    /// Text after EOS or after the closed block, which is ignored.
    pub ignored_tail: String,
}

/// Where the generated text currently is (drives DSML-syntax greedy sampling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DsmlState {
    Reasoning,
    Content,
    /// Inside a tool-calls block, between or inside tags.
    Structural,
    /// Inside a string parameter's value.
    StringValue,
    /// Inside a non-string (JSON) parameter's value.
    JsonValue,
    /// After the block or EOS.
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// At the very start in thinking mode: a literal `<think>` may open the reasoning.
    ReasoningStart,
    Reasoning,
    Content,
    /// Inside the block, outside any invoke.
    Block,
    InvokeTag,
    /// Inside an invoke, between parameters.
    Invoke,
    ParamTag,
    Value {
        string: bool,
    },
    Malformed,
    Done,
}

/// The incremental parser. See the module documentation.
#[derive(Clone, Debug)]
pub struct StreamParser {
    opts: StreamOptions,
    state: State,
    /// Text received but not yet classified.
    buf: String,
    /// Namespace prefix of the open block.
    syntax: &'static str,
    out: StreamOutcome,
    /// Trailing white space of the content, held because it may precede a block.
    held_space: String,
    calls: Vec<StreamedCall>,
    value_has_text: bool,
    params_in_call: usize,
}

impl StreamParser {
    pub fn new(opts: StreamOptions) -> StreamParser {
        StreamParser {
            opts,
            state: if opts.thinking {
                State::ReasoningStart
            } else {
                State::Content
            },
            buf: String::new(),
            syntax: SYNTAXES[0],
            out: StreamOutcome {
                reasoning: opts.thinking.then(String::new),
                ..Default::default()
            },
            held_space: String::new(),
            calls: Vec::new(),
            value_has_text: false,
            params_in_call: 0,
        }
    }

    pub fn state(&self) -> DsmlState {
        match self.state {
            State::ReasoningStart | State::Reasoning => DsmlState::Reasoning,
            State::Content | State::Malformed => DsmlState::Content,
            State::Block | State::InvokeTag | State::Invoke | State::ParamTag => {
                DsmlState::Structural
            }
            State::Value { string: true } => DsmlState::StringValue,
            State::Value { string: false } => DsmlState::JsonValue,
            State::Done => DsmlState::Done,
        }
    }

    /// Whether a tool-calls block was closed (or EOS seen): nothing more is needed.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Feeds the next piece of generated text.
    pub fn push(&mut self, text: &str) -> Vec<StreamEvent> {
        let mut ev = Vec::new();
        if self.state == State::Done {
            self.out.ignored_tail.push_str(text);
            return ev;
        }
        self.buf.push_str(text);
        // After a grammar error the rest of the text belongs to the (failed) block too.
        if let Some(raw) = self.out.raw_block.as_mut() {
            raw.push_str(text);
        }
        self.run(&mut ev, false);
        ev
    }

    /// Ends the stream: flushes held text and returns the last events and the outcome.
    pub fn finish(mut self) -> (Vec<StreamEvent>, StreamOutcome) {
        let mut ev = Vec::new();
        self.run(&mut ev, true);
        match self.state {
            State::ReasoningStart | State::Reasoning => {
                let rest = std::mem::take(&mut self.buf);
                self.emit_reasoning(&mut ev, rest);
                self.out.reasoning_unterminated = true;
            }
            State::Content => {
                let mut rest = std::mem::take(&mut self.held_space);
                rest.push_str(&std::mem::take(&mut self.buf));
                self.emit_content(&mut ev, rest);
            }
            State::Block
            | State::InvokeTag
            | State::Invoke
            | State::ParamTag
            | State::Value { .. } => {
                self.out.unterminated = true;
            }
            State::Malformed | State::Done => {}
        }
        let mut out = self.out;
        if !out.malformed {
            out.tool_calls = self.calls.into_iter().filter(|c| c.complete).collect();
        }
        (ev, out)
    }

    fn emit_reasoning(&mut self, ev: &mut Vec<StreamEvent>, s: String) {
        if s.is_empty() {
            return;
        }
        if let Some(r) = self.out.reasoning.as_mut() {
            r.push_str(&s);
        }
        ev.push(StreamEvent::Reasoning(s));
    }

    fn emit_content(&mut self, ev: &mut Vec<StreamEvent>, s: String) {
        if s.is_empty() {
            return;
        }
        self.out.content.push_str(&s);
        ev.push(StreamEvent::Content(s));
    }

    fn emit_args(&mut self, ev: &mut Vec<StreamEvent>, delta: String) {
        if delta.is_empty() {
            return;
        }
        let index = self.calls.len().saturating_sub(1);
        if let Some(c) = self.calls.last_mut() {
            c.arguments.push_str(&delta);
        }
        ev.push(StreamEvent::ToolCallArgs { index, delta });
    }

    /// Consumes as much of `buf` as can be classified. `end`: no more text will come.
    fn run(&mut self, ev: &mut Vec<StreamEvent>, end: bool) {
        loop {
            let progressed = match self.state.clone() {
                State::ReasoningStart => self.step_reasoning_start(end),
                State::Reasoning => self.step_reasoning(ev),
                State::Content => self.step_content(ev),
                State::Block => self.step_between(ev, false, end),
                State::Invoke => self.step_between(ev, true, end),
                State::InvokeTag => self.step_invoke_tag(ev, end),
                State::ParamTag => self.step_param_tag(ev, end),
                State::Value { string } => self.step_value(ev, string),
                State::Malformed => {
                    let rest = std::mem::take(&mut self.buf);
                    self.emit_content(ev, rest);
                    false
                }
                State::Done => {
                    let rest = std::mem::take(&mut self.buf);
                    self.out.ignored_tail.push_str(&rest);
                    false
                }
            };
            if !progressed {
                break;
            }
        }
    }

    fn step_reasoning_start(&mut self, end: bool) -> bool {
        if self.buf.starts_with(THINK_START) {
            self.buf.drain(..THINK_START.len());
        } else if THINK_START.starts_with(self.buf.as_str()) && !end {
            return false;
        }
        self.state = State::Reasoning;
        true
    }

    fn step_reasoning(&mut self, ev: &mut Vec<StreamEvent>) -> bool {
        if let Some(p) = self.buf.find(THINK_END) {
            let before: String = self.buf[..p].to_string();
            self.buf.drain(..p + THINK_END.len());
            self.emit_reasoning(ev, before);
            self.state = State::Content;
            return true;
        }
        let keep = held_suffix(&self.buf, &[THINK_END]);
        let cut = self.buf.len() - keep;
        let text: String = self.buf.drain(..cut).collect();
        self.emit_reasoning(ev, text);
        false
    }

    fn start_markers(&self) -> Vec<String> {
        let n = if self.opts.accept_plain_xml { 3 } else { 2 };
        SYNTAXES[..n]
            .iter()
            .map(|p| format!("<{p}tool_calls>"))
            .collect()
    }

    fn step_content(&mut self, ev: &mut Vec<StreamEvent>) -> bool {
        let mut markers: Vec<String> = vec![EOS.to_string()];
        if self.opts.tools {
            markers.extend(self.start_markers());
        }
        // Earliest marker; at equal positions the longer syntax was listed first.
        let found = markers
            .iter()
            .enumerate()
            .filter_map(|(k, m)| self.buf.find(m.as_str()).map(|p| (p, k)))
            .min();
        if let Some((p, k)) = found {
            let before: String = self.buf[..p].to_string();
            self.push_content_text(ev, &before);
            let marker_len = markers[k].len();
            self.buf.drain(..p + marker_len);
            if k == 0 {
                let rest = std::mem::take(&mut self.held_space);
                self.emit_content(ev, rest);
                self.state = State::Done;
                return true;
            }
            // The official form puts exactly "\n\n" before the block; it is part of it.
            let mut sep = std::mem::take(&mut self.held_space);
            let lead = if sep.ends_with("\n\n") {
                sep.truncate(sep.len() - 2);
                "\n\n"
            } else {
                ""
            };
            self.emit_content(ev, sep);
            let mut raw = format!("{lead}{}", markers[k]);
            raw.push_str(&self.buf);
            self.out.raw_block = Some(raw);
            self.syntax = SYNTAXES[k - 1];
            self.state = State::Block;
            return true;
        }
        let refs: Vec<&str> = markers.iter().map(String::as_str).collect();
        let keep = held_suffix(&self.buf, &refs);
        let cut = self.buf.len() - keep;
        let text: String = self.buf.drain(..cut).collect();
        self.push_content_text(ev, &text);
        false
    }

    /// Content text, holding back trailing white space (it may be the separator before a
    /// block, which is not content).
    fn push_content_text(&mut self, ev: &mut Vec<StreamEvent>, text: &str) {
        if text.is_empty() {
            return;
        }
        let trimmed = text.trim_end();
        if trimmed.is_empty() {
            self.held_space.push_str(text);
            return;
        }
        let mut s = std::mem::take(&mut self.held_space);
        s.push_str(trimmed);
        self.emit_content(ev, s);
        self.held_space.push_str(&text[trimmed.len()..]);
    }

    fn malformed(&mut self, ev: &mut Vec<StreamEvent>) -> bool {
        self.state = State::Malformed;
        self.out.malformed = true;
        ev.push(StreamEvent::ToolCallsAborted);
        let raw = self.out.raw_block.clone().unwrap_or_default();
        self.buf.clear();
        self.emit_content(ev, raw);
        true
    }

    /// Between tags, in the block (`in_invoke` false) or in an invoke.
    fn step_between(&mut self, ev: &mut Vec<StreamEvent>, in_invoke: bool, end: bool) -> bool {
        let ws = self.buf.len() - self.buf.trim_start().len();
        self.buf.drain(..ws);
        if self.buf.is_empty() {
            return false;
        }
        if self.buf.starts_with(EOS) {
            self.end_at_eos();
            return true;
        }
        let p = self.syntax;
        let (open, close) = if in_invoke {
            (format!("<{p}parameter"), format!("</{p}invoke>"))
        } else {
            (format!("<{p}invoke"), format!("</{p}tool_calls>"))
        };
        match match_tag(&self.buf, &open, &close) {
            TagMatch::Wait if !end => false,
            TagMatch::No if !end && EOS.starts_with(self.buf.as_str()) => false,
            TagMatch::Wait | TagMatch::No => self.malformed(ev),
            TagMatch::Open => {
                self.state = if in_invoke {
                    State::ParamTag
                } else {
                    State::InvokeTag
                };
                true
            }
            TagMatch::Close => {
                self.buf.drain(..close.len());
                if in_invoke {
                    let index = self.calls.len().saturating_sub(1);
                    let brace = if self.params_in_call == 0 { "{}" } else { "}" };
                    self.emit_args(ev, brace.to_string());
                    if let Some(c) = self.calls.last_mut() {
                        c.complete = true;
                    }
                    ev.push(StreamEvent::ToolCallEnd { index });
                    self.state = State::Block;
                } else {
                    self.out.block_closed = true;
                    // The raw block ends at the closing tag.
                    if let Some(raw) = self.out.raw_block.as_mut() {
                        let extra = self.buf.len();
                        raw.truncate(raw.len() - extra);
                    }
                    self.state = State::Done;
                }
                true
            }
        }
    }

    /// Attributes of a complete opening tag (`buf` starts with it), or None if not yet
    /// complete. Err: malformed.
    fn take_tag(&mut self, end: bool) -> Option<Result<Vec<(String, String)>, ()>> {
        let Some(close) = tag_end(&self.buf) else {
            return if end || self.buf.len() > MAX_TAG_LEN {
                Some(Err(()))
            } else {
                None
            };
        };
        let tag: String = self.buf.drain(..close + 1).collect();
        Some(parse_attributes(&tag[..tag.len() - 1]))
    }

    fn step_invoke_tag(&mut self, ev: &mut Vec<StreamEvent>, end: bool) -> bool {
        let attrs = match self.take_tag(end) {
            None => return false,
            Some(Err(())) => return self.malformed(ev),
            Some(Ok(a)) => a,
        };
        let Some(name) = attrs
            .iter()
            .find(|(k, _)| k == "name")
            .map(|(_, v)| v.clone())
        else {
            return self.malformed(ev);
        };
        let index = self.calls.len();
        self.calls.push(StreamedCall {
            name: name.clone(),
            arguments: String::new(),
            complete: false,
        });
        self.params_in_call = 0;
        ev.push(StreamEvent::ToolCallStart { index, name });
        self.state = State::Invoke;
        true
    }

    fn step_param_tag(&mut self, ev: &mut Vec<StreamEvent>, end: bool) -> bool {
        let attrs = match self.take_tag(end) {
            None => return false,
            Some(Err(())) => return self.malformed(ev),
            Some(Ok(a)) => a,
        };
        let get = |k: &str| attrs.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let Some(name) = get("name") else {
            return self.malformed(ev);
        };
        let string = get("string") != Some("false");
        let mut delta = String::from(if self.params_in_call == 0 { "{" } else { "," });
        pyjson::write_str(&mut delta, name);
        delta.push(':');
        if string {
            delta.push('"');
        }
        self.params_in_call += 1;
        self.value_has_text = false;
        self.emit_args(ev, delta);
        self.state = State::Value { string };
        true
    }

    /// EOS inside a block (`buf` starts with it) ends the stream there, leaving the
    /// block unterminated.
    fn end_at_eos(&mut self) {
        self.buf.drain(..EOS.len());
        if let Some(raw) = self.out.raw_block.as_mut() {
            let cut = raw.len().saturating_sub(self.buf.len() + EOS.len());
            if raw.is_char_boundary(cut) {
                raw.truncate(cut);
            }
        }
        self.out
            .ignored_tail
            .push_str(&std::mem::take(&mut self.buf));
        self.out.unterminated = true;
        self.state = State::Done;
    }

    fn step_value(&mut self, ev: &mut Vec<StreamEvent>, string: bool) -> bool {
        let close = format!("</{}parameter>", self.syntax);
        if let Some(p) = self.buf.find(EOS) {
            if self.buf.find(&close).is_none_or(|c| c > p) {
                let text: String = self.buf[..p].to_string();
                self.emit_value_text(ev, string, text);
                self.buf.drain(..p);
                self.end_at_eos();
                return true;
            }
        }
        let (text, closed) = match self.buf.find(&close) {
            Some(p) => {
                let t: String = self.buf[..p].to_string();
                self.buf.drain(..p + close.len());
                (t, true)
            }
            None => {
                let keep = held_suffix(&self.buf, &[&close, EOS]);
                let cut = self.buf.len() - keep;
                (self.buf.drain(..cut).collect(), false)
            }
        };
        self.emit_value_text(ev, string, text);
        if closed {
            let tail = match (string, self.value_has_text) {
                (true, _) => "\"",
                // An empty non-string value would leave the JSON invalid.
                (false, false) => "null",
                (false, true) => "",
            };
            self.emit_args(ev, tail.to_string());
            self.state = State::Invoke;
        }
        closed
    }
}

impl StreamParser {
    fn emit_value_text(&mut self, ev: &mut Vec<StreamEvent>, string: bool, text: String) {
        if text.is_empty() {
            return;
        }
        let delta = if string {
            let quoted = pyjson::dumps_str(&text);
            quoted[1..quoted.len() - 1].to_string()
        } else {
            if !text.trim().is_empty() {
                self.value_has_text = true;
            }
            text
        };
        self.emit_args(ev, delta);
    }
}

enum TagMatch {
    /// `buf` could still become one of the tags.
    Wait,
    No,
    Open,
    Close,
}

/// Whether `buf` starts with the opening tag name `open` (followed by white space or `>`)
/// or with the closing tag `close`.
fn match_tag(buf: &str, open: &str, close: &str) -> TagMatch {
    if buf.starts_with(close) {
        return TagMatch::Close;
    }
    if let Some(rest) = buf.strip_prefix(open) {
        return match rest.chars().next() {
            None => TagMatch::Wait,
            Some(c) if c.is_whitespace() || c == '>' => TagMatch::Open,
            Some(_) => TagMatch::No,
        };
    }
    if open.starts_with(buf) || close.starts_with(buf) {
        TagMatch::Wait
    } else {
        TagMatch::No
    }
}

/// Byte index of the `>` ending the tag at the start of `buf` (outside quotes).
fn tag_end(buf: &str) -> Option<usize> {
    let mut quoted = false;
    for (i, b) in buf.bytes().enumerate() {
        match b {
            b'"' => quoted = !quoted,
            b'>' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// `<ns:name k="v" k2="v2"` → [(k, v), …]. Values are raw (the official format does not
/// escape them).
fn parse_attributes(tag: &str) -> Result<Vec<(String, String)>, ()> {
    let body = tag.split_once(char::is_whitespace).map_or("", |(_, b)| b);
    let mut attrs = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=').ok_or(())?;
        let key = key.trim();
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(());
        }
        let after = after.trim_start().strip_prefix('"').ok_or(())?;
        let (value, after) = after.split_once('"').ok_or(())?;
        attrs.push((key.to_string(), value.to_string()));
        rest = after.trim_start();
    }
    Ok(attrs)
}

/// Length of the longest proper suffix of `buf` that is a prefix of one of `markers`:
/// text that must wait because the next piece may complete a marker.
fn held_suffix(buf: &str, markers: &[&str]) -> usize {
    let max = markers.iter().map(|m| m.len()).max().unwrap_or(0);
    let lo = buf.len().saturating_sub(max.saturating_sub(1));
    for start in lo..buf.len() {
        if !buf.is_char_boundary(start) {
            continue;
        }
        let tail = &buf[start..];
        if markers.iter().any(|m| m.starts_with(tail)) {
            return buf.len() - start;
        }
    }
    0
}

/// Parses a whole completion at once with the streaming parser.
pub fn parse_streaming(text: &str, opts: StreamOptions) -> StreamOutcome {
    let mut p = StreamParser::new(opts);
    p.push(text);
    p.finish().1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(text: &str, opts: StreamOptions, step: usize) -> (Vec<StreamEvent>, StreamOutcome) {
        let mut p = StreamParser::new(opts);
        let mut ev = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(step.max(1)) {
            ev.extend(p.push(&chunk.iter().collect::<String>()));
        }
        let (last, out) = p.finish();
        ev.extend(last);
        (ev, out)
    }

    const CALL: &str = "need a tool</think>Hello.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n<｜DSML｜parameter name=\"command\" string=\"true\">ls -la \"x\"</｜DSML｜parameter>\n<｜DSML｜parameter name=\"timeout\" string=\"false\">10</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>";

    #[test]
    fn canonical_block_any_split() {
        let whole = parse_streaming(CALL, StreamOptions::default());
        assert_eq!(whole.reasoning.as_deref(), Some("need a tool"));
        assert_eq!(whole.content, "Hello.");
        assert_eq!(whole.tool_calls.len(), 1);
        assert_eq!(whole.tool_calls[0].name, "bash");
        assert_eq!(
            whole.tool_calls[0].arguments,
            r#"{"command":"ls -la \"x\"","timeout":10}"#
        );
        assert!(whole.block_closed && !whole.malformed && !whole.unterminated);
        assert!(whole
            .raw_block
            .as_deref()
            .unwrap()
            .starts_with("\n\n<｜DSML｜tool_calls>"));
        assert!(whole
            .raw_block
            .as_deref()
            .unwrap()
            .ends_with("</｜DSML｜tool_calls>"));
        for step in 1..12 {
            let (ev, out) = feed(CALL, StreamOptions::default(), step);
            assert_eq!(out, whole, "step {step}");
            // The streamed fragments add up to the final values, and no marker leaks.
            let mut content = String::new();
            for e in &ev {
                if let StreamEvent::Content(s) = e {
                    content.push_str(s);
                }
            }
            assert_eq!(content, "Hello.");
        }
    }

    #[test]
    fn short_and_xml_syntaxes() {
        let short = "</think>\n\n<DSML｜tool_calls>\n<DSML｜invoke name=\"f\">\n<DSML｜parameter name=\"a\">x</DSML｜parameter>\n</DSML｜invoke>\n</DSML｜tool_calls>";
        let out = parse_streaming(short, StreamOptions::default());
        assert_eq!(out.tool_calls[0].arguments, r#"{"a":"x"}"#);
        let xml = "<tool_calls><invoke name=\"g\"></invoke></tool_calls>";
        let out = parse_streaming(
            xml,
            StreamOptions {
                thinking: false,
                ..Default::default()
            },
        );
        assert_eq!(out.tool_calls[0].arguments, "{}");
        assert_eq!(out.content, "");
    }

    #[test]
    fn malformed_and_unterminated_degrade() {
        let bad = "</think>ok\n\n<｜DSML｜tool_calls>\nnot a tag";
        let out = parse_streaming(bad, StreamOptions::default());
        assert!(out.malformed);
        assert!(out.tool_calls.is_empty());
        assert_eq!(out.content, "ok\n\n<｜DSML｜tool_calls>\nnot a tag");
        let open = "</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">par";
        let out = parse_streaming(open, StreamOptions::default());
        assert!(out.unterminated && !out.malformed);
        assert!(out.tool_calls.is_empty());
        let think = parse_streaming("still thinking", StreamOptions::default());
        assert!(think.reasoning_unterminated);
        assert_eq!(think.reasoning.as_deref(), Some("still thinking"));
    }

    #[test]
    fn states_for_greedy_sampling() {
        let mut p = StreamParser::new(StreamOptions {
            thinking: false,
            ..Default::default()
        });
        assert_eq!(p.state(), DsmlState::Content);
        p.push("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n");
        assert_eq!(p.state(), DsmlState::Structural);
        p.push("<｜DSML｜parameter name=\"a\" string=\"true\">ab");
        assert_eq!(p.state(), DsmlState::StringValue);
        p.push("</｜DSML｜parameter>\n<｜DSML｜parameter name=\"b\" string=\"false\">[1");
        assert_eq!(p.state(), DsmlState::JsonValue);
        p.push("]</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
        assert!(p.is_done());
    }
}
