//! `ds4 --mtp FILE --mtp-draft N --mtp-margin F` (#20): speculative decoding on the
//! tiny fixture model with a synthetic MTP file made for it (random weights, so drafts
//! are rarely accepted; the engine's tests/spec.rs covers accepted drafts). At
//! `--temp 0` the output must be exactly the plain run's, and the final line reports
//! the MTP tokens per cycle.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

use common::{model, text, tmp_dir, write_file};
use ds4_engine::dev::layout::ExpertQuant;
use ds4_engine::dev::{LoadOptions, Model};
use ds4_engine::Numerics;
use ds4_synth::Plan;

const DS4: &str = env!("CARGO_BIN_EXE_ds4");

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
