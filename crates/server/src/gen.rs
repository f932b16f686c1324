//! The output pipeline of one generation: stop sequences (with hold-back), then the
//! tokenizer's incremental DSML parser (reasoning / content / tool calls with argument
//! deltas and its own hold-back of partial markers and entities), then tool-call ids.

use ds4_tokenizer::dsml_stream::{
    DsmlState, StreamEvent, StreamOptions, StreamOutcome, StreamParser,
};
use serde_json::Value;

use crate::job::{ApiKind, GenEvent, OutCall};

/// Finds stop sequences in the generated text, holding back the bytes that could still
/// be the start of one (§2.8: `maxlen - 1`), never splitting a UTF-8 character.
#[derive(Debug)]
pub struct StopFilter {
    stops: Vec<String>,
    maxlen: usize,
    buf: String,
    emitted: usize,
    scan_from: usize,
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

impl StopFilter {
    pub fn new(stops: &[String]) -> StopFilter {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let maxlen = stops.iter().map(String::len).max().unwrap_or(0);
        StopFilter {
            stops,
            maxlen,
            buf: String::new(),
            emitted: 0,
            scan_from: 0,
        }
    }

    /// Adds text; returns what is safe to pass on, and the stop string if one matched
    /// (the text is cut right before it; nothing after it is ever returned).
    pub fn push(&mut self, text: &str) -> (String, Option<String>) {
        self.buf.push_str(text);
        if self.stops.is_empty() {
            let out = self.buf[self.emitted..].to_string();
            self.emitted = self.buf.len();
            return (out, None);
        }
        let hay = &self.buf[self.scan_from..];
        let mut best: Option<(usize, &String)> = None;
        for s in &self.stops {
            if let Some(p) = hay.find(s.as_str()) {
                if best.is_none_or(|(bp, _)| p < bp) {
                    best = Some((p, s));
                }
            }
        }
        if let Some((p, s)) = best {
            let at = self.scan_from + p;
            let out = self.buf[self.emitted.min(at)..at].to_string();
            let s = s.clone();
            self.emitted = self.buf.len();
            self.stops.clear();
            return (out, Some(s));
        }
        let safe = floor_boundary(&self.buf, self.buf.len().saturating_sub(self.maxlen - 1));
        self.scan_from = safe;
        let safe = safe.max(self.emitted);
        let out = self.buf[self.emitted..safe].to_string();
        self.emitted = safe;
        (out, None)
    }

    /// The held tail at the end of generation.
    pub fn finish(&mut self) -> String {
        let out = self.buf[self.emitted..].to_string();
        self.emitted = self.buf.len();
        out
    }
}

/// A fresh unguessable id: prefix + 32 lowercase hex digits (16 random bytes).
pub fn random_id(prefix: &str) -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::rng().random();
    let mut s = String::with_capacity(prefix.len() + 32);
    s.push_str(prefix);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Hex id of `n` random bytes (Responses `resp_`/`msg_`/… ids use 24 hex digits).
pub fn random_hex(prefix: &str, n: usize) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    let mut s = String::from(prefix);
    for _ in 0..n {
        let b: u8 = rng.random();
        s.push_str(&format!("{b:02x}"));
    }
    s
}

pub struct Pipeline {
    kind: ApiKind,
    stop: StopFilter,
    parser: Option<StreamParser>,
    ids: Vec<String>,
    /// Everything that passed the stop filter (the raw output).
    pub text: String,
    pub stop_hit: Option<String>,
}

/// The final state of a finished pipeline.
pub struct PipelineOutcome {
    pub reasoning: Option<String>,
    pub reasoning_closed: bool,
    pub content: String,
    pub calls: Vec<OutCall>,
    pub streamed_calls: usize,
    /// The exact DSML block (for the replay memory).
    pub raw_block: Option<String>,
    pub malformed: bool,
    pub unterminated: bool,
    pub block_closed: bool,
}

impl Pipeline {
    /// `structured`: split reasoning/content and parse tool calls (chat endpoints);
    /// otherwise the output is raw text (`/v1/completions`).
    pub fn new(
        kind: ApiKind,
        structured: bool,
        thinking: bool,
        tools: bool,
        stops: &[String],
    ) -> Pipeline {
        let parser = structured.then(|| {
            StreamParser::new(StreamOptions {
                thinking,
                tools,
                accept_plain_xml: true,
            })
        });
        Pipeline {
            kind,
            stop: StopFilter::new(stops),
            parser,
            ids: Vec::new(),
            text: String::new(),
            stop_hit: None,
        }
    }

    /// Inside DSML syntax (tags, not payloads): the greedy rule applies.
    pub fn in_dsml_syntax(&self) -> bool {
        self.parser
            .as_ref()
            .is_some_and(|p| p.state() == DsmlState::Structural)
    }

    /// A tool-calls block was closed: generation can stop.
    pub fn block_closed(&self) -> bool {
        self.parser.as_ref().is_some_and(|p| p.is_done())
    }

    pub fn push(&mut self, piece: &str) -> Vec<GenEvent> {
        if self.stop_hit.is_some() {
            return Vec::new();
        }
        let (pass, hit) = self.stop.push(piece);
        self.stop_hit = hit;
        self.feed(&pass)
    }

    fn feed(&mut self, pass: &str) -> Vec<GenEvent> {
        if pass.is_empty() {
            return Vec::new();
        }
        self.text.push_str(pass);
        match self.parser.as_mut() {
            None => vec![GenEvent::Content(pass.to_string())],
            Some(p) => {
                let evs = p.push(pass);
                self.convert(evs)
            }
        }
    }

    fn convert(&mut self, evs: Vec<StreamEvent>) -> Vec<GenEvent> {
        let mut out = Vec::with_capacity(evs.len());
        for e in evs {
            match e {
                StreamEvent::Reasoning(s) if !s.is_empty() => out.push(GenEvent::Reasoning(s)),
                StreamEvent::Content(s) if !s.is_empty() => out.push(GenEvent::Content(s)),
                StreamEvent::ToolCallStart { index, name } => {
                    while self.ids.len() <= index {
                        self.ids.push(random_id(self.kind.call_id_prefix()));
                    }
                    out.push(GenEvent::ToolStart {
                        index,
                        id: self.ids[index].clone(),
                        name,
                    });
                }
                StreamEvent::ToolCallArgs { index, delta } if !delta.is_empty() => {
                    out.push(GenEvent::ToolArgs { index, delta })
                }
                _ => {}
            }
        }
        out
    }

    /// Flushes held text and returns the last events and the parsed message.
    pub fn finish(mut self) -> (Vec<GenEvent>, PipelineOutcome) {
        let tail = self.stop.finish();
        let mut events = if self.stop_hit.is_none() {
            self.feed(&tail)
        } else {
            Vec::new()
        };
        let Some(parser) = self.parser.take() else {
            let outcome = PipelineOutcome {
                reasoning: None,
                reasoning_closed: true,
                content: self.text.clone(),
                calls: Vec::new(),
                streamed_calls: 0,
                raw_block: None,
                malformed: false,
                unterminated: false,
                block_closed: false,
            };
            return (events, outcome);
        };
        let (evs, out) = parser.finish();
        events.extend(self.convert(evs));
        let outcome = self.outcome(out);
        (events, outcome)
    }

    fn outcome(&mut self, out: StreamOutcome) -> PipelineOutcome {
        let streamed_calls = self.ids.len();
        let calls: Vec<OutCall> = out
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                while self.ids.len() <= i {
                    self.ids.push(random_id(self.kind.call_id_prefix()));
                }
                OutCall {
                    id: self.ids[i].clone(),
                    name: c.name.clone(),
                    arguments: compact_arguments(&c.arguments),
                }
            })
            .collect();
        PipelineOutcome {
            reasoning_closed: !out.reasoning_unterminated,
            reasoning: out.reasoning,
            content: out.content,
            calls,
            streamed_calls: streamed_calls.min(out.tool_calls.len()),
            raw_block: out.raw_block,
            malformed: out.malformed,
            unterminated: out.unterminated,
            block_closed: out.block_closed,
        }
    }
}

/// Re-serialises streamed arguments compactly in parse order. (quirk kept, §10.3) text
/// that is not a JSON object becomes `{}`, because clients need an object.
pub fn compact_arguments(args: &str) -> String {
    match serde_json::from_str::<Value>(args) {
        Ok(v @ Value::Object(_)) => v.to_string(),
        _ => "{}".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_stop(pieces: &[&str], stops: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut f = StopFilter::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (o, hit) = f.push(p);
            out.push_str(&o);
            if hit.is_some() {
                return (out, hit);
            }
        }
        out.push_str(&f.finish());
        (out, None)
    }

    #[test]
    fn stop_split_across_pieces() {
        let (out, hit) = run_stop(&["hello ST", "OP world"], &["STOP"]);
        assert_eq!(out, "hello ");
        assert_eq!(hit.as_deref(), Some("STOP"));
    }

    #[test]
    fn earliest_stop_wins() {
        let (out, hit) = run_stop(&["a b c"], &["c", "b"]);
        assert_eq!(out, "a ");
        assert_eq!(hit.as_deref(), Some("b"));
    }

    #[test]
    fn holds_back_maxlen_minus_one() {
        let mut f = StopFilter::new(&["XYZ".to_string()]);
        assert_eq!(f.push("abcdX").0, "abc");
        assert_eq!(f.push("Y").0, "d");
        assert_eq!(f.finish(), "XY");
    }

    #[test]
    fn never_splits_utf8() {
        let mut f = StopFilter::new(&["abcd".to_string()]);
        let (o, _) = f.push("xé");
        assert!(o.is_empty() || o == "x");
        assert_eq!(format!("{o}{}", f.finish()), "xé");
    }

    #[test]
    fn tool_call_streams_with_ids() {
        let mut p = Pipeline::new(ApiKind::Chat, true, true, true, &[]);
        let text = "r</think>Hi.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n<｜DSML｜parameter name=\"command\" string=\"true\">echo partial</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let mut evs = Vec::new();
        for ch in text.chars() {
            evs.extend(p.push(&ch.to_string()));
        }
        assert!(p.block_closed());
        let (last, out) = p.finish();
        evs.extend(last);
        assert_eq!(out.calls.len(), 1);
        assert!(out.calls[0].id.starts_with("call_") && out.calls[0].id.len() == 37);
        assert_eq!(out.calls[0].arguments, r#"{"command":"echo partial"}"#);
        assert_eq!(out.content, "Hi.");
        let args: String = evs
            .iter()
            .filter_map(|e| match e {
                GenEvent::ToolArgs { delta, .. } => Some(delta.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(args, r#"{"command":"echo partial"}"#);
        assert!(!evs
            .iter()
            .any(|e| matches!(e, GenEvent::Content(c) if c.contains("DSML") || c.contains('<'))));
    }
}
