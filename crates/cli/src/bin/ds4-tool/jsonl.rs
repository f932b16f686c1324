//! The logic of the `ds4-tool tokenize` and `ds4-tool render` subcommands, as functions over
//! JSON Lines streams so they can be tested without a process (`tokenize.rs` wires them to
//! stdin/stdout).

use std::io::{BufRead, Write};

use serde::Deserialize;
use serde_json::{json, Value};
use thiserror::Error;

use ds4_tokenizer::chat::{encode_messages, EncodeOptions, Message, ReasoningEffort, ThinkingMode};
use ds4_tokenizer::{ChatError, Tokenizer};

#[derive(Debug, Error)]
pub enum CliError {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("line {line}: invalid JSON: {source}")]
    Json {
        line: usize,
        source: serde_json::Error,
    },
    #[error("line {line}: {message}")]
    Input { line: usize, message: String },
    #[error("line {line}: {source}")]
    Chat { line: usize, source: ChatError },
}

/// One render request, in the schema of `fixtures/encoding/encode_cases.jsonl`.
#[derive(Clone, Debug, Deserialize)]
pub struct RenderRequest {
    pub messages: Vec<Message>,
    /// Tools given with the first message (which must then be a system message).
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub thinking_mode: ThinkingMode,
    #[serde(default)]
    pub reasoning_effort: Option<ReasoningEffort>,
    #[serde(default = "yes")]
    pub drop_thinking: bool,
    #[serde(default = "yes")]
    pub add_default_bos_token: bool,
    #[serde(default)]
    pub context: Option<Vec<Message>>,
}

fn yes() -> bool {
    true
}

impl RenderRequest {
    pub fn render(&self) -> Result<String, ChatError> {
        let mut messages = self.messages.clone();
        if let (Some(tools), Some(first)) = (&self.tools, messages.first_mut()) {
            first.tools = Some(tools.clone());
        }
        let opts = EncodeOptions {
            thinking_mode: self.thinking_mode,
            reasoning_effort: self.reasoning_effort,
            drop_thinking: self.drop_thinking,
            add_default_bos_token: self.add_default_bos_token,
        };
        encode_messages(&messages, self.context.as_deref().unwrap_or(&[]), &opts)
    }
}

/// Lines to process: blank lines and `{"meta": …}` headers (as in the fixture files) are
/// skipped, so a fixture file can be piped in unchanged.
fn for_each_line(
    reader: impl BufRead,
    mut f: impl FnMut(usize, Value) -> Result<(), CliError>,
) -> Result<usize, CliError> {
    let mut n = 0;
    for (k, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line).map_err(|source| CliError::Json {
            line: k + 1,
            source,
        })?;
        if v.get("meta").is_some() && v.as_object().is_some_and(|o| o.len() == 1) {
            continue;
        }
        f(k + 1, v)?;
        n += 1;
    }
    Ok(n)
}

/// Reads `{"text": …}` lines and writes `{"ids": […]}` lines (added tokens recognised, no
/// BOS). Returns the number of lines processed.
pub fn run_tokenize(
    reader: impl BufRead,
    mut writer: impl Write,
    tok: &Tokenizer,
) -> Result<usize, CliError> {
    for_each_line(reader, |line, v| {
        let text = v
            .get("text")
            .and_then(Value::as_str)
            .ok_or(CliError::Input {
                line,
                message: "expected an object with a string \"text\"".into(),
            })?;
        writeln!(writer, "{}", json!({ "ids": tok.encode(text) }))?;
        Ok(())
    })
}

/// Reads render requests ([`RenderRequest`]) and writes `{"prompt": …}` lines.
pub fn run_render(reader: impl BufRead, mut writer: impl Write) -> Result<usize, CliError> {
    for_each_line(reader, |line, v| {
        let req: RenderRequest =
            serde_json::from_value(v).map_err(|source| CliError::Json { line, source })?;
        let prompt = req
            .render()
            .map_err(|source| CliError::Chat { line, source })?;
        writeln!(writer, "{}", json!({ "prompt": prompt }))?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    //! `run_tokenize` / `run_render` over the fixture files piped in unchanged.

    use std::path::PathBuf;

    use super::*;

    fn read_fixture(rel: &str) -> Vec<u8> {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures")
            .join(rel);
        std::fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
    }

    /// Non-header lines of a JSON Lines fixture.
    fn cases(rel: &str) -> Vec<Value> {
        let text = String::from_utf8(read_fixture(rel)).expect("fixture is UTF-8");
        text.lines()
            .skip(1)
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_str(l).expect("case JSON"))
            .collect()
    }

    fn official() -> Tokenizer {
        Tokenizer::from_tokenizer_json(&read_fixture("tokenizer/tokenizer.json"))
            .expect("official tokenizer.json loads")
    }

    #[test]
    fn render_fixture_file() {
        let input = read_fixture("encoding/encode_cases.jsonl");
        let mut out = Vec::new();
        let n = run_render(&input[..], &mut out).unwrap();
        let cases = cases("encoding/encode_cases.jsonl");
        assert_eq!(n, cases.len());
        let out = String::from_utf8(out).unwrap();
        for (line, case) in out.lines().zip(&cases) {
            let v: Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["prompt"], case["prompt"], "{}", case["id"]);
        }
    }

    #[test]
    fn tokenize_fixture_file() {
        let tok = official();
        let input = read_fixture("tokenizer/tokenize_cases.jsonl");
        let cases = cases("tokenizer/tokenize_cases.jsonl");
        let encode: Vec<_> = cases.iter().filter(|c| c["kind"] == "encode").collect();
        let lines: String = encode
            .iter()
            .map(|c| json!({ "text": c["text"] }).to_string() + "\n")
            .collect();
        let mut out = Vec::new();
        assert_eq!(
            run_tokenize(lines.as_bytes(), &mut out, &tok).unwrap(),
            encode.len()
        );
        for (line, case) in String::from_utf8(out).unwrap().lines().zip(&encode) {
            let v: Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["ids"], case["ids"]);
        }
        // The fixture file itself goes through (header skipped, every case has a "text").
        assert_eq!(
            run_tokenize(&input[..], &mut Vec::new(), &tok).unwrap(),
            cases.len()
        );
        // A line without "text" is reported with its line number.
        let err = run_tokenize(
            &b"{\"text\":\"a\"}\n{\"ids\":[1]}\n"[..],
            &mut Vec::new(),
            &tok,
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("line 2:"), "{err}");
    }
}
