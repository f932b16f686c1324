//! DSML: tool schemas and tool calls as the model reads and writes them.
//!
//! Rendering follows the official encoder (`render_tools`, `encode_arguments_to_dsml`);
//! [`parse_completion`] is a byte-exact port of `parse_message_from_completion_text`, strict
//! like the reference (any deviation is an error). The incremental parser used while
//! streaming lives in [`crate::dsml_stream`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::chat::{FunctionCall, ThinkingMode, ToolCall};
use crate::error::ParseError;
use crate::marked::MarkedText;
use crate::pyjson::{self, PyValue};
use crate::special::{BOS, DSML, EOS, THINK_END, THINK_START};

pub const TOOL_CALLS_START: &str = "<｜DSML｜tool_calls>";
pub const TOOL_CALLS_END: &str = "</｜DSML｜tool_calls>";
pub const INVOKE_START: &str = "<｜DSML｜invoke";
pub const INVOKE_END: &str = "</｜DSML｜invoke>";
pub const PARAMETER_START: &str = "<｜DSML｜parameter";
pub const PARAMETER_END: &str = "</｜DSML｜parameter>";

const TOOLS_TEMPLATE_HEAD: &str = "## Tools\n\n\
You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n\
<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"$TOOL_NAME\">\n\
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n\
...\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"$TOOL_NAME2\">\n\
...\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>\n\n\
String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n\
If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n\
Otherwise, output directly after </think> with tool calls or final response.\n\n\
### Available Tool Schemas\n\n";

const TOOLS_TEMPLATE_TAIL: &str = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

/// The `## Tools` block around already-serialized schema lines.
pub fn tools_block(schemas: &str) -> String {
    tools_block_marked(schemas).into_parts().0
}

/// `tools_block` with the schemas (client text) marked plain.
pub fn tools_block_marked(schemas: &str) -> MarkedText {
    let mut s = MarkedText::trusted(TOOLS_TEMPLATE_HEAD);
    s.push_plain(schemas);
    s.push_str(TOOLS_TEMPLATE_TAIL);
    s
}

fn push_param(out: &mut MarkedText, name: &str, is_str: bool, value: &str) {
    out.push_str(PARAMETER_START);
    out.push_str(" name=\"");
    out.push_plain(name);
    out.push_str(if is_str {
        "\" string=\"true\">"
    } else {
        "\" string=\"false\">"
    });
    out.push_plain(value);
    out.push_str(PARAMETER_END);
}

/// `encode_arguments_to_dsml`: one parameter line per argument, in key order, joined by
/// newlines. Names and values are written unescaped.
pub fn arguments_to_dsml(arguments: &Value) -> String {
    arguments_to_dsml_marked(arguments).into_parts().0
}

/// `arguments_to_dsml` with names and values (client text) marked plain.
fn arguments_to_dsml_marked(arguments: &Value) -> MarkedText {
    let mut out = MarkedText::new();
    match arguments {
        Value::String(text) => match pyjson::loads(text) {
            Some(PyValue::Dict(items)) => {
                for (k, (key, v)) in items.iter().enumerate() {
                    if k > 0 {
                        out.push_str("\n");
                    }
                    match v {
                        PyValue::Str(s) => push_param(&mut out, key, true, s),
                        other => push_param(&mut out, key, false, &other.dumps()),
                    }
                }
            }
            // Not JSON: the raw text as one string argument. (JSON that is not an object
            // makes the reference raise; it is treated the same way here.)
            _ => push_param(&mut out, "arguments", true, text),
        },
        // An object (or any non-string) cannot go through json.loads: the reference wraps it
        // as one non-string argument.
        other => push_param(&mut out, "arguments", false, &pyjson::dumps_serde(other)),
    }
    out
}

/// One `<｜DSML｜invoke>` element.
pub fn render_invoke(name: &str, arguments: &Value) -> String {
    render_invoke_marked(name, arguments).into_parts().0
}

fn render_invoke_marked(name: &str, arguments: &Value) -> MarkedText {
    let mut s = MarkedText::trusted(INVOKE_START);
    s.push_str(" name=\"");
    s.push_plain(name);
    s.push_str("\">\n");
    s.append(&arguments_to_dsml_marked(arguments));
    s.push_str("\n");
    s.push_str(INVOKE_END);
    s
}

/// The tool-calls block (without the `"\n\n"` the assistant turn puts before it).
pub fn render_tool_calls(calls: &[ToolCall]) -> String {
    render_tool_calls_marked(calls).into_parts().0
}

/// `render_tool_calls` with the markup trusted and the tool names, parameter names and
/// values (client text when a client replays `tool_calls`) marked plain.
pub fn render_tool_calls_marked(calls: &[ToolCall]) -> MarkedText {
    let mut s = MarkedText::trusted(TOOL_CALLS_START);
    s.push_str("\n");
    for (k, c) in calls.iter().enumerate() {
        if k > 0 {
            s.push_str("\n");
        }
        s.append(&render_invoke_marked(
            &c.function.name,
            &c.function.arguments,
        ));
    }
    s.push_str("\n");
    s.push_str(TOOL_CALLS_END);
    s
}

/// Canonical DSML suffix of an assistant turn for calls known only as JSON (for example
/// replayed by a client): exactly what the encoder writes after the content, so the next
/// prompt re-tokenizes to the same ids as the rendered history.
pub fn canonical_tool_calls_suffix(calls: &[ToolCall]) -> String {
    if calls.is_empty() {
        return String::new();
    }
    format!("\n\n{}", render_tool_calls(calls))
}

/// The assistant message parsed from a completion.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ParsedMessage {
    pub role: String,
    pub content: String,
    pub reasoning_content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// `_read_until_stop`: text from `index` up to the earliest stop (ties go to the earlier
/// stop in the list). Returns (index after the stop, text, which stop).
fn read_until<'a>(text: &'a str, index: usize, stops: &[&str]) -> (usize, &'a str, Option<usize>) {
    let hay = &text[index..];
    let mut best: Option<(usize, usize)> = None;
    for (k, s) in stops.iter().enumerate() {
        if let Some(p) = hay.find(s) {
            if best.is_none_or(|(bp, _)| p < bp) {
                best = Some((p, k));
            }
        }
    }
    match best {
        Some((p, k)) => (index + p + stops[k].len(), &hay[..p], Some(k)),
        None => (text.len(), hay, None),
    }
}

/// Python's `str.isspace` (what `\s` matches in a `re` str pattern).
pub(crate) fn py_isspace(c: char) -> bool {
    matches!(c, '\t'..='\r' | '\x1c'..='\x1f' | ' ' | '\u{85}' | '\u{a0}' | '\u{1680}'
        | '\u{2000}'..='\u{200a}' | '\u{2028}' | '\u{2029}' | '\u{202f}' | '\u{205f}' | '\u{3000}')
}

/// `re.findall(r'^\s*name="(.*?)">\n$', s, re.DOTALL)` with exactly one match.
fn match_tool_name(s: &str) -> Option<&str> {
    let rest = s.trim_start_matches(py_isspace).strip_prefix("name=\"")?;
    // `$` also matches before one final newline; the lazy group takes the shorter option.
    if let Some(name) = rest.strip_suffix("\">\n\n") {
        return Some(name);
    }
    rest.strip_suffix("\">\n")
}

/// `re.findall(r'^ name="(.*?)" string="(true|false)">(.*?)<$', s, re.DOTALL)`.
fn match_parameter(s: &str) -> Option<(&str, bool, &str)> {
    let rest = s.strip_prefix(" name=\"")?;
    let value_end = if rest.ends_with("<\n") {
        rest.len() - 2
    } else if rest.ends_with('<') {
        rest.len() - 1
    } else {
        return None;
    };
    let mut from = 0;
    while let Some(off) = rest[from..].find("\" string=\"") {
        let p = from + off;
        let after = &rest[p + "\" string=\"".len()..];
        for (lit, is_str) in [("true\">", true), ("false\">", false)] {
            if after.starts_with(lit) {
                let v = p + "\" string=\"".len() + lit.len();
                if v <= value_end {
                    return Some((&rest[..p], is_str, &rest[v..value_end]));
                }
            }
        }
        from = p + 1;
    }
    None
}

/// `parse_tool_calls`: from just after `"\n\n<｜DSML｜tool_calls"`.
fn parse_tool_calls(mut index: usize, text: &str) -> Result<(usize, Vec<ToolCall>), ParseError> {
    let mut calls = Vec::new();
    while index < text.len() {
        let (i, between, stop) = read_until(text, index, &[INVOKE_START, TOOL_CALLS_END]);
        index = i;
        if between != ">\n" {
            return Err(ParseError::ToolCallFormat(between.to_string()));
        }
        match stop {
            Some(1) => break,
            None => return Err(ParseError::MissingSpecialInToolCalls),
            _ => {}
        }
        let (i, name_part, mut stop) =
            read_until(text, index, &[PARAMETER_START, "</｜DSML｜invoke"]);
        index = i;
        let name = match_tool_name(name_part)
            .ok_or_else(|| ParseError::ToolNameFormat(name_part.to_string()))?;
        let mut args: Vec<(&str, bool, &str)> = Vec::new();
        while stop == Some(0) {
            let (i, param, _) = read_until(text, index, &["/｜DSML｜parameter"]);
            index = i;
            let (pname, is_str, value) = match_parameter(param)
                .ok_or_else(|| ParseError::ParameterFormat(param.to_string()))?;
            if args.iter().any(|a| a.0 == pname) {
                return Err(ParseError::DuplicateParameter(pname.to_string()));
            }
            args.push((pname, is_str, value));
            let (i, between, s) = read_until(text, index, &[PARAMETER_START, "</｜DSML｜invoke"]);
            index = i;
            stop = s;
            if between != ">\n" {
                return Err(ParseError::ParameterEnd(between.to_string()));
            }
        }
        calls.push(tool_call_from_args(name, &args));
    }
    Ok((index, calls))
}

/// `decode_dsml_to_arguments`: string values become JSON strings, others are copied
/// verbatim (even when they are not valid JSON).
fn tool_call_from_args(name: &str, args: &[(&str, bool, &str)]) -> ToolCall {
    let mut json = String::from("{");
    for (k, (key, is_str, value)) in args.iter().enumerate() {
        if k > 0 {
            json.push_str(", ");
        }
        pyjson::write_str(&mut json, key);
        json.push_str(": ");
        if *is_str {
            pyjson::write_str(&mut json, value);
        } else {
            json.push_str(value);
        }
    }
    json.push('}');
    ToolCall {
        id: None,
        kind: Some("function".to_string()),
        function: FunctionCall {
            name: name.to_string(),
            arguments: Value::String(json),
            id: None,
        },
    }
}

/// `parse_message_from_completion_text`: the text generated after the assistant prefix
/// (`<｜Assistant｜><think>` or `<｜Assistant｜></think>`) → the assistant message.
pub fn parse_completion(text: &str, mode: ThinkingMode) -> Result<ParsedMessage, ParseError> {
    let start_token = "\n\n<｜DSML｜tool_calls";
    let mut index = 0;
    let mut reasoning = "";
    if mode == ThinkingMode::Thinking {
        let (i, r, stop) = read_until(text, index, &[THINK_END, start_token]);
        if stop != Some(0) {
            return Err(ParseError::MissingThinkEnd);
        }
        index = i;
        reasoning = r;
    }
    let (i, content, stop) = read_until(text, index, &[EOS, start_token]);
    index = i;
    let mut tool_calls = Vec::new();
    if stop == Some(1) {
        let (i, calls) = parse_tool_calls(index, text)?;
        tool_calls = calls;
        // Only EOS, or nothing at all, may follow the block.
        let (i, tail, _) = read_until(text, i, &[EOS]);
        index = i;
        if !tail.is_empty() {
            return Err(ParseError::ContentAfterToolCalls);
        }
    } else if stop.is_none() {
        return Err(ParseError::MissingEos);
    }
    if index != text.len() {
        return Err(ParseError::ContentAtEnd);
    }
    for sp in [BOS, EOS, THINK_START, THINK_END, DSML] {
        if content.contains(sp) || reasoning.contains(sp) {
            return Err(ParseError::SpecialTokenInContent(sp.to_string()));
        }
    }
    Ok(ParsedMessage {
        role: "assistant".to_string(),
        content: content.to_string(),
        reasoning_content: reasoning.to_string(),
        tool_calls,
    })
}
