//! End-to-end tests of `ds4-bench` on the tiny fixture model (CPU backend) and of its
//! chart of an earlier CSV.

mod common;

use std::path::Path;
use std::process::Command;

use common::{model, text, tmp_dir, write_file};

const DS4_BENCH: &str = env!("CARGO_BIN_EXE_ds4-bench");
const HEADER: &str = "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes,rows,ms_per_cycle,tokens_per_cycle,effective_tps";
/// The reference's CSV (earlier ds4-bench versions): still drawn by --plot-from.
const HEADER_V1: &str = "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes";

/// `ds4-bench` on the tiny model (CPU, one thread) over `prompt`, with `extra` flags;
/// the CSV's lines.
fn bench_csv(name: &str, extra: &[&str]) -> Vec<String> {
    let d = tmp_dir(name);
    let words = "the quick brown fox jumps over the lazy dog ".repeat(20);
    let prompt = write_file(&d, "prompt.txt", words);
    let csv = d.join("out.csv");
    let o = Command::new(DS4_BENCH)
        .arg("-m")
        .arg(model())
        .args(["--backend", "cpu", "-t", "1", "--prompt-file"])
        .arg(&prompt)
        .args(extra)
        .arg("--csv")
        .arg(&csv)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = std::fs::read_to_string(&csv).unwrap();
    out.lines().map(str::to_string).collect()
}

/// Frontiers 16 and 32 of the tiny model.
const TWO_FRONTIERS: [&str; 6] = ["--ctx-start", "16", "--ctx-max", "32", "--step-incr", "16"];

fn fields(line: &str) -> Vec<f64> {
    line.split(',').map(|f| f.parse().unwrap()).collect()
}

/// `ds4-bench --plot-from CSV --plot SVG`.
fn plot(csv: &Path, svg: &Path) -> std::process::Output {
    Command::new(DS4_BENCH)
        .arg("--plot-from")
        .arg(csv)
        .arg("--plot")
        .arg(svg)
        .output()
        .unwrap()
}

#[test]
fn walks_frontiers_and_writes_one_row_each() {
    let out = bench_csv(
        "walk",
        &[
            "--ctx-start",
            "16",
            "--ctx-max",
            "48",
            "--step-incr",
            "16",
            "-n",
            "2",
        ],
    );
    let lines: Vec<&str> = out.iter().map(String::as_str).collect();
    assert_eq!(lines[0], HEADER);
    for l in &lines[1..] {
        // A plain run: one row per cycle, and the effective rate is the decode rate.
        let f = fields(l);
        assert_eq!((f[6], f[8]), (1.0, 1.0), "{l}");
        assert_eq!(f[9], f[4], "{l}");
        assert!(
            (f[7] - 1e3 / f[4]).abs() < 0.05 * f[7] + 1e-3,
            "ms per cycle: {l}"
        );
    }
    let frontiers: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(frontiers, ["16", "32", "48"]);
    for l in &lines[1..] {
        let f: Vec<&str> = l.split(',').collect();
        assert_eq!(f[1], "16", "incremental prefill of one interval: {l}");
        assert_eq!(f[3], "2", "{l}");
        assert!(f[2].parse::<f64>().unwrap() > 0.0 && f[4].parse::<f64>().unwrap() > 0.0);
        assert!(f[5].parse::<u64>().unwrap() > 0, "KV cache bytes: {l}");
    }
}

/// `--temp`: the decode row samples on the host (ds4's default filters) and times as
/// many tokens; a temperature with --mtp is refused.
#[test]
fn samples_the_decode_at_a_temperature() {
    let mut args = TWO_FRONTIERS.to_vec();
    args.extend(["-n", "3", "--temp", "1"]);
    let out = bench_csv("temp", &args);
    assert_eq!(out[0], HEADER);
    assert_eq!(out.len(), 3, "{out:?}");
    for l in &out[1..] {
        let f = fields(l);
        assert_eq!((f[3], f[6]), (3.0, 1.0), "{l}");
        assert!(f[4] > 0.0, "{l}");
    }
    let o = Command::new(DS4_BENCH)
        .args(["--synthetic-mtp", "--temp", "0.5"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("--temp"), "{}", text(&o.stderr));
    let o = Command::new(DS4_BENCH)
        .args(["--temp", "-1"])
        .output()
        .unwrap();
    assert!(!o.status.success());
}

/// The chart of a CSV with `header` and `rows` (which must draw); the CSV's path and
/// the SVG text.
fn chart_of(name: &str, header: &str, rows: &str) -> (std::path::PathBuf, String) {
    let d = tmp_dir(name);
    let csv = write_file(&d, "in.csv", format!("{header}\n{rows}"));
    let svg = d.join("chart.svg");
    let o = plot(&csv, &svg);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
    (csv, s)
}

#[test]
fn draws_a_chart_of_an_earlier_csv() {
    let rows = "2048,2048,4329.64,64,127.70,52184460\n4096,2048,3924.10,64,126.21,80373132\n";
    let (csv, s) = chart_of("plot", HEADER_V1, rows);
    let d = csv.parent().unwrap();
    assert!(s.contains("4096"), "frontier label missing");

    // Not a ds4-bench CSV: a clear error, no chart.
    std::fs::write(&csv, "a,b\n1,2\n").unwrap();
    let bad = d.join("bad.svg");
    let o = plot(&csv, &bad);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("not a ds4-bench CSV"));
    assert!(!bad.exists());
}

#[test]
fn rows_adds_a_multi_row_step_row_per_frontier() {
    let flags = [&TWO_FRONTIERS[..], &["-n", "4", "--rows", "3"]].concat();
    let lines = bench_csv("rows", &flags);
    assert_eq!(lines[0], HEADER);
    assert_eq!(lines.len(), 1 + 2 * 2, "{lines:?}");
    for pair in lines[1..].chunks(2) {
        let (plain, multi) = (fields(&pair[0]), fields(&pair[1]));
        assert_eq!(plain[0], multi[0], "same frontier: {pair:?}");
        assert_eq!((plain[3], plain[6], plain[8]), (4.0, 1.0, 1.0), "{pair:?}");
        // ceil(4 / 3) = 2 cycles of 3 rows.
        assert_eq!((multi[3], multi[6], multi[8]), (6.0, 3.0, 3.0), "{pair:?}");
        assert_eq!(multi[9], multi[4], "{pair:?}");
        let rate = 3.0 * 1e3 / multi[7].max(1e-3);
        assert!(
            (rate - multi[9]).abs() < 0.05 * rate,
            "tokens/s = rows / cycle time: {pair:?}"
        );
        // The prefill columns are the frontier's, shared.
        assert_eq!(plain[1..3], multi[1..3]);
        assert_eq!(plain[5], multi[5]);
    }

    // Out of range: a usage error before the model loads.
    let o = Command::new(DS4_BENCH)
        .arg("-m")
        .arg(model())
        .args(["--rows", "17"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("--rows must be 1..=16"));
}

#[test]
fn sessions_adds_a_batched_decode_row_per_frontier() {
    let flags = [&TWO_FRONTIERS[..], &["-n", "4", "--sessions", "3"]].concat();
    let lines = bench_csv("sessions", &flags);
    assert_eq!(lines[0], HEADER);
    assert_eq!(lines.len(), 1 + 2 * 2, "{lines:?}");
    for pair in lines[1..].chunks(2) {
        let (plain, batch) = (fields(&pair[0]), fields(&pair[1]));
        assert_eq!(plain[0], batch[0], "same frontier: {pair:?}");
        // 4 steps of 3 sessions: 12 tokens, 3 rows and 3 tokens a step.
        assert_eq!((batch[3], batch[6], batch[8]), (12.0, 3.0, 3.0), "{pair:?}");
        let rate = 3.0 * 1e3 / batch[7].max(1e-3);
        assert!(
            (rate - batch[9]).abs() < 0.05 * rate,
            "tokens/s = rows / step time: {pair:?}"
        );
        assert_eq!(plain[1..3], batch[1..3]);
    }
    // Out of range: a usage error before the model loads.
    let o = Command::new(DS4_BENCH)
        .arg("-m")
        .arg(model())
        .args(["--sessions", "17"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("--sessions must be 1..=16"));
}

#[test]
fn plots_a_csv_with_a_rows_series() {
    let rows = "2048,2048,4329.64,64,127.70,52184460,1,7.831,1.000,127.70\n2048,2048,4329.64,66,300.10,52184460,3,9.997,3.000,300.10\n";
    let (_, s) = chart_of("plot-rows", HEADER, rows);
    assert!(s.contains("decode, 3 rows"), "{s}");
}

/// The MTP row of each frontier (the second), from a run with `extra` flags.
fn mtp_rows(name: &str, extra: &[&str]) -> Vec<Vec<f64>> {
    let mut flags = TWO_FRONTIERS.to_vec();
    flags.extend([
        "-n",
        "25",
        "--quality",
        "--synthetic-mtp",
        "--mtp-draft",
        "2",
    ]);
    flags.extend_from_slice(extra);
    let lines = bench_csv(name, &flags);
    assert_eq!(lines[0], HEADER);
    assert_eq!(lines.len(), 1 + 2 * 2, "{lines:?}");
    lines[1..]
        .chunks(2)
        .map(|pair| {
            let (plain, spec) = (fields(&pair[0]), fields(&pair[1]));
            assert_eq!(plain[..3], spec[..3], "same frontier and prefill: {pair:?}");
            assert_eq!(
                (plain[6], spec[6]),
                (1.0, 3.0),
                "rows = drafts + 1: {pair:?}"
            );
            assert_eq!(spec[9], spec[4], "{pair:?}");
            spec
        })
        .collect()
}

#[test]
fn mtp_runs_take_the_acceptance_as_a_parameter() {
    // Every draft replaced by the greedy token: all accepted, 3 tokens per cycle but for
    // the last cycle, which --gen-tokens cuts short. A greedy-identity failure would
    // fail the run (--quality).
    for row in mtp_rows("mtp-all", &["--accept-rate", "1"]) {
        assert!(row[8] > 2.5 && row[8] <= 3.0, "tokens per cycle: {row:?}");
        assert!(row[3] >= 15.0, "timed tokens: {row:?}");
    }
    // Never: one token per cycle (the verify's own).
    for row in mtp_rows("mtp-none", &["--accept-rate", "0"]) {
        assert_eq!(row[8], 1.0, "{row:?}");
    }
    // Per position 0.8 then 0.3: between the two.
    for row in mtp_rows("mtp-some", &["--accept-rate", "0.8,0.3"]) {
        assert!(row[8] > 1.0 && row[8] < 3.0, "{row:?}");
    }

    // --accept-rate without an MTP block, or out of range: usage errors.
    for (flags, msg) in [
        (
            &["--accept-rate", "0.5"][..],
            "needs --mtp FILE or --synthetic-mtp",
        ),
        (&["--synthetic-mtp", "--accept-rate", "1.5"][..], "in 0..=1"),
        (
            &["--synthetic-mtp", "--mtp-draft", "16"][..],
            "--mtp-draft must be 1..=15",
        ),
    ] {
        let o = Command::new(DS4_BENCH)
            .arg("-m")
            .arg(model())
            .args(flags)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{flags:?}");
        assert!(
            text(&o.stderr).contains(msg),
            "{flags:?}: {}",
            text(&o.stderr)
        );
    }
}

#[test]
fn a_mismatched_mtp_file_is_refused() {
    // The main model's own file is no MTP block.
    let o = Command::new(DS4_BENCH)
        .arg("-m")
        .arg(model())
        .args([
            "--backend",
            "cpu",
            "-t",
            "1",
            "--ctx-start",
            "8",
            "--ctx-max",
            "8",
        ])
        .arg("--mtp")
        .arg(model())
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("cannot load the MTP file"),
        "{}",
        text(&o.stderr)
    );
}

// #23: ds4-bench takes --device-map as ds4 does: syntax and the conflict with --gpus
// are usage errors before anything loads; the coverage is checked against the model.
#[test]
fn device_map_is_checked_like_on_ds4() {
    let bench = |extra: &[&str]| {
        Command::new(DS4_BENCH)
            .arg("-m")
            .arg(model())
            .args([
                "--backend",
                "cpu",
                "-t",
                "1",
                "--ctx-start",
                "8",
                "--ctx-max",
                "8",
            ])
            .args(["-n", "2"])
            .args(extra)
            .output()
            .unwrap()
    };
    for (extra, want) in [
        (&["--device-map", "0:5-3"][..], "layers 5-3 run backwards"),
        (
            &["--gpus", "0,1", "--device-map", "0:0-2,1:3-5"][..],
            "cannot be used with",
        ),
    ] {
        let o = bench(extra);
        assert_eq!(o.status.code(), Some(2), "{extra:?}");
        assert!(
            text(&o.stderr).contains(want),
            "{extra:?}: {}",
            text(&o.stderr)
        );
    }
    let o = bench(&["--device-map", "0:0-4"]);
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(err.contains("layer 5 is on no GPU"), "{err}");
    assert!(err.contains("--device-map 0:0-5"), "{err}");
    // A map that covers the 6 layers is accepted (and unused on the CPU).
    let mut extra = TWO_FRONTIERS.to_vec();
    extra.extend(["-n", "2", "--device-map", "0:0-2,1:3-5"]);
    let out = bench_csv("device-map", &extra);
    assert_eq!(out[0], HEADER);
    assert_eq!(out.len(), 3, "{out:?}");
}
