//! End-to-end tests of the `ds4` CLI (speculative decoding with `--mtp` included) and
//! `ds4-tool logits` on the tiny fixture model
//! (random weights: the text is gibberish, but greedy decoding is deterministic).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use common::{fixtures, model, read_f32, read_json, text, tmp_dir, write_file};
use ds4_engine::dev::layout::ExpertQuant;
use ds4_engine::dev::{LoadOptions, Model};
use ds4_engine::Numerics;
use ds4_synth::Plan;

const DS4: &str = env!("CARGO_BIN_EXE_ds4");
const DS4_TOOL: &str = env!("CARGO_BIN_EXE_ds4-tool");

/// `ds4 -m tiny-q2.gguf -t 1 ARGS…` with stdin closed.
fn ds4(args: &[&str]) -> Output {
    Command::new(DS4)
        .arg("-m")
        .arg(model())
        .args(["-t", "1"])
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run ds4")
}

#[test]
fn oneshot_greedy_is_deterministic() {
    let args = ["-p", "Hello, who are you?", "-n", "24", "--temp", "0"];
    let a = ds4(&args);
    assert!(a.status.success(), "{}", text(&a.stderr));
    let b = ds4(&args);
    assert!(!a.stdout.is_empty());
    assert_eq!(a.stdout, b.stdout);
    let err = text(&a.stderr);
    assert!(err.contains("ds4: prefill: "), "{err}");
    assert!(err.contains(" t/s, generation: "), "{err}");
    // Think tags are stripped in thinking mode.
    let out = text(&a.stdout);
    assert!(!out.contains("<think>") && !out.contains("</think>"));
    // --nothink changes the prompt's last token, so the greedy answer differs.
    let c = ds4(&[
        "-p",
        "Hello, who are you?",
        "-n",
        "24",
        "--temp",
        "0",
        "--nothink",
    ]);
    assert!(c.status.success());
    assert_ne!(a.stdout, c.stdout);
}

#[test]
fn sampling_is_seeded() {
    let args = ["-p", "Hi", "-n", "16", "--temp", "0.8", "--seed", "7"];
    let a = ds4(&args);
    let b = ds4(&args);
    assert!(a.status.success(), "{}", text(&a.stderr));
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn dump_tokens_uses_the_reference_format() {
    let prompt =
        "<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>Hi<｜Assistant｜></think>";
    let o = ds4(&["-p", prompt, "--dump-tokens"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let mut lines = out.lines();
    let first = lines.next().unwrap();
    assert!(first.starts_with('[') && first.ends_with(']'), "{first}");
    let ids: Vec<u32> = first[1..first.len() - 1]
        .split(", ")
        .map(|s| s.parse().unwrap())
        .collect();
    let rest: Vec<&str> = lines.collect();
    assert_eq!(rest.len(), ids.len());
    for (line, id) in rest.iter().zip(&ids) {
        assert_eq!(&line[..6], format!("{id:6}"), "{line}");
        assert_eq!(&line[6..8], "  ");
    }
    assert_eq!(rest[0], format!("{:6}  <｜begin▁of▁sentence｜>", ids[0]));
    assert!(rest.last().unwrap().ends_with("</think>"));
    assert!(rest.iter().any(|l| l.ends_with("<｜User｜>")));
}

/// Runs `ds4 <args> --dump-logprobs <f>`, which must succeed; returns the JSON it wrote.
fn dump_logprobs(args: &[&str], f: &Path) -> serde_json::Value {
    let mut all = args.to_vec();
    all.extend(["--dump-logprobs", f.to_str().unwrap()]);
    let o = ds4(&all);
    assert!(o.status.success(), "{}", text(&o.stderr));
    read_json(f)
}

#[test]
fn dump_logprobs_writes_reference_json() {
    let dir = tmp_dir("logprobs");
    let f = dir.join("lp.json");
    let v = dump_logprobs(
        &[
            "-p",
            "Hello",
            "-n",
            "5",
            "--logprobs-top-k",
            "7",
            "-c",
            "4096",
        ],
        &f,
    );
    assert_eq!(v["source"], "ds4");
    assert_eq!(v["ctx"], 4096);
    assert_eq!(v["top_k"], 7);
    assert!(v["prompt_tokens"].as_u64().unwrap() > 3);
    let steps = v["steps"].as_array().unwrap();
    assert!(!steps.is_empty() && steps.len() <= 5);
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"], i as u64);
        let sel = &s["selected"];
        let top = s["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 7);
        // Greedy: the selected token is the best alternative.
        assert_eq!(top[0]["token"]["id"], sel["id"]);
        let bytes: Vec<u8> = sel["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        if let Ok(t) = std::str::from_utf8(&bytes) {
            assert_eq!(sel["text"], t);
        }
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]), "{lps:?}");
        assert!(lps[0] <= 0.0 && lps.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-9);
        let l0 = top[0]["logit"].as_f64().unwrap();
        let l1 = top[1]["logit"].as_f64().unwrap();
        assert!(((l0 - l1) - (lps[0] - lps[1])).abs() < 1e-4);
    }
    // The system prompt is part of the rendering: disabling it shortens the prompt.
    let w = dump_logprobs(&["-p", "Hello", "-n", "1", "-sys", ""], &f);
    assert!(w["prompt_tokens"].as_u64() < v["prompt_tokens"].as_u64());
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn perplexity_file_prints_the_reference_line() {
    let dir = tmp_dir("ppl");
    let words = "The quick brown fox jumps over the lazy dog. ".repeat(20);
    let f = write_file(&dir, "text.txt", words);
    let o = ds4(&["--perplexity-file", f.to_str().unwrap(), "-n", "40"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let line = out.lines().next().unwrap();
    let fields: Vec<(&str, &str)> = line
        .split(' ')
        .map(|kv| kv.split_once('=').unwrap())
        .collect();
    let keys: Vec<&str> = fields.iter().map(|f| f.0).collect();
    assert_eq!(
        keys,
        ["tokens", "scored", "nll", "avg_nll", "ppl"],
        "{line}"
    );
    let num = |i: usize| fields[i].1.parse::<f64>().unwrap();
    assert!(num(0) > 72.0);
    assert_eq!(num(1), 40.0);
    assert!((num(2) / 40.0 - num(3)).abs() < 1e-6);
    assert!((num(3).exp() - num(4)).abs() < 1e-6 * num(4));
    // Nine decimals, as the reference prints them.
    assert_eq!(fields[2].1.split('.').nth(1).unwrap().len(), 9);
    // Too short a text is an error.
    std::fs::write(&f, "short").unwrap();
    let o = ds4(&["--perplexity-file", f.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("more than 32 tokens"));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_flags_exit_with_status_2() {
    let cases: &[&[&str]] = &[
        &["--bogus"],
        &["-p", "x", "--temp", "200"],
        &["-p", "x", "--temp", "-1"],
        &["-p", "x", "--top-p", "1.5"],
        &["-p", "x", "--min-p", "abc"],
        &["-p", "x", "-n", "0"],
        &["-p", "x", "-c", "lots"],
        &["-p", "x", "--seed", "0"],
        &["-p", "x", "--backend", "metal"],
        &["-p", "x", "--prompt-file", "y"],
        &["--dump-tokens"],
        &["--server"],
    ];
    for args in cases {
        let o = ds4(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o.stderr));
        assert!(!o.stderr.is_empty(), "{args:?}");
    }
    let o = Command::new(DS4)
        .args(["-p", "x", "-t", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(DS4).arg("--help").output().unwrap();
    assert!(o.status.success());
    let help = text(&o.stdout);
    for flag in [
        "--model",
        "--ctx",
        "--think-max",
        "--dump-logprobs",
        "--perplexity-file",
        "--quality",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
}

// #19 item 4: `-n -5` read as an unknown flag ("unexpected argument '-5'"), and a
// `--logprobs-top-k` above 128 was clamped without a word.
#[test]
fn negative_counts_and_oversized_top_k_name_the_flag_and_the_rule() {
    for (args, want) in [
        (
            &["-p", "x", "-n", "-5"][..],
            "expected a positive integer, got \"-5\"",
        ),
        (&["-p", "x", "-c", "-1"][..], "expected a positive integer"),
        (
            &["-p", "x", "--dump-logprobs", "f", "--logprobs-top-k", "500"][..],
            "500 is above the maximum 128",
        ),
    ] {
        let o = ds4(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = text(&o.stderr);
        assert!(
            err.contains(want) && !err.contains("unexpected argument"),
            "{args:?}: {err}"
        );
    }
}

// #23: the placement flags name the rule when refused, are in --help on all three
// programs, and are accepted (and unused) on the CPU backend.
#[test]
fn placement_flags_are_checked_and_documented() {
    for (args, want) in [
        (
            &["-p", "x", "--gpus", "0,0"][..],
            "--gpus names device 0 twice",
        ),
        (
            &["-p", "x", "--gpus", "first"][..],
            "device numbers like 0,1",
        ),
        (
            &["-p", "x", "--offload-experts", "some"][..],
            "takes `auto` or a number of layers",
        ),
        (
            &["-p", "x", "--device-map", "0:0-2,0:3-5"][..],
            "--device-map names GPU 0 twice",
        ),
        (
            &["-p", "x", "--device-map", "0:0-2;1:3-5"][..],
            "takes GPU:LAYERS entries like 0:0-20,1:21-42",
        ),
        (
            &["-p", "x", "--gpus", "0", "--device-map", "0:0-5"][..],
            "cannot be used with",
        ),
    ] {
        let o = ds4(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = text(&o.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
    for bin in [DS4, env!("CARGO_BIN_EXE_ds4-bench")] {
        let o = Command::new(bin).arg("--help").output().unwrap();
        let help = text(&o.stdout);
        for flag in ["--offload-experts", "--gpus", "--device-map"] {
            assert!(help.contains(flag), "{bin}: {flag} missing from --help");
        }
    }
    let o = ds4(&[
        "--cpu",
        "-p",
        "hi",
        "-n",
        "2",
        "--temp",
        "0",
        "--offload-experts",
        "3",
        "--gpus",
        "0,1",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
}

// #23: a `--device-map` is checked against the model once it is open (the tiny model
// has 6 layers), on every backend: a map that covers the layers runs (unused on the
// CPU); one that misses layers is refused, naming them and a map that fits.
#[test]
fn a_device_map_is_checked_against_the_model() {
    let run = |map: &str| {
        ds4(&[
            "--cpu",
            "-p",
            "hi",
            "-n",
            "2",
            "--temp",
            "0",
            "--device-map",
            map,
        ])
    };
    let o = run("0:0-2,1:3-5");
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = run("0:0-2");
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    for want in [
        "--device-map 0:0-2 does not cover this model's 6 layers (0–5)",
        "layers 3–5 are on no GPU",
        "A map over the same GPUs that does: --device-map 0:0-5",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    let err = text(&run("1:3-5,0:0-2").stderr);
    assert!(
        err.contains("list them in layer order (as in 0:0-2,1:3-5)"),
        "{err}"
    );
}

// #19 item 4: `--backend cuda` on a machine without a usable GPU exits 2 (a usage
// error) and says why; with a GPU the run itself must work.
#[test]
fn explicit_cuda_without_a_gpu_exits_2() {
    let o = ds4(&["--backend", "cuda", "-p", "hi", "-n", "1"]);
    if o.status.success() {
        return; // a GPU is present: nothing to refuse
    }
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("not available"),
        "{}",
        text(&o.stderr)
    );
}

// #19 item 4: a directory given as the model read "No such device" (mmap's ENODEV).
#[test]
fn a_directory_as_the_model_is_named_as_such() {
    let (_, err) = ds4_on_model(&tmp_dir("model-dir"));
    assert!(
        err.contains("is a directory") && !err.contains("No such device"),
        "{err}"
    );
    assert_eq!(err.matches("is a directory").count(), 1, "{err}");
}

/// `ds4 -m MODEL -p hi`: whether it succeeded, and its stderr.
fn ds4_on_model(model: &std::path::Path) -> (bool, String) {
    let o = Command::new(DS4)
        .arg("-m")
        .arg(model)
        .args(["-p", "hi"])
        .output()
        .unwrap();
    (o.status.success(), text(&o.stderr))
}

// #19: each cause is said once ("not a GGUF file …: not a GGUF file …" before).
#[test]
fn a_file_that_is_not_gguf_is_named_once() {
    let p = tmp_dir("not-gguf").join("x.gguf");
    std::fs::write(&p, b"hello world, no GGUF here").unwrap();
    let (ok, err) = ds4_on_model(&p);
    assert!(!ok);
    assert_eq!(err.matches("not a GGUF file").count(), 1, "{err}");
}

#[test]
fn missing_model_says_how_to_download() {
    let o = Command::new(DS4)
        .args(["-m", "/nonexistent/ds4flash.gguf", "-p", "hi"])
        .output()
        .unwrap();
    // #19 item 4: a usage error found before any loading, in clap's words.
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o.stderr);
    assert!(
        err.contains(
            "invalid value '/nonexistent/ds4flash.gguf' for '--model <FILE>': no such file"
        ),
        "{err}"
    );
    assert!(err.contains("ds4-tool download q2-imatrix"), "{err}");
}

#[test]
fn inspect_prints_a_summary() {
    let o = ds4(&["--inspect"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("layers: 6"), "{out}");
    assert!(out.contains("vocab 512"), "{out}");
}

#[test]
fn logits_tool_matches_the_fixture() {
    let manifest = read_json(&fixtures().join("manifest.json"));
    let ids = &manifest["sequences"]["a"]["tokens"];
    let dir = tmp_dir("logits");
    let ids_path = dir.join("a.json");
    std::fs::write(&ids_path, ids.to_string()).unwrap();
    let out = dir.join("a.bin");
    let o = Command::new(DS4_TOOL)
        .args(["logits", "-m"])
        .arg(model())
        .arg("--tokens")
        .arg(&ids_path)
        .arg("--out")
        .arg(&out)
        .arg("--quality")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let got = read_f32(&out);
    let want = read_f32(&fixtures().join("expected/q2/a.logits.f32"));
    assert_eq!(got.len(), ids.as_array().unwrap().len() * 512);
    assert_eq!(got.len(), want.len());
    let max = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max < 1e-3, "max abs diff {max}");
    std::fs::remove_dir_all(dir).ok();
}

/// The interactive mode in a pty: turns, commands, Ctrl+C, /quit.
mod interactive {
    use super::*;
    use rexpect::session::{spawn_command, PtySession};

    /// Starts `ds4` (with `extra` arguments) in a pty with a fresh home directory named
    /// after `tag`; waits for each of `banner`, then the first prompt.
    fn start(tag: &str, extra: &[&str], banner: &[&str]) -> (PathBuf, PtySession) {
        let home = tmp_dir(tag);
        let mut p = spawn(&home, extra);
        for b in banner {
            p.exp_string(b).unwrap();
        }
        p.exp_string("ds4> ").unwrap();
        (home, p)
    }

    fn spawn(home: &Path, extra: &[&str]) -> PtySession {
        let mut cmd = Command::new(DS4);
        cmd.arg("-m")
            .arg(model())
            .args(["-t", "1", "--temp", "0"])
            .args(extra)
            .env("HOME", home)
            .env("TERM", "dumb")
            .env("NO_COLOR", "1");
        spawn_command(cmd, Some(30_000)).expect("spawn ds4 in a pty")
    }

    /// Sends `line`, expects each of `answers` in order, then the prompt.
    fn turn(p: &mut PtySession, line: &str, answers: &[&str]) {
        p.send_line(line).unwrap();
        for a in answers {
            p.exp_string(a).unwrap();
        }
        p.exp_string("ds4> ").unwrap();
    }

    #[test]
    fn turns_and_commands() {
        let (home, mut p) = start("repl-home", &["-n", "8"], &["/quit, /exit"]);
        turn(&mut p, "Hello there", &["ds4: prefill: "]);
        turn(&mut p, "/help", &["/read FILE"]);
        turn(&mut p, "/nothink", &["thinking: off"]);
        turn(&mut p, "/think-max", &["high (ctx below 393216)"]);
        turn(&mut p, "/nothink", &[]);
        turn(&mut p, "/bogus", &["unknown command"]);
        // The second turn extends the live session: only its new tokens are prefilled.
        turn(&mut p, "And a second question", &["ds4: prefill: "]);
        p.send_line("/quit").unwrap();
        p.exp_eof().unwrap();
        let history = std::fs::read_to_string(home.join(".ds4_history")).unwrap();
        assert!(history.contains("And a second question"), "{history}");
        std::fs::remove_dir_all(home).ok();
    }

    /// `--mtp` in the chat: every turn's timing line reports the MTP cycles, and the
    /// live session goes on speculating across turns.
    #[test]
    fn turns_with_mtp_report_tokens_per_cycle() {
        let mtp = mtp_file().to_str().unwrap();
        let extra = [
            "-n",
            "8",
            "--mtp",
            mtp,
            "--mtp-draft",
            "2",
            "--mtp-margin",
            "0",
        ];
        let (home, mut p) = start("repl-mtp", &extra, &["/quit, /exit"]);
        turn(
            &mut p,
            "Hello there",
            &["ds4: prefill: ", "tokens/cycle (acceptance "],
        );
        turn(
            &mut p,
            "Again",
            &["ds4: prefill: ", "tokens/cycle (acceptance "],
        );
        p.send_line("/quit").unwrap();
        p.exp_eof().unwrap();
        std::fs::remove_dir_all(home).ok();
    }

    /// Sends `line`, waits, presses Ctrl+C; returns once an answer was cut short and
    /// kept. A Ctrl+C that lands before the first token (a slow, loaded machine) drops
    /// the turn instead, and an answer may end by itself first: both retry, with a
    /// longer wait.
    fn interrupt_answer(p: &mut PtySession, line: &str) {
        for attempt in 1..=5u64 {
            p.send_line(line).unwrap();
            std::thread::sleep(Duration::from_millis(1000 * attempt));
            p.send_control('c').unwrap();
            // Also an answer that ended by itself (EOS) before the Ctrl+C: then the
            // Ctrl+C reached the prompt, where it is ignored.
            let (_, m) = p
                .exp_regex(r"ds4: interrupted (after \d+ tokens|before the answer)|ds4: prefill: ")
                .unwrap();
            if m.contains("after") {
                // The partial answer is kept: the timing line follows.
                p.exp_string("generation: ").unwrap();
                p.exp_string("ds4> ").unwrap();
                return;
            }
            p.exp_string("ds4> ").unwrap();
        }
        panic!("Ctrl+C never landed during generation");
    }

    #[test]
    fn ctrl_c_stops_generation_and_returns_to_the_prompt() {
        let (home, mut p) = start("repl-ctrlc", &["-n", "100000"], &[]);
        // Ctrl+C at the prompt is ignored.
        p.send_control('c').unwrap();
        // The greedy tiny model never emits EOS for this prompt: a long generation.
        interrupt_answer(&mut p, "Tell me a very long story");
        // The session goes on after the partial answer.
        turn(&mut p, "/nothink", &["thinking: off"]);
        interrupt_answer(&mut p, "Shorter please");
        p.send_line("/exit").unwrap();
        p.exp_eof().unwrap();
        std::fs::remove_dir_all(home).ok();
    }
}

// `ds4 --mtp FILE --mtp-draft N --mtp-margin F` (#20): speculative decoding with a
// synthetic MTP file made for the fixture model (random weights, so drafts are rarely
// accepted; the engine's tests/spec.rs covers accepted drafts). At `--temp 0` the
// output must be exactly the plain run's, and the final line reports the MTP tokens
// per cycle.

/// The synthetic MTP file of the fixture model, written once per test process.
fn mtp_file() -> &'static PathBuf {
    static F: OnceLock<PathBuf> = OnceLock::new();
    F.get_or_init(|| {
        let main = Model::load(
            model(),
            LoadOptions {
                numerics: Numerics::Fast,
            },
        )
        .unwrap();
        let plan = Plan::mtp(main.config().clone(), ExpertQuant::Q4, "ds4 --mtp test").unwrap();
        write_file(&tmp_dir("mtp"), "tiny-mtp.gguf", plan.build(5, &|_| {}))
    })
}

/// The `mtp: X.XX tokens/cycle (acceptance Y%)` numbers of the final line.
fn mtp_line(stderr: &str) -> Option<(f64, f64)> {
    let line = stderr.lines().find(|l| l.starts_with("ds4: prefill: "))?;
    let rest = line.split_once(", mtp: ")?.1;
    let (tpc, rest) = rest.split_once(" tokens/cycle (acceptance ")?;
    let acc = rest.strip_suffix("%)")?;
    Some((tpc.parse().ok()?, acc.parse().ok()?))
}

#[test]
fn greedy_output_with_mtp_equals_the_plain_output() {
    let mtp = mtp_file().to_str().unwrap();
    let base = ["-p", "Hello, who are you?", "-n", "40", "--temp", "0"];
    let plain = ds4(&base);
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    assert!(!plain.stdout.is_empty());
    assert_eq!(mtp_line(&text(&plain.stderr)), None);
    for extra in [
        vec!["--mtp", mtp],
        vec!["--mtp", mtp, "--mtp-draft", "3", "--mtp-margin", "0"],
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.clone()).collect();
        let o = ds4(&args);
        let err = text(&o.stderr);
        assert!(o.status.success(), "{extra:?}: {err}");
        assert_eq!(text(&o.stdout), text(&plain.stdout), "{extra:?}");
        let (tpc, acc) = mtp_line(&err).unwrap_or_else(|| panic!("no mtp summary: {err}"));
        assert!((1.0..=4.0).contains(&tpc), "{extra:?}: {err}");
        assert!((0.0..=100.0).contains(&acc), "{extra:?}: {err}");
    }
}

#[test]
fn sampling_with_mtp_is_seeded() {
    let mtp = mtp_file().to_str().unwrap();
    let args = [
        "-p",
        "Hi",
        "-n",
        "12",
        "--temp",
        "0.8",
        "--seed",
        "7",
        "--mtp",
        mtp,
        "--mtp-margin",
        "0",
    ];
    let a = ds4(&args);
    assert!(a.status.success(), "{}", text(&a.stderr));
    assert!(mtp_line(&text(&a.stderr)).is_some());
    assert_eq!(a.stdout, ds4(&args).stdout);
}

#[test]
fn bad_mtp_flags_are_usage_errors() {
    let mtp = mtp_file().to_str().unwrap();
    for (args, says) in [
        (vec!["--mtp-draft", "0"], "--mtp-draft"),
        (vec!["--mtp-draft", "17"], "--mtp-draft"),
        (vec!["--mtp-margin", "-1"], "--mtp-margin"),
        (vec!["--mtp-margin", "nan"], "--mtp-margin"),
        (vec!["--mtp", "/nonexistent/mtp.gguf"], "--mtp"),
    ] {
        let mut all = vec!["-p", "Hi", "-n", "2", "--mtp", mtp];
        all.extend(args.iter().copied());
        let o = ds4(&all);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // The main model is no MTP file: refused at load with the file named.
    let main = model();
    let o = ds4(&["-p", "Hi", "-n", "2", "--mtp", main.to_str().unwrap()]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot load the MTP file"), "{err}");
}

#[test]
fn help_describes_the_mtp_flags() {
    let o = Command::new(DS4).arg("--help").output().unwrap();
    let help = text(&o.stdout);
    for flag in ["--mtp <FILE>", "--mtp-draft <N>", "--mtp-margin <F>"] {
        assert!(help.contains(flag), "{flag} in {help}");
    }
    assert!(help.contains("its --mtp-draft 2 is our 1"), "{help}");
}
