//! The web chat page at `GET /` (docs/server.md "Web chat page"): HTML, CSS and JS
//! embedded in the binary, so the page works offline and without any CDN. The page only
//! talks to this server's own API; its responses carry a Content-Security-Policy that
//! lets the browser load nothing else and connect nowhere else.
//!
//! The page is served without the API key (it holds no secret); it asks for the key when
//! the API answers 401 and sends it like any other client.

use axum::body::Body;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use axum::routing::get;
use axum::Router;

/// Only same-origin scripts, styles, images and fetches; no inline code, no frames, no
/// form posts, no `<base>` tricks.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// Every embedded file: URL path, content type, bytes.
const ASSETS: &[(&str, &str, &[u8])] = &[
    (
        "/",
        "text/html; charset=utf-8",
        include_bytes!("../web/index.html"),
    ),
    (
        "/ui/app.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../web/app.js"),
    ),
    (
        "/ui/style.css",
        "text/css; charset=utf-8",
        include_bytes!("../web/style.css"),
    ),
    (
        "/ui/icon.svg",
        "image/svg+xml",
        include_bytes!("../web/icon.svg"),
    ),
];

fn asset(content_type: &'static str, body: &'static [u8]) -> Response {
    let mut r = Response::new(Body::from(body));
    let h = r.headers_mut();
    let set = |h: &mut axum::http::HeaderMap, k, v| {
        h.insert(k, HeaderValue::from_static(v));
    };
    set(h, header::CONTENT_TYPE, content_type);
    set(h, header::CONTENT_SECURITY_POLICY, CSP);
    set(h, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(h, header::REFERRER_POLICY, "no-referrer");
    // The assets change with the binary: revalidate instead of caching a stale page.
    set(h, header::CACHE_CONTROL, "no-cache");
    r
}

/// The page's routes, to merge into the server's router (any state type).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    ASSETS
        .iter()
        .fold(Router::new(), |router, &(path, ty, body)| {
            router.route(path, get(move || async move { asset(ty, body) }))
        })
}
