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

/// The answer to every request while the model loads (#19 item 3): `/health` says
/// `loading` with the phase and its progress, the rest get 503 in their API's shape.
pub fn loading_response(path: &str, phase: &str, progress: f64) -> Response {
    if path == "/health" {
        let p = (progress * 1000.0).round() / 1000.0;
        return json_response(
            503,
            &json!({"status": "loading", "phase": phase, "progress": p, "model": MODEL_ID}),
            true,
        );
    }
    let flavor = if path.starts_with("/v1/messages") {
        ApiFlavor::Anthropic
    } else {
        ApiFlavor::OpenAi
    };
    let e = ApiError::unavailable(format!("the model is loading ({phase})"));
    error_response(&e, flavor)
}

async fn metrics(State(app): State<App>) -> Response {
    let mut r = Response::new(Body::from(app.metrics.render()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    r
}

/// The memory budget of request bodies not yet queued (#18 item 7): one permit per KiB
/// received, held until the body is parsed and rendered. Without it, 8 concurrent 63 MB
/// bodies took 2.3 GB before the queue limit could say no.
pub struct BodyBudget {
    permits: Arc<tokio::sync::Semaphore>,
    kib: usize,
}

impl BodyBudget {
    pub fn new(bytes: usize) -> BodyBudget {
        let kib = bytes
            .div_ceil(1024)
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        BodyBudget {
            permits: Arc::new(tokio::sync::Semaphore::new(kib)),
            kib,
        }
    }
}

/// A request body and its share of the [`BodyBudget`], given back when dropped.
pub struct ReqBody {
    bytes: bytes::Bytes,
    _share: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Reads the body under the size limit, taking its share of the in-flight budget as it
/// arrives: 413 past `--max-body-mb`, 503 when the budget is spent by other requests.
async fn read_body(app: &Shared, budget: &BodyBudget, req: Request) -> Result<ReqBody, ApiError> {
    use futures_util::StreamExt;
    let limit = app.cfg.max_body_bytes;
    let too_large = || {
        ApiError::new(
            413,
            "invalid_request_error",
            format!("request body larger than {limit} bytes"),
        )
    };
    let mut stream = req.into_body().into_data_stream();
    let mut buf = bytes::BytesMut::new();
    let mut share: Option<tokio::sync::OwnedSemaphorePermit> = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(too_large());
        }
        buf.extend_from_slice(&chunk);
        let held = share.as_ref().map_or(0, |p| p.num_permits());
        let need = buf.len().div_ceil(1024);
        if need > budget.kib {
            return Err(too_large());
        }
        if need > held {
            let more = u32::try_from(need - held).map_err(|_| too_large())?;
            let p = budget
                .permits
                .clone()
                .try_acquire_many_owned(more)
                .map_err(|_| {
                    ApiError::unavailable(
                        "server busy: too many large request bodies in flight; retry later",
                    )
                })?;
            match &mut share {
                Some(s) => s.merge(p),
                None => share = Some(p),
            }
        }
    }
    Ok(ReqBody {
        bytes: buf.freeze(),
        _share: share,
    })
}

/// Parses and renders off the async threads (tokenizing a large prompt is CPU work);
/// the body's budget share is given back when this is done.
async fn blocking<T: Send + 'static>(
    app: &App,
    body: ReqBody,
    f: impl FnOnce(&Shared, &[u8]) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let app = app.clone();
    tokio::task::spawn_blocking(move || f(&app, &body.bytes))
        .await
        .map_err(|_| ApiError::internal("request handler failed"))?
}

async fn run<F, Fut>(app: App, req: Request, flavor: ApiFlavor, endpoint: &str, f: F) -> Response
where
    F: FnOnce(App, ReqBody) -> Fut,
    Fut: Future<Output = Result<Response, ApiError>>,
{
    app.metrics.endpoint(endpoint);
    let Some(budget) = req.extensions().get::<Arc<BodyBudget>>().cloned() else {
        return error_response(&ApiError::internal("no request body budget"), flavor);
    };
    let body = match read_body(&app, &budget, req).await {
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
    error_response(
        &ApiError::not_found("unknown endpoint"),
        flavor_of(req.uri().path()),
    )
}

/// A known path asked with a method it does not take: 405 with `Allow` (#18 item 12;
/// it used to be a 404, which sends clients looking for a wrong URL).
async fn method_not_allowed(req: Request) -> Response {
    let path = req.uri().path();
    let allow = if POST_PATHS.contains(&path) {
        "POST, OPTIONS"
    } else {
        "GET, OPTIONS"
    };
    let e = ApiError::new(
        405,
        "invalid_request_error",
        format!("method {} not allowed on {path}; use {allow}", req.method()),
    );
    let mut r = error_response(&e, flavor_of(path));
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// The endpoints that take a JSON body by POST.
const POST_PATHS: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
];

/// Anthropic paths answer errors in Anthropic's shape, the rest in OpenAI's.
fn flavor_of(path: &str) -> ApiFlavor {
    if path.starts_with("/v1/messages") {
        ApiFlavor::Anthropic
    } else {
        ApiFlavor::OpenAi
    }
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

/// The host part of a Host header or an origin's authority (`[::1]:8000` → `::1`),
/// lowercased and without a trailing dot.
fn host_name(authority: &str) -> String {
    let name = match authority.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => authority.split(':').next().unwrap_or(""),
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn is_localhost(name: &str) -> bool {
    name == "localhost" || name.ends_with(".localhost")
}

fn listed(list: &[String], value: &str) -> bool {
    list.iter()
        .any(|h| h == "*" || h.trim_end_matches('/').eq_ignore_ascii_case(value))
}

/// Without an API key the server trusts whoever can reach it, so it must make sure the
/// request is not a browser's doing on behalf of another site (#18 item 9):
/// - Host must be an IP address, a localhost name or listed (`--host`, `--allow-host`):
///   DNS rebinding makes a browser send `Host: attacker.example` to 127.0.0.1.
/// - A state-changing request with an `Origin` must come from a localhost page or a
///   listed origin (`--allow-origin`): cross-site form or fetch POSTs.
///
/// SDK clients and curl send neither a foreign Host nor an Origin. `/health` stays open
/// to probes under any name.
fn browser_check(cfg: &crate::config::ServerConfig, req: &Request) -> Result<(), ApiError> {
    let forbidden = |m: String| ApiError::new(403, "permission_error", m);
    let h = req.headers();
    if req.uri().path() != "/health" {
        if let Some(host) = h.get(header::HOST) {
            let name = host_name(host.to_str().unwrap_or(""));
            let ok = name.parse::<std::net::IpAddr>().is_ok()
                || is_localhost(&name)
                || listed(&cfg.allowed_hosts, &name);
            if !ok {
                return Err(forbidden(format!(
                    "Host {name:?} is not allowed; start ds4-server with --allow-host {name} or --api-key"
                )));
            }
        }
    }
    let safe = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if let (false, Some(origin)) = (safe, h.get(header::ORIGIN)) {
        let origin = origin.to_str().unwrap_or("null");
        let name = origin.split_once("://").map_or("", |(_, a)| a);
        let name = host_name(name);
        let loopback = name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
        if !(loopback || is_localhost(&name) || listed(&cfg.allowed_origins, origin)) {
            return Err(forbidden(format!(
                "cross-site request from origin {origin:?} refused; start ds4-server with --allow-origin {origin} or --api-key"
            )));
        }
    }
    Ok(())
}

/// The generation endpoints read JSON only (#18 item 9): `text/plain` and form types are
/// what a cross-site page can POST without a CORS preflight. No Content-Type is fine,
/// and so is curl's default `application/x-www-form-urlencoded` (`curl -d`) as long as
/// no browser `Origin` comes with it.
fn content_type_check(req: &Request) -> Result<(), ApiError> {
    if req.method() != Method::POST || !POST_PATHS.contains(&req.uri().path()) {
        return Ok(());
    }
    let Some(ct) = req.headers().get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let ct = ct.to_str().unwrap_or("");
    let media = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let curl =
        media == "application/x-www-form-urlencoded" && !req.headers().contains_key(header::ORIGIN);
    if media == "application/json" || media.ends_with("+json") || curl {
        return Ok(());
    }
    Err(ApiError::new(
        415,
        "invalid_request_error",
        format!("Content-Type {ct:?} is not supported; send application/json"),
    ))
}

/// OPTIONS → 204, the API key on /v1/* (or, without one, the browser checks), the
/// content type of JSON endpoints, CORS headers on every response.
async fn edge(State(app): State<App>, req: Request, next: Next) -> Response {
    let guard = match &app.cfg.api_key {
        Some(_) => Ok(()),
        None => browser_check(&app.cfg, &req),
    }
    .and_then(|()| content_type_check(&req));
    let mut resp = if let Err(e) = guard {
        error_response(&e, flavor_of(req.uri().path()))
    } else if req.method() == Method::OPTIONS {
        let mut r = Response::new(Body::empty());
        *r.status_mut() = StatusCode::NO_CONTENT;
        r
    } else if let (Some(key), true) = (&app.cfg.api_key, req.uri().path().starts_with("/v1/")) {
        if key_ok(req.headers(), key) {
            next.run(req).await
        } else {
            error_response(&ApiError::unauthorized(), flavor_of(req.uri().path()))
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
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), edge))
        .layer(axum::Extension(Arc::new(BodyBudget::new(
            app.cfg.max_inflight_body_bytes,
        ))))
        .with_state(app)
}
