//! Error types of the crate.

use thiserror::Error;

/// Errors building a tokenizer.
#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("tokenizer.json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("tokenizer.json: {0}")]
    Format(String),
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("merge `{0}` uses a token that is not in the vocabulary")]
    MergeOutOfVocabulary(String),
    #[error("malformed merge `{0}` (expected two tokens separated by one space)")]
    BadMerge(String),
    #[error("token type list has {types} entries but there are {tokens} tokens")]
    TokenTypeCount { tokens: usize, types: usize },
    #[error("required special token `{0}` is not in the vocabulary")]
    MissingSpecial(&'static str),
}

/// Errors rendering a conversation into a prompt.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ChatError {
    #[error("Invalid message for role `{role}`: {detail}")]
    InvalidMessage { role: String, detail: String },
    #[error("Unknown role: {0}")]
    UnknownRole(String),
    #[error("Invalid task: '{0}'")]
    InvalidTask(String),
}

/// Errors of the strict completion parser. The messages are those of the reference
/// `parse_message_from_completion_text`.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum ParseError {
    #[error("Invalid thinking format: missing </think>")]
    MissingThinkEnd,
    #[error("Invalid format: missing EOS token")]
    MissingEos,
    #[error("Unexpected content after tool calls")]
    ContentAfterToolCalls,
    #[error("Unexpected content at end")]
    ContentAtEnd,
    #[error("Unexpected special token '{0}' in content")]
    SpecialTokenInContent(String),
    #[error("Tool call format error: expected '>\\n' but got '{0}'")]
    ToolCallFormat(String),
    #[error("Missing special token in tool calls")]
    MissingSpecialInToolCalls,
    #[error("Tool name format error: '{0}'")]
    ToolNameFormat(String),
    #[error("Parameter format error: '{0}'")]
    ParameterFormat(String),
    #[error("Duplicate parameter name: '{0}'")]
    DuplicateParameter(String),
    #[error("Parameter format error: expected '>\\n' but got '{0}'")]
    ParameterEnd(String),
}

impl ParseError {
    /// The Python exception type the reference parser raises for this error.
    pub fn python_type(&self) -> &'static str {
        match self {
            ParseError::MissingThinkEnd
            | ParseError::MissingEos
            | ParseError::ContentAfterToolCalls
            | ParseError::ContentAtEnd
            | ParseError::SpecialTokenInContent(_) => "AssertionError",
            _ => "ValueError",
        }
    }
}
