//! Directional steering and the reference-parity flags (#24) end to end on the tiny
//! fixture model: `ds4-tool steer build` writes a direction file and its sidecar, `ds4`
//! and `ds4-bench` take `--dir-steering-*` (scale 0 gives the plain output byte for
//! byte), `ds4 --trace` and `--warm-weights` work, and `--metal` is refused with status 2.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{model, read_f32, read_json, text, tmp_dir, tool, write_file};

const DS4: &str = env!("CARGO_BIN_EXE_ds4");
const DS4_BENCH: &str = env!("CARGO_BIN_EXE_ds4-bench");

fn ds4(args: &[&str]) -> Output {
    Command::new(DS4)
        .arg("-m")
        .arg(model())
        .args(["-t", "1", "--cpu"])
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run ds4")
}

/// A direction file built by `ds4-tool steer build` from two small prompt files.
fn built(d: &Path) -> PathBuf {
    let good = write_file(
        d,
        "good.txt",
        "# target prompts\nAnswer in one word.\n\nBe brief: what is TCP?\nTerse: define a cache.\n",
    );
    let bad = write_file(d, "bad.txt", "Explain at length, with examples.\nWrite a detailed essay about TCP.\nDescribe caches in depth, every detail.\nExtra line beyond the pairs.\n");
    let out = d.join("dir.f32");
    let (ok, _, err) = tool(&[
        "steer",
        "build",
        "--good",
        good.to_str().unwrap(),
        "--bad",
        bad.to_str().unwrap(),
        "--component",
        "ffn_out",
        "-o",
        out.to_str().unwrap(),
        "-m",
        model().to_str().unwrap(),
        "--ctx",
        "128",
        "-t",
        "1",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("pair 3/3"), "{err}");
    out
}

#[test]
fn steer_build_writes_unit_directions_and_a_sidecar() {
    let d = tmp_dir("build");
    let out = built(&d);
    let v = read_f32(&out);
    // The tiny model: 6 layers of 256.
    assert_eq!(v.len(), 6 * 256);
    for (il, row) in v.chunks_exact(256).enumerate() {
        let n: f32 = row.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-4, "layer {il}: |d|² = {n}");
    }
    let meta = read_json(&d.join("dir.f32.json"));
    assert_eq!(meta["format"], "ds4-directional-steering-v1");
    assert_eq!(meta["shape"], serde_json::json!([6, 256]));
    assert_eq!(meta["component"], "ffn_out");
    assert_eq!(meta["counts"]["good_prompts"], 3);
    assert_eq!(meta["counts"]["bad_prompts"], 4);
    assert_eq!(meta["counts"]["pairs_used"], 3);
    assert_eq!(meta["layers"].as_array().unwrap().len(), 6);
    assert!(meta["layers"][0]["diff_norm"].as_f64().unwrap() > 0.0);
    assert!(meta["date"].as_str().unwrap().ends_with('Z'));
    // An unknown component is refused by name.
    let (ok, _, err) = tool(&[
        "steer",
        "build",
        "--component",
        "bogus",
        "--good",
        "x",
        "--bad",
        "y",
        "-o",
        "z",
    ]);
    assert!(!ok && err.contains("bogus"), "{err}");
}

#[test]
fn ds4_steers_and_scale_zero_is_the_plain_output() {
    let d = tmp_dir("ds4");
    let dir = built(&d);
    let f = dir.to_str().unwrap();
    let base = ["-p", "Hello there", "-n", "12", "--temp", "0", "--nothink"];
    let plain = ds4(&base);
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    let zero = ds4(&[
        &base[..],
        &["--dir-steering-file", f, "--dir-steering-ffn", "0"],
    ]
    .concat());
    assert!(zero.status.success(), "{}", text(&zero.stderr));
    assert_eq!(plain.stdout, zero.stdout);
    assert!(!text(&zero.stderr).contains("directional steering:"));
    let trace = d.join("trace.log");
    let on = ds4(&[
        &base[..],
        &[
            "--dir-steering-file",
            f,
            "--dir-steering-ffn",
            "-2",
            "--dir-steering-attn",
            "0.5",
        ],
        &["--trace", trace.to_str().unwrap(), "--warm-weights"],
    ]
    .concat());
    let err = text(&on.stderr);
    assert!(on.status.success(), "{err}");
    assert!(
        err.contains(&format!("ds4: directional steering: {f} ffn=-2 attn=0.5")),
        "{err}"
    );
    assert!(err.contains("ds4: warm weights: read "), "{err}");
    let t = std::fs::read_to_string(&trace).unwrap();
    for want in [
        "===== run 1 ",
        "kind: oneshot",
        "think_mode: off",
        "dir_steering: ffn=-2 attn=0.5",
        "--- rendered prompt ---\n<｜begin▁of▁sentence｜>",
        "Hello there<｜Assistant｜></think>",
        "--- generated text ---\n",
        "finish: ",
        "generated_tokens: ",
        "===== end run 1 =====",
    ] {
        assert!(t.contains(want), "missing {want:?} in the trace:\n{t}");
    }
    let generated = t.split("--- generated text ---\n").nth(1).unwrap();
    assert!(
        generated.starts_with(&text(&on.stdout).trim_end_matches('\n').to_string()),
        "{t}"
    );
}

#[test]
fn bad_steering_and_metal_are_refused() {
    let d = tmp_dir("bad");
    let short = write_file(&d, "short.f32", vec![0u8; 6 * 256 * 4 - 4]);
    let o = ds4(&[
        "-p",
        "x",
        "-n",
        "1",
        "--dir-steering-file",
        short.to_str().unwrap(),
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "steering file {}: 6140 bytes, expected 6144",
            short.display()
        )),
        "{err}"
    );
    let mut nan = vec![0u8; 6 * 256 * 4];
    nan[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    let nan = write_file(&d, "nan.f32", nan);
    let o = ds4(&[
        "-p",
        "x",
        "-n",
        "1",
        "--dir-steering-file",
        nan.to_str().unwrap(),
    ]);
    assert!(
        text(&o.stderr).contains("layer 0, dim 2) is NaN"),
        "{}",
        text(&o.stderr)
    );
    let o = ds4(&["-p", "x", "--dir-steering-ffn", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("need --dir-steering-file"));
    let o = ds4(&["-p", "x", "--metal"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("--metal: the Metal backend is not available in this build"));
    let o = Command::new(DS4_BENCH).args(["--metal"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o.stderr).contains("not available in this build"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn ds4_bench_takes_the_steering_flags() {
    let d = tmp_dir("bench");
    let dir = built(&d);
    let prompt = write_file(&d, "prompt.txt", "the quick brown fox ".repeat(20));
    let csv = d.join("out.csv");
    let o = Command::new(DS4_BENCH)
        .arg("-m")
        .arg(model())
        .args([
            "--backend",
            "cpu",
            "-t",
            "1",
            "--ctx-start",
            "16",
            "--ctx-max",
            "16",
            "-n",
            "2",
        ])
        .arg("--prompt-file")
        .arg(&prompt)
        .arg("--dir-steering-file")
        .arg(&dir)
        .args(["--dir-steering-attn", "-1", "--csv"])
        .arg(&csv)
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("directional steering: ") && err.contains("ffn=1 attn=-1"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&csv).unwrap().lines().count(), 2);
}

#[test]
fn interactive_turns_are_traced_one_record_each() {
    use std::io::Write;
    let d = tmp_dir("chat");
    let trace = d.join("chat.log");
    let mut child = Command::new(DS4)
        .arg("-m")
        .arg(model())
        .args([
            "-t",
            "1",
            "--cpu",
            "-n",
            "4",
            "--temp",
            "0",
            "--nothink",
            "--trace",
        ])
        .arg(&trace)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello\nsecond turn\n/quit\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let t = std::fs::read_to_string(&trace).unwrap();
    assert!(
        t.contains("===== run 1 ") && t.contains("===== end run 2 ====="),
        "{t}"
    );
    assert!(!t.contains("===== run 3 "), "{t}");
    let second = t.split("===== run 2 ").nth(1).unwrap();
    assert!(second.contains("kind: chat"), "{t}");
    // The second turn reuses the first one's tokens and prefills only its own.
    let cached: usize = second
        .lines()
        .find_map(|l| l.strip_prefix("cached_tokens: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(cached > 0, "{t}");
    assert!(
        second.contains("<｜User｜>second turn<｜Assistant｜></think>"),
        "{t}"
    );
    assert!(!second.contains("hello<｜Assistant｜>"), "{t}");
}
