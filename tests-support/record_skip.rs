//! Shared by test crates through `#[path]` (#19 item 1): a skipped test leaves a
//! "skipped: …" line under target/test-skips/ for `./test` to list, because cargo hides
//! the output of a test that returns early and counts it as passed.

/// Records that this test binary skipped its check, and why.
pub fn record_skip(reason: &str) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("../test-skips");
    let line = format!("skipped: {} ({reason})\n", env!("CARGO_CRATE_NAME"));
    eprintln!("{line}");
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join(concat!(env!("CARGO_CRATE_NAME"), ".txt")), line);
    }
}
