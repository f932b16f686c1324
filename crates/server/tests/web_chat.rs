//! #19 item 2: the web chat page. The assets are checked over HTTP here; the page itself
//! runs in Debian's headless Chromium driven by Playwright (`tests/web/chat.test.mjs`).
//! That test is skipped with a message when Chromium, node or the pinned npm packages are
//! missing, unless DS4_REQUIRE_WEB_TEST=1 (CI), which makes their absence a failure.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{fake_server, get, record_skip, request, root};
use ds4_server::ServerConfig;

/// The page and every asset it loads: path, content type.
const ASSETS: &[(&str, &str)] = &[
    ("/", "text/html; charset=utf-8"),
    ("/ui/app.js", "text/javascript; charset=utf-8"),
    ("/ui/style.css", "text/css; charset=utf-8"),
    ("/ui/icon.svg", "image/svg+xml"),
];

#[test]
fn page_and_assets_are_served_without_the_key_with_a_strict_csp() {
    let mut cfg = ServerConfig::for_tests(4096);
    cfg.api_key = Some("sekrit".into());
    let srv = fake_server(cfg);
    for (path, ty) in ASSETS {
        let r = get(srv.addr, path);
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.header("content-type"), Some(*ty), "{path}");
        assert_eq!(
            r.header("content-security-policy"),
            Some(ds4_server::web::CSP),
            "{path}"
        );
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
        assert!(!r.body.is_empty(), "{path}");
    }
    // The page names only its own assets: nothing is loaded from another origin.
    let html = get(srv.addr, "/").text();
    for needle in ["http://", "https://", "//cdn", "<script>", "style=\""] {
        assert!(!html.contains(needle), "index.html contains {needle:?}");
    }
    // The API behind it still needs the key.
    assert_eq!(get(srv.addr, "/v1/models").status, 401);
    let auth = [("Authorization", "Bearer sekrit")];
    assert_eq!(
        request(srv.addr, "GET", "/v1/models", &auth, b"").status,
        200
    );
    // Only GET (and HEAD) serve the page: another method is 405.
    assert_eq!(request(srv.addr, "POST", "/", &[], b"{}").status, 405);
}

/// Why the browser test cannot run here, or `None` when it can.
fn missing(web: &Path, chromium: &Path) -> Option<String> {
    if !chromium.exists() {
        return Some(format!(
            "no chromium at {} (apt-get install chromium)",
            chromium.display()
        ));
    }
    if Command::new("node").arg("--version").output().is_err() {
        return Some("no node".into());
    }
    if !web.join("node_modules/playwright-core").is_dir() {
        return Some(format!(
            "no playwright-core (npm ci --prefix {})",
            web.display()
        ));
    }
    None
}

#[test]
fn chat_page_in_headless_chromium() {
    let web = root().join("crates/server/tests/web");
    let chromium =
        PathBuf::from(std::env::var("DS4_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()));
    if let Some(why) = missing(&web, &chromium) {
        assert_ne!(
            std::env::var("DS4_REQUIRE_WEB_TEST").as_deref(),
            Ok("1"),
            "DS4_REQUIRE_WEB_TEST=1 but {why}"
        );
        record_skip(&why);
        return;
    }
    let out = Command::new("node")
        .args(["--test", "chat.test.mjs"])
        .current_dir(&web)
        .env("DS4_SERVER_BIN", env!("CARGO_BIN_EXE_ds4-server"))
        .env("DS4_CHROMIUM", &chromium)
        .output()
        .expect("run node");
    // node's TAP report and the server's log, shown when the browser test fails.
    let log = [out.stdout, out.stderr].concat();
    assert!(
        out.status.success(),
        "the headless-browser test failed:\n{}",
        String::from_utf8_lossy(&log)
    );
}
