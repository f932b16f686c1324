//! The HTTP layer: routes, API-key check, CORS, body limits, and the glue between the
//! API modules, the worker queue and SSE.

use std::future::Future;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

use crate::api::{self, anthropic, openai, responses, Prepared};
use crate::error::{ApiError, ApiFlavor};
use crate::job::GenResult;
use crate::sse;
use crate::worker::Shared;

pub const MODEL_ID: &str = "deepseek-v4-flash";

pub type App = Arc<Shared>;

pub fn json_response(status: u16, v: &Value, newline: bool) -> Response {
    let mut body = v.to_string();
    if newline {
        body.push('\n');
    }
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

pub fn error_response(e: &ApiError, flavor: ApiFlavor) -> Response {
    json_response(e.status, &e.body(flavor), true)
}

fn model_json(shared: &Shared) -> Value {
    let ctx = shared.cfg.ctx;
    json!({
        "id": MODEL_ID, "object": "model", "created": 1767225600u64, "owned_by": "ds4",
        "name": "DeepSeek V4 Flash", "context_length": ctx,
        "top_provider": {"context_length": ctx, "max_completion_tokens": shared.cfg.max_tokens.min(ctx), "is_moderated": false},
        "supported_parameters": ["tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed", "stream", "reasoning_effort"],
    })
}

async fn models(State(app): State<App>) -> Response {
    json_response(
        200,
        &json!({"object": "list", "data": [model_json(&app)]}),
        true,
    )
}

async fn model(State(app): State<App>, Path(id): Path<String>) -> Response {
    // Aliases resolve to the one model (they only pick the thinking default).
    if id == MODEL_ID || id == "deepseek-chat" || id == "deepseek-reasoner" {
        let mut m = model_json(&app);
        m["id"] = json!(id);
        json_response(200, &m, true)
    } else {
        error_response(
            &ApiError::not_found(format!("model {id} not found")),
            ApiFlavor::OpenAi,
        )
    }
}

async fn health(State(app): State<App>) -> Response {
    let status = if app.is_shutting_down() {
        "shutting_down"
    } else {
        "ok"
    };
    json_response(
        200,
        &json!({"status": status, "model": MODEL_ID, "ctx": app.cfg.ctx}),
        true,
    )
}

async fn metrics(State(app): State<App>) -> Response {
    let mut r = Response::new(Body::from(app.metrics.render()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    r
}

/// Reads the body under the size limit.
async fn read_body(app: &Shared, req: Request) -> Result<bytes::Bytes, ApiError> {
    let limit = app.cfg.max_body_bytes;
    axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|_| {
            ApiError::new(
                413,
                "invalid_request_error",
                format!("request body larger than {limit} bytes"),
            )
        })
}

/// Parses and renders off the async threads (tokenizing a large prompt is CPU work).
async fn blocking<T: Send + 'static>(
    app: &App,
    body: bytes::Bytes,
    f: impl FnOnce(&Shared, &[u8]) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let app = app.clone();
    tokio::task::spawn_blocking(move || f(&app, &body))
        .await
        .map_err(|_| ApiError::internal("request handler failed"))?
}

async fn run<F, Fut>(app: App, req: Request, flavor: ApiFlavor, endpoint: &str, f: F) -> Response
where
    F: FnOnce(App, bytes::Bytes) -> Fut,
    Fut: Future<Output = Result<Response, ApiError>>,
{
    app.metrics.endpoint(endpoint);
    let body = match read_body(&app, req).await {
        Ok(b) => b,
        Err(e) => return error_response(&e, flavor),
    };
    match f(app, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e, flavor),
    }
}

/// The rest of a generation endpoint once its request is parsed: queue the job, then
/// stream it with the formatter `stream` makes, or wait for the whole answer and render
/// it with `body` (`newline` as in [`json_response`]). `ids` go to whichever runs.
async fn generate<I>(
    app: &App,
    p: &Prepared,
    flavor: ApiFlavor,
    ids: I,
    stream: impl FnOnce(I) -> Box<dyn sse::SseFormatter>,
    body: impl FnOnce(&I, &GenResult) -> Value,
    newline: bool,
) -> Result<Response, ApiError> {
    let rx = api::submit(app, p)?;
    if p.stream {
        return Ok(sse::respond(rx, stream(ids), app.cfg.keepalive, flavor).await);
    }
    let r = api::collect(rx).await?;
    Ok(json_response(200, &body(&ids, &r), newline))
}

/// `/v1/chat/completions` and `/v1/completions`: ids `{prefix}-N`, the stream head
/// wrapped by `stream`, the whole answer rendered by `body`.
async fn openai_endpoint(
    app: App,
    req: Request,
    endpoint: &'static str,
    prepare: fn(&Shared, &[u8]) -> Result<Prepared, ApiError>,
    prefix: &'static str,
    stream: fn(openai::StreamHead) -> Box<dyn sse::SseFormatter>,
    body: fn(&str, &str, &GenResult) -> Value,
) -> Response {
    let flavor = ApiFlavor::OpenAi;
    run(app, req, flavor, endpoint, |app, b| async move {
        let p = blocking(&app, b, prepare).await?;
        let id = format!("{prefix}-{}", app.next_id());
        let stream = |id| stream(openai::StreamHead::new(id, &p));
        let body = |id: &String, r: &GenResult| body(id, &p.model, r);
        generate(&app, &p, flavor, id, stream, body, true).await
    })
    .await
}

async fn chat(State(app): State<App>, req: Request) -> Response {
    let stream = |h| -> Box<dyn sse::SseFormatter> { Box::new(openai::ChatStream(h)) };
    let (prepare, body) = (openai::prepare_chat, openai::chat_body);
    openai_endpoint(app, req, "chat", prepare, "chatcmpl", stream, body).await
}

async fn completions(State(app): State<App>, req: Request) -> Response {
    let stream = |h| -> Box<dyn sse::SseFormatter> { Box::new(openai::CompletionStream(h)) };
    let (prepare, body) = (openai::prepare_completion, openai::completion_body);
    openai_endpoint(app, req, "completions", prepare, "cmpl", stream, body).await
}

async fn responses_handler(State(app): State<App>, req: Request) -> Response {
    let flavor = ApiFlavor::OpenAi;
    run(app, req, flavor, "responses", |app, body| async move {
        let (p, extra) = blocking(&app, body, responses::prepare).await?;
        let stream = |(ids, extra)| -> Box<dyn sse::SseFormatter> {
            Box::new(responses::ResponseStream::new(ids, p.model.clone(), extra))
        };
        let body = |(ids, extra): &(responses::Ids, _), r: &GenResult| {
            responses::response_body(ids, &p.model, extra, r)
        };
        let ids = (responses::Ids::new(), extra);
        generate(&app, &p, flavor, ids, stream, body, false).await
    })
    .await
}

async fn messages(State(app): State<App>, req: Request) -> Response {
    let flavor = ApiFlavor::Anthropic;
    run(app, req, flavor, "messages", |app, body| async move {
        let p = blocking(&app, body, anthropic::prepare).await?;
        let id = crate::gen::random_hex("msg_", 12);
        let stream = |id| -> Box<dyn sse::SseFormatter> {
            Box::new(anthropic::MessageStream::new(id, p.model.clone()))
        };
        let body = |id: &String, r: &GenResult| anthropic::message_body(id, &p.model, r);
        generate(&app, &p, flavor, id, stream, body, true).await
    })
    .await
}

async fn count_tokens(State(app): State<App>, req: Request) -> Response {
    run(
        app,
        req,
        ApiFlavor::Anthropic,
        "count_tokens",
        |app, body| async move {
            let v = blocking(&app, body, anthropic::count_tokens).await?;
            Ok(json_response(200, &v, true))
        },
    )
    .await
}

async fn not_found(req: Request) -> Response {
    let flavor = if req.uri().path().starts_with("/v1/messages") {
        ApiFlavor::Anthropic
    } else {
        ApiFlavor::OpenAi
    };
    error_response(&ApiError::not_found("unknown endpoint"), flavor)
}

fn key_ok(headers: &HeaderMap, key: &str) -> bool {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or(v.strip_prefix("bearer ")))
        .map(str::trim);
    let xkey = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    // Constant-time comparison: the key is a secret.
    let eq = |a: &str| {
        a.len() == key.len()
            && a.bytes()
                .zip(key.bytes())
                .fold(0u8, |acc, (x, y)| acc | (x ^ y))
                == 0
    };
    bearer.is_some_and(eq) || xkey.is_some_and(eq)
}

/// OPTIONS → 204, the API key on /v1/*, CORS headers on every response.
async fn edge(State(app): State<App>, req: Request, next: Next) -> Response {
    let mut resp = if req.method() == Method::OPTIONS {
        let mut r = Response::new(Body::empty());
        *r.status_mut() = StatusCode::NO_CONTENT;
        r
    } else if let (Some(key), true) = (&app.cfg.api_key, req.uri().path().starts_with("/v1/")) {
        if key_ok(req.headers(), key) {
            next.run(req).await
        } else {
            let flavor = if req.uri().path().starts_with("/v1/messages") {
                ApiFlavor::Anthropic
            } else {
                ApiFlavor::OpenAi
            };
            error_response(&ApiError::unauthorized(), flavor)
        }
    } else {
        next.run(req).await
    };
    if app.cfg.cors {
        let h = resp.headers_mut();
        h.insert("access-control-allow-origin", HeaderValue::from_static("*"));
        h.insert(
            "access-control-allow-methods",
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            "access-control-allow-headers",
            HeaderValue::from_static("*"),
        );
    }
    resp.into_response()
}

pub fn router(app: App) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses_handler))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(crate::web::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .layer(middleware::from_fn_with_state(app.clone(), edge))
        .with_state(app)
}
