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

/// The scratch directory goes when the test ends, passed or failed.
impl Drop for Paths {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
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

/// `refused` for each line of `cases`, written `arguments | value | flag | reason` with
/// the arguments split at spaces (blank lines and `#` comments are skipped); `{missing}`,
/// `{file}`, `{out_in_missing}`, `{below_file}` and `{dir}` stand for the scratch paths of
/// `p`, `{model}` for the tiny model.
fn refused_all(bin: &str, p: &Paths, cases: &str) {
    let model = model();
    let fill = |s: &str| {
        s.replace("{missing}", &p.missing)
            .replace("{file}", &p.file)
            .replace("{out_in_missing}", &p.out_in_missing)
            .replace("{below_file}", &p.below_file)
            .replace("{dir}", p.dir.to_str().unwrap())
            .replace("{model}", model.to_str().unwrap())
    };
    let cases = cases.lines().map(str::trim);
    for case in cases.filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let fields: Vec<String> = case.split(" | ").map(fill).collect();
        let [args, value, flag, why] = &fields[..] else {
            panic!("not `arguments | value | flag | reason`: {case}");
        };
        let args: Vec<&str> = args.split(' ').collect();
        refused(bin, &args, value, flag, why);
    }
}

#[test]
fn ds4_checks_its_files_before_loading() {
    let p = paths("ds4");
    let m = model();
    let m = m.to_str().unwrap();
    refused_all(
        DS4,
        &p,
        r"
-m {missing} -p x | {missing} | --model <FILE> | no such file
-m {dir} -p x | {dir} | --model <FILE> | it is a directory
-m /dev/null -p x | /dev/null | --model <FILE> | not a regular file
-m {model} --prompt-file {missing} | {missing} | --prompt-file <FILE> | no such file
-m {model} --perplexity-file {dir} | {dir} | --perplexity-file <FILE> | it is a directory
-m {model} -p x --dump-logprobs {out_in_missing} | {out_in_missing} | --dump-logprobs <FILE> | no-such-dir does not exist
-m {model} -p x --dump-logprobs {below_file} | {below_file} | --dump-logprobs <FILE> | is not a directory
-m {model} -p x --dump-logprobs {dir} | {dir} | --dump-logprobs <FILE> | it is a directory
# The --dump-tokens mode (vocabulary only) checks the model too.
-m {missing} -p x --dump-tokens | {missing} | --model <FILE> | no such file
        ",
    );
    // A prompt file that exists is accepted (the run goes on to tokenize it).
    let o = Command::new(DS4)
        .args(["-m", m, "--prompt-file", &p.file, "--dump-tokens"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
}

#[test]
fn ds4_tool_checks_every_subcommand() {
    let p = paths("tool");
    refused_all(
        DS4_TOOL,
        &p,
        r"
inspect {missing} | {missing} | <FILE> | no such file
dump-tensor {missing} x | {missing} | <FILE> | no such file
dump-tensor {model} x --out {out_in_missing} | {out_in_missing} | --out <OUT> | does not exist
synth --dims tiny --layers 1 -o {out_in_missing} | {out_in_missing} | --out <OUT> | does not exist
synth --dims tiny --layers 1 -o {dir} | {dir} | --out <OUT> | it is a directory
synth --dims tiny --layers 1 --tokenizer {missing} --dry-run | {missing} | --tokenizer <TOKENIZER> | no such file
download mtp --dir {below_file} | {below_file} | --dir <DIR> | not a directory
download mtp --dir {file} | {file} | --dir <DIR> | not a directory
tokenize --tokenizer {missing} | {missing} | --tokenizer <TOKENIZER> | no such file
logits -m {missing} --tokens {file} --out o.bin | {missing} | --model <MODEL> | no such file
logits -m {model} --tokens {missing} --out o.bin | {missing} | --tokens <TOKENS> | no such file
logits -m {model} --tokens {file} --out {out_in_missing} | {out_in_missing} | --out <OUT> | does not exist
        ",
    );
    if cfg!(feature = "cuda") {
        refused_all(
            DS4_TOOL,
            &p,
            "gpu-selftest --fixtures {missing} | {missing} | --fixtures <FIXTURES> | no such directory",
        );
    }
    // --dry-run writes nothing, so its -o is not checked.
    common::synth(
        "tiny",
        &["--layers", "1", "-o", &p.out_in_missing, "--dry-run"],
    );
}

#[test]
fn ds4_bench_checks_its_files_before_loading() {
    let p = paths("bench");
    refused_all(
        DS4_BENCH,
        &p,
        r"
-m {missing} | {missing} | --model <MODEL> | no such file
-m {missing} | {missing} | --model <MODEL> | ds4-tool download q2-imatrix
-m {model} --prompt-file {missing} | {missing} | --prompt-file <PROMPT_FILE> | no such file
-m {model} --chat-prompt-file {missing} | {missing} | --chat-prompt-file <CHAT_PROMPT_FILE> | no such file
# Synthetic weights (minutes to build at full size) wait for the output checks.
--synthetic-weights q2 --csv {out_in_missing} | {out_in_missing} | --csv <CSV> | does not exist
--synthetic-weights q2 --plot {below_file} | {below_file} | --plot <PLOT> | not a directory
--plot-from {missing} --plot x.svg | {missing} | --plot-from <PLOT_FROM> | no such file
        ",
    );
    // The other value rules are usage errors too, before the load.
    let o = Command::new(DS4_BENCH)
        .args(["-m", &p.missing, "--step-mul", "0.5"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(text(&o.stderr).starts_with("error: --step-mul must be at least 1"));
}
