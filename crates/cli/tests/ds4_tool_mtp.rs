//! `ds4-tool synth --mtp-out` and `ds4-tool inspect` on MTP files, end to end.

mod common;

use common::{synth, tmp_file as tmp, tool_err, tool_ok};

#[test]
fn full_size_mtp_dry_run_prints_the_shipped_plan_and_writes_nothing() {
    let out = tmp("never.gguf");
    let text = synth("full", &["--dry-run", "--mtp-out", out.to_str().unwrap()]);
    // 3.54 GiB: the shipped MTP-Q4K-Q8_0-F32 file is "about 3.55 GiB".
    assert!(
        text.contains("32 tensors, 3805502956 bytes of tensor data (3.54 GiB)"),
        "{text}"
    );
    assert!(text.contains("mtp.0.ffn_down_exps.weight"), "{text}");
    assert!(text.contains("Q4_K"), "{text}");
    // Only the MTP plan was asked for.
    assert!(!text.contains("blk.0."), "{text}");
    assert!(!out.exists());
}

#[test]
fn tiny_mtp_file_is_written_deterministically_and_inspected_against_its_model() {
    let (main, mtp, mtp2) = (tmp("main.gguf"), tmp("mtp.gguf"), tmp("mtp2.gguf"));
    synth(
        "tiny",
        &[
            "--layers",
            "3",
            "--out",
            main.to_str().unwrap(),
            "--mtp-out",
            mtp.to_str().unwrap(),
        ],
    );
    // --mtp-out alone (no --out) writes the same MTP file for the same seed.
    synth("tiny", &["--mtp-out", mtp2.to_str().unwrap()]);
    assert!(std::fs::read(&mtp).unwrap() == std::fs::read(&mtp2).unwrap());

    let text = tool_ok(&[
        "inspect",
        mtp.to_str().unwrap(),
        "--no-tensors",
        "--main",
        main.to_str().unwrap(),
    ]);
    assert!(text.contains("== DeepSeek V4 MTP block"), "{text}");
    assert!(text.contains("routed experts"), "{text}");
    assert!(text.contains("layout: matches"), "{text}");

    // --main on a file that is not an MTP file.
    let err = tool_err(&[
        "inspect",
        main.to_str().unwrap(),
        "--main",
        main.to_str().unwrap(),
    ]);
    assert!(err.contains("not one"), "{err}");
    std::fs::remove_dir_all(main.parent().unwrap()).unwrap();
}
