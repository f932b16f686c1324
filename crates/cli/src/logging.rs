//! The `tracing` subscriber of the `ds4`, `ds4-tool` and `ds4-bench` programs. Library
//! code only emits events; a binary calls [`init`] once to decide where they go.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Logs to stderr: the filter of `RUST_LOG` when it is set (e.g. `RUST_LOG=ds4_engine=debug`),
/// else `warn`, `info` with one `-v`, `debug` with `-vv` or more. Also ends the program
/// quietly on a closed stdout (see [`quiet_broken_pipe`]); every binary calls this first.
pub fn init(verbosity: u8) {
    quiet_broken_pipe();
    let default = match verbosity {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        // Command-line runs are short: a timestamp adds noise; the module that logged
        // helps only when debugging.
        .without_time()
        .with_target(verbosity >= 2)
        .init();
}

/// #19 item 4: Rust ignores SIGPIPE, so `ds4-tool inspect | head` made `println!` panic
/// once `head` exited. Restoring the default action ends the process silently, as
/// `cat` or `grep` do, with the usual 128+SIGPIPE status.
fn quiet_broken_pipe() {
    #[cfg(unix)]
    // SAFETY: called once at start-up before any thread exists; SIG_DFL is a valid action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
