//! `ds4-tool quantize` and `ds4-tool splice` end to end (#24 part 2) on a tiny checkpoint
//! in the official format (made from the tiny fixture by `ds4_convert::testckpt`): the
//! dry-run table, a q4 conversion that `inspect` accepts, `--compare-tensor`, a splice,
//! and the up-front path checks.

mod common;

use common::*;
use ds4_engine::dev::Config;
use ds4_gguf::{GgmlType, GgufFile};

#[test]
fn quantize_compare_and_splice_from_the_command_line() {
    let dir = tmp_dir("quantize");
    let hf = dir.join("hf");
    let g = GgufFile::open(model()).unwrap();
    let cfg = Config::from_gguf(&g).unwrap();
    ds4_convert::testckpt::write_checkpoint(
        &g,
        &cfg,
        &hf,
        Some(&fixtures().join("tokenizer.json")),
    )
    .unwrap();
    let hf_s = hf.to_str().unwrap();

    let table = tool_ok(&["quantize", "--hf", hf_s, "--mix", "q4", "--dry-run"]);
    assert!(table.contains("blk.5.ffn_down_exps.weight"), "{table}");
    assert!(table.contains("178 tensors, mix q4"), "{table}");
    let line = table
        .lines()
        .find(|l| l.starts_with("blk.2.ffn_up_exps.weight"))
        .unwrap();
    assert!(line.contains("Q4_K") && line.ends_with("294912"), "{line}");

    let q4 = dir.join("q4.gguf");
    let q4_s = q4.to_str().unwrap();
    tool_ok(&[
        "quantize", "--hf", hf_s, "--mix", "q4", "-o", q4_s, "-t", "2",
    ]);
    let f = GgufFile::open(&q4).unwrap();
    assert_eq!(
        f.tensor_info("blk.4.ffn_gate_exps.weight").unwrap().ty,
        GgmlType::Q4_K
    );
    assert_eq!(
        f.tensor_info("blk.4.attn_q_b.weight").unwrap().ty,
        GgmlType::Q8_0
    );
    let inspect = tool_ok(&["inspect", q4_s, "--no-tensors"]);
    assert!(inspect.contains("deepseek4"), "{inspect}");

    let cmp = tool_ok(&[
        "quantize",
        "--hf",
        hf_s,
        "--compare-tensor",
        "blk.0.attn_norm.weight",
        "--gguf",
        q4_s,
    ]);
    assert!(cmp.contains("(F32)") && cmp.contains(" 0 differ"), "{cmp}");
    let cmp = tool_ok(&[
        "quantize",
        "--hf",
        hf_s,
        "--compare-tensor",
        "blk.0.ffn_up_exps.weight",
        "-o",
        q4_s,
    ]);
    assert!(
        cmp.contains("(Q4_K)") && !cmp.contains(" 0 differ"),
        "{cmp}"
    );
    let err = tool_err(&[
        "quantize",
        "--hf",
        hf_s,
        "--compare-tensor",
        "nope",
        "--gguf",
        q4_s,
    ]);
    assert!(err.contains("no tensor nope"), "{err}");

    let mixed = dir.join("mixed.gguf");
    tool_ok(&[
        "splice",
        "--base",
        model().to_str().unwrap(),
        "--donor",
        q4_s,
        "--layers",
        "1-2",
        "-o",
        mixed.to_str().unwrap(),
    ]);
    let m = GgufFile::open(&mixed).unwrap();
    assert_eq!(
        m.tensor_info("blk.1.ffn_down_exps.weight").unwrap().ty,
        GgmlType::Q4_K
    );
    assert_eq!(
        m.tensor_info("blk.3.ffn_down_exps.weight").unwrap().ty,
        GgmlType::Q2_K
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn quantize_checks_its_paths_first() {
    let dir = tmp_dir("quantize-paths");
    let missing = dir.join("missing");
    let (ok, _, err) = tool(&["quantize", "--hf", missing.to_str().unwrap(), "--dry-run"]);
    assert!(!ok && err.contains("--hf <HF>"), "{err}");
    // --out is required for a real run.
    let (ok, _, err) = tool(&["quantize", "--hf", dir.to_str().unwrap()]);
    assert!(!ok && err.contains("--out"), "{err}");
    let (ok, _, err) = tool(&[
        "splice",
        "--base",
        missing.to_str().unwrap(),
        "--donor",
        "x",
        "--layers",
        "1",
        "-o",
        "y",
    ]);
    assert!(!ok && err.contains("--base <BASE>"), "{err}");
}
