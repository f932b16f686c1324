//! Server-sent events: one driver turns the worker's events into an SSE body through an
//! API-specific formatter, with keepalive comments while nothing else is sent (§2.7).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::{ApiError, ApiFlavor};
use crate::http::error_response;
use crate::job::GenEvent;

/// Shapes one API's stream.
pub trait SseFormatter: Send + 'static {
    /// Frames sent right away, before the engine reports anything.
    fn open(&mut self) -> Vec<String> {
        Vec::new()
    }
    /// Frames for one worker event.
    fn event(&mut self, ev: GenEvent) -> Vec<String>;
}

/// `data: JSON\n\n`.
pub fn data(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// `event: NAME\ndata: JSON\n\n`.
pub fn named(name: &str, v: &Value) -> String {
    format!("event: {name}\ndata: {v}\n\n")
}

struct State {
    rx: UnboundedReceiver<GenEvent>,
    fmt: Box<dyn SseFormatter>,
    queue: VecDeque<String>,
    done: bool,
    keepalive: Duration,
    /// When the next keepalive is due: `keepalive` after the last frame sent. Events
    /// that send nothing (prefill progress) leave it alone, or a long prefill would
    /// keep postponing it and the client would see silence (#19 item 3).
    due: tokio::time::Instant,
}

/// The streaming response, or an error response when the job fails before the worker
/// reports anything else (a 409 for vanished live tool state, a context error after a
/// live continuation, 503 at shutdown). The status line waits for the worker's first
/// event, but at most one keepalive interval; after that the stream starts and later
/// failures arrive as SSE error events (§2.7).
pub async fn respond(
    mut rx: UnboundedReceiver<GenEvent>,
    fmt: Box<dyn SseFormatter>,
    keepalive: Duration,
    flavor: ApiFlavor,
) -> Response {
    let first = match tokio::time::timeout(keepalive, rx.recv()).await {
        Ok(Some(GenEvent::Failed { status, message })) => {
            let kind = if (400..500).contains(&status) {
                "invalid_request_error"
            } else {
                "server_error"
            };
            return error_response(&ApiError::new(status, kind, message), flavor);
        }
        Ok(Some(ev)) => Some(ev),
        Ok(None) => {
            return error_response(
                &ApiError::internal("the engine stopped before answering"),
                flavor,
            )
        }
        Err(_) => None,
    };
    response(rx, fmt, keepalive, first)
}

/// The streaming response. Dropping the body (client gone) drops the receiver, which the
/// worker notices and cancels the generation.
pub fn response(
    rx: UnboundedReceiver<GenEvent>,
    mut fmt: Box<dyn SseFormatter>,
    keepalive: Duration,
    first: Option<GenEvent>,
) -> Response {
    let mut queue: VecDeque<String> = fmt.open().into();
    let mut done = false;
    if let Some(ev) = first {
        done = matches!(ev, GenEvent::Done(_) | GenEvent::Failed { .. });
        queue.extend(fmt.event(ev));
    }
    let st = State {
        rx,
        fmt,
        queue,
        done,
        keepalive,
        due: tokio::time::Instant::now() + keepalive,
    };
    let stream = futures_util::stream::unfold(st, |mut s| async move {
        loop {
            if let Some(f) = s.queue.pop_front() {
                s.due = tokio::time::Instant::now() + s.keepalive;
                return Some((Ok::<Bytes, Infallible>(Bytes::from(f)), s));
            }
            if s.done {
                return None;
            }
            match tokio::time::timeout_at(s.due, s.rx.recv()).await {
                Err(_) => s.queue.push_back(": keepalive\n\n".to_string()),
                Ok(Some(ev)) => {
                    let terminal = matches!(ev, GenEvent::Done(_) | GenEvent::Failed { .. });
                    let frames = s.fmt.event(ev);
                    s.queue.extend(frames);
                    s.done = terminal;
                }
                Ok(None) => {
                    let frames = s.fmt.event(GenEvent::Failed {
                        status: 500,
                        message: "the engine stopped".into(),
                    });
                    s.queue.extend(frames);
                    s.done = true;
                }
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(stream));
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
