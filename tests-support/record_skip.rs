//! Shared by test crates through `#[path]` (#19 item 1): a skipped test leaves a
//! "skipped: …" line for `./test` to list, because cargo hides the output of a test that
//! returns early and counts it as passed. The lines go to `$DS4_TEST_SKIPS/<crate>.txt`
//! (set by `./test`), else under target/test-skips/.

/// Records that a test of this test binary skipped its check, and why.
#[allow(dead_code)]
pub fn record_skip(reason: &str) {
    let dir = std::env::var_os("DS4_TEST_SKIPS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("../test-skips"));
    let line = format!("skipped: {} ({reason})\n", env!("CARGO_CRATE_NAME"));
    eprint!("{line}");
    if std::fs::create_dir_all(&dir).is_ok() {
        use std::io::Write;
        let file = dir.join(concat!(env!("CARGO_CRATE_NAME"), ".txt"));
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}
