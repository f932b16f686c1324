//! #19 item 4: every path flag of `ds4`, `ds4-tool` (each subcommand) and `ds4-bench`
//! is checked at start-up, before a model loads or anything is generated: input files
//! exist, output paths have an existing writable directory. The errors use clap's words
//! (`error: invalid value 'X' for '--flag <V>': why`) and exit with status 2, at once.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{model, text, tmp_dir, write_file};

const DS4: &str = env!("CARGO_BIN_EXE_ds4");
const DS4_TOOL: &str = env!("CARGO_BIN_EXE_ds4-tool");
const DS4_BENCH: &str = env!("CARGO_BIN_EXE_ds4-bench");

/// Scratch paths of one test: an existing file, a missing file, an output below a
/// missing directory, a path below a file.
struct Paths {
    dir: PathBuf,
    file: String,
    missing: String,
    out_in_missing: String,
    below_file: String,
}

fn paths(tag: &str) -> Paths {
    let dir = tmp_dir(tag);
    let file = write_file(&dir, "file.txt", "hello world");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    Paths {
        missing: s(&dir.join("missing.txt")),
        out_in_missing: s(&dir.join("no-such-dir/out.bin")),
        below_file: s(&file.join("out.bin")),
        file: s(&file),
        dir,
    }
}

/// Runs `bin args`, which must fail at once with status 2 and a clap-style error about
/// `value` for `flag` that contains `why`.
fn refused(bin: &str, args: &[&str], value: &str, flag: &str, why: &str) {
    let t0 = Instant::now();
    let o = Command::new(bin)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    let want = format!("error: invalid value '{value}' for '{flag}': ");
    assert!(
        err.starts_with(&want),
        "{args:?}: want {want:?} at the start of:\n{err}"
    );
    assert!(err.contains(why), "{args:?}: want {why:?} in:\n{err}");
    assert!(err.contains("Usage: "), "{args:?}: {err}");
    // Before the load: nothing on stdout, and fast even on a busy machine.
    assert!(o.stdout.is_empty(), "{args:?}: {}", text(&o.stdout));
    assert!(t0.elapsed() < Duration::from_secs(20), "{args:?}");
}

#[test]
fn ds4_checks_its_files_before_loading() {
    let p = paths("ds4");
    let m = model();
    let m = m.to_str().unwrap();
    let dir = p.dir.to_str().unwrap();
    refused(
        DS4,
        &["-m", &p.missing, "-p", "x"],
        &p.missing,
        "--model <FILE>",
        "no such file",
    );
    refused(
        DS4,
        &["-m", dir, "-p", "x"],
        dir,
        "--model <FILE>",
        "it is a directory",
    );
    refused(
        DS4,
        &["-m", "/dev/null", "-p", "x"],
        "/dev/null",
        "--model <FILE>",
        "not a regular file",
    );
    refused(
        DS4,
        &["-m", m, "--prompt-file", &p.missing],
        &p.missing,
        "--prompt-file <FILE>",
        "no such file",
    );
    refused(
        DS4,
        &["-m", m, "--perplexity-file", dir],
        dir,
        "--perplexity-file <FILE>",
        "it is a directory",
    );
    refused(
        DS4,
        &["-m", m, "-p", "x", "--dump-logprobs", &p.out_in_missing],
        &p.out_in_missing,
        "--dump-logprobs <FILE>",
        "no-such-dir does not exist",
    );
    refused(
        DS4,
        &["-m", m, "-p", "x", "--dump-logprobs", &p.below_file],
        &p.below_file,
        "--dump-logprobs <FILE>",
        "is not a directory",
    );
    refused(
        DS4,
        &["-m", m, "-p", "x", "--dump-logprobs", dir],
        dir,
        "--dump-logprobs <FILE>",
        "it is a directory",
    );
    // The --dump-tokens mode (vocabulary only) checks the model too.
    refused(
        DS4,
        &["-m", &p.missing, "-p", "x", "--dump-tokens"],
        &p.missing,
        "--model <FILE>",
        "no such file",
    );
    // A prompt file that exists is accepted (the run goes on to tokenize it).
    let o = Command::new(DS4)
        .args(["-m", m, "--prompt-file", &p.file, "--dump-tokens"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    std::fs::remove_dir_all(&p.dir).ok();
}

#[test]
fn ds4_tool_checks_every_subcommand() {
    let p = paths("tool");
    let m = model();
    let m = m.to_str().unwrap();
    let dir = p.dir.to_str().unwrap();
    let t = DS4_TOOL;
    refused(
        t,
        &["inspect", &p.missing],
        &p.missing,
        "<FILE>",
        "no such file",
    );
    refused(
        t,
        &["dump-tensor", &p.missing, "x"],
        &p.missing,
        "<FILE>",
        "no such file",
    );
    refused(
        t,
        &["dump-tensor", m, "x", "--out", &p.out_in_missing],
        &p.out_in_missing,
        "--out <OUT>",
        "does not exist",
    );
    refused(
        t,
        &[
            "synth",
            "--dims",
            "tiny",
            "--layers",
            "1",
            "-o",
            &p.out_in_missing,
        ],
        &p.out_in_missing,
        "--out <OUT>",
        "does not exist",
    );
    refused(
        t,
        &["synth", "--dims", "tiny", "--layers", "1", "-o", dir],
        dir,
        "--out <OUT>",
        "it is a directory",
    );
    refused(
        t,
        &[
            "synth",
            "--dims",
            "tiny",
            "--layers",
            "1",
            "--tokenizer",
            &p.missing,
            "--dry-run",
        ],
        &p.missing,
        "--tokenizer <TOKENIZER>",
        "no such file",
    );
    refused(
        t,
        &["download", "mtp", "--dir", &p.below_file],
        &p.below_file,
        "--dir <DIR>",
        "not a directory",
    );
    refused(
        t,
        &["download", "mtp", "--dir", &p.file],
        &p.file,
        "--dir <DIR>",
        "not a directory",
    );
    refused(
        t,
        &["tokenize", "--tokenizer", &p.missing],
        &p.missing,
        "--tokenizer <TOKENIZER>",
        "no such file",
    );
    refused(
        t,
        &[
            "logits", "-m", &p.missing, "--tokens", &p.file, "--out", "o.bin",
        ],
        &p.missing,
        "--model <MODEL>",
        "no such file",
    );
    refused(
        t,
        &["logits", "-m", m, "--tokens", &p.missing, "--out", "o.bin"],
        &p.missing,
        "--tokens <TOKENS>",
        "no such file",
    );
    refused(
        t,
        &[
            "logits",
            "-m",
            m,
            "--tokens",
            &p.file,
            "--out",
            &p.out_in_missing,
        ],
        &p.out_in_missing,
        "--out <OUT>",
        "does not exist",
    );
    if cfg!(feature = "cuda") {
        refused(
            t,
            &["gpu-selftest", "--fixtures", &p.missing],
            &p.missing,
            "--fixtures <FIXTURES>",
            "no such directory",
        );
    }
    // --dry-run writes nothing, so its -o is not checked.
    let (ok, err) = {
        let o = Command::new(t)
            .args([
                "synth",
                "--dims",
                "tiny",
                "--layers",
                "1",
                "-o",
                &p.out_in_missing,
                "--dry-run",
            ])
            .output()
            .unwrap();
        (o.status.success(), text(&o.stderr))
    };
    assert!(ok, "{err}");
    std::fs::remove_dir_all(&p.dir).ok();
}

#[test]
fn ds4_bench_checks_its_files_before_loading() {
    let p = paths("bench");
    let m = model();
    let m = m.to_str().unwrap();
    let b = DS4_BENCH;
    refused(
        b,
        &["-m", &p.missing],
        &p.missing,
        "--model <MODEL>",
        "no such file",
    );
    refused(
        b,
        &["-m", &p.missing],
        &p.missing,
        "--model <MODEL>",
        "ds4-tool download q2-imatrix",
    );
    refused(
        b,
        &["-m", m, "--prompt-file", &p.missing],
        &p.missing,
        "--prompt-file <PROMPT_FILE>",
        "no such file",
    );
    refused(
        b,
        &["-m", m, "--chat-prompt-file", &p.missing],
        &p.missing,
        "--chat-prompt-file <CHAT_PROMPT_FILE>",
        "no such file",
    );
    // Synthetic weights (minutes to build at full size) wait for the output checks.
    refused(
        b,
        &["--synthetic-weights", "q2", "--csv", &p.out_in_missing],
        &p.out_in_missing,
        "--csv <CSV>",
        "does not exist",
    );
    refused(
        b,
        &["--synthetic-weights", "q2", "--plot", &p.below_file],
        &p.below_file,
        "--plot <PLOT>",
        "not a directory",
    );
    refused(
        b,
        &["--plot-from", &p.missing, "--plot", "x.svg"],
        &p.missing,
        "--plot-from <PLOT_FROM>",
        "no such file",
    );
    // The other value rules are usage errors too, before the load.
    let o = Command::new(b)
        .args(["-m", &p.missing, "--step-mul", "0.5"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).starts_with("error: --step-mul must be at least 1"));
    std::fs::remove_dir_all(&p.dir).ok();
}
