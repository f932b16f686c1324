//! End-to-end tests of `ds4-bench` on the tiny fixture model (CPU backend) and of its
//! chart of an earlier CSV.

mod common;

use std::path::Path;
use std::process::Command;

use common::{model, text, tmp_dir, write_file};

const DS4_BENCH: &str = env!("CARGO_BIN_EXE_ds4-bench");
const HEADER: &str = "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes";

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
    let d = tmp_dir("walk");
    let words = "the quick brown fox jumps over the lazy dog ".repeat(20);
    let prompt = write_file(&d, "prompt.txt", words);
    let csv = d.join("out.csv");
    let o = Command::new(DS4_BENCH)
        .arg("-m")
        .arg(model())
        .args(["--backend", "cpu", "-t", "1", "--prompt-file"])
        .arg(&prompt)
        .args([
            "--ctx-start",
            "16",
            "--ctx-max",
            "48",
            "--step-incr",
            "16",
            "-n",
            "2",
        ])
        .arg("--csv")
        .arg(&csv)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], HEADER);
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

#[test]
fn draws_a_chart_of_an_earlier_csv() {
    let d = tmp_dir("plot");
    let rows = "2048,2048,4329.64,64,127.70,52184460\n4096,2048,3924.10,64,126.21,80373132\n";
    let csv = write_file(&d, "in.csv", format!("{HEADER}\n{rows}"));
    let svg = d.join("chart.svg");
    let o = plot(&csv, &svg);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
    assert!(s.contains("4096"), "frontier label missing");

    // Not a ds4-bench CSV: a clear error, no chart.
    std::fs::write(&csv, "a,b\n1,2\n").unwrap();
    let bad = d.join("bad.svg");
    let o = plot(&csv, &bad);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("not a ds4-bench CSV"));
    assert!(!bad.exists());
}
