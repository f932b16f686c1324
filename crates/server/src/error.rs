//! Errors: library errors (`ServerError`) and HTTP API errors (`ApiError`), which carry a
//! status code and are rendered in the shape of the API the client speaks.

use ds4_engine::{EngineError, ErrorKind};
use serde_json::{json, Value};

/// Failures inside the server library (engine, cache files, startup).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// An engine failure, with its kind ([`ErrorKind`]) kept for the HTTP status.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// The server is stopping; work in progress was abandoned.
    #[error("shutdown requested")]
    Shutdown,
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Invalid(String),
}

impl ServerError {
    /// The HTTP status a request that hit this error is answered with: 503 when the
    /// device ran out of memory (the request may fit later or with a shorter prompt),
    /// 400 for input the engine refuses, 500 otherwise.
    pub fn status(&self) -> u16 {
        match self {
            ServerError::Engine(e) => match e.kind() {
                ErrorKind::OutOfMemory | ErrorKind::BackendUnavailable => 503,
                ErrorKind::ContextFull | ErrorKind::BadInput => 400,
                _ => 500,
            },
            ServerError::Shutdown => 503,
            ServerError::Io(_) | ServerError::Invalid(_) => 500,
        }
    }
}

/// Which API shape an error body takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiFlavor {
    OpenAi,
    Anthropic,
}

/// An error answered to an HTTP client.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// OpenAI `type` (`invalid_request_error`, `server_error`, …).
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    /// Extra members (context-length errors carry `n_prompt_tokens` and `n_ctx`).
    pub extra: Vec<(&'static str, Value)>,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            extra: Vec::new(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "invalid_request_error", message)
    }

    pub fn invalid_json() -> ApiError {
        ApiError::bad_request("invalid JSON request")
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(404, "not_found_error", message)
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(503, "overloaded_error", message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(500, "server_error", message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(401, "authentication_error", "invalid or missing API key")
    }

    pub fn context_exceeded(n_prompt: usize, n_ctx: usize, param: &'static str) -> ApiError {
        ApiError {
            status: 400,
            message: format!(
                "Prompt has {n_prompt} tokens, but the configured context size is {n_ctx} tokens"
            ),
            kind: "invalid_request_error",
            param: Some(param),
            code: Some("context_length_exceeded"),
            extra: vec![
                ("n_prompt_tokens", json!(n_prompt)),
                ("n_ctx", json!(n_ctx)),
            ],
        }
    }

    /// The JSON body in the given API's shape.
    pub fn body(&self, flavor: ApiFlavor) -> Value {
        match flavor {
            ApiFlavor::OpenAi => {
                let mut e = serde_json::Map::new();
                e.insert("message".into(), json!(self.message));
                e.insert("type".into(), json!(self.kind));
                if let Some(p) = self.param {
                    e.insert("param".into(), json!(p));
                }
                if let Some(c) = self.code {
                    e.insert("code".into(), json!(c));
                }
                for (k, v) in &self.extra {
                    e.insert((*k).into(), v.clone());
                }
                json!({ "error": e })
            }
            ApiFlavor::Anthropic => {
                // Anthropic's error types; ours map onto the closest one.
                let kind = match self.status {
                    400 => "invalid_request_error",
                    401 => "authentication_error",
                    403 => "permission_error",
                    404 => "not_found_error",
                    405 | 415 => "invalid_request_error",
                    409 => "invalid_request_error",
                    413 => "request_too_large",
                    503 => "overloaded_error",
                    _ => "api_error",
                };
                let mut e = serde_json::Map::new();
                e.insert("type".into(), json!(kind));
                e.insert("message".into(), json!(self.message));
                for (k, v) in &self.extra {
                    e.insert((*k).into(), v.clone());
                }
                json!({ "type": "error", "error": e })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_keep_their_kind_in_the_status() {
        let full = ServerError::from(EngineError::ContextFull {
            ctx: 8,
            have: 8,
            adding: 1,
        });
        assert_eq!(full.status(), 400);
        let oom = ServerError::from(EngineError::OutOfMemory {
            backend: "cuda",
            source: "cuMemAlloc failed".into(),
        });
        assert_eq!(oom.status(), 503);
        assert!(
            oom.to_string().contains("out of cuda device memory"),
            "{oom}"
        );
        let bad = ServerError::from(EngineError::Payload("magic".into()));
        assert_eq!(bad.status(), 500);
    }
}
