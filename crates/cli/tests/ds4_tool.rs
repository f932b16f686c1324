//! `ds4-tool` end to end: synth, inspect and dump-tensor on real files.

use std::path::{Path, PathBuf};
use std::process::Command;

use ds4_engine::dev::config::Config;
use ds4_engine::dev::layout::check_layout;
use ds4_gguf::GgufFile;

mod common;

use common::{synth, tmp_file as tmp, tool_err, tool_ok};

#[path = "../../../tests-support/record_skip.rs"]
mod record_skip;

fn fixture(name: &str) -> PathBuf {
    common::fixtures().join(name)
}

#[test]
fn full_size_dry_run_lists_the_published_table() {
    // The full-size table only (--dry-run): nothing is written.
    let full_dry_run = |experts: &str| {
        synth(
            "full",
            &["--layers", "43", "--experts", experts, "--dry-run"],
        )
    };
    let out = full_dry_run("q2");
    assert!(
        out.contains("1328 tensors, 86714775900 bytes of tensor data"),
        "{out}"
    );
    assert!(out.contains("blk.42.ffn_down_exps.weight"));
    assert_eq!(
        out.lines()
            .filter(|l| l.starts_with("blk.")
                || l.starts_with("output")
                || l.starts_with("token_embd"))
            .count(),
        1328
    );
    let out = full_dry_run("q4");
    assert!(
        out.contains("1328 tensors, 164628167004 bytes of tensor data"),
        "{out}"
    );
}

#[test]
fn tiny_synth_is_loadable_deterministic_and_thread_independent() {
    let [a, b, c] = ["a.gguf", "b.gguf", "c.gguf"].map(tmp);
    let tok = fixture("tokenizer.json");
    let base = [
        "--layers",
        "6",
        "--experts",
        "q2",
        "--tokenizer",
        tok.to_str().unwrap(),
    ];
    let run = |out: &Path, extra: &[&str]| {
        let mut args: Vec<&str> = base.to_vec();
        args.extend_from_slice(&["-o", out.to_str().unwrap()]);
        args.extend_from_slice(extra);
        synth("tiny", &args);
    };
    run(&a, &["--seed", "7", "-t", "1"]);
    run(&b, &["--seed", "7", "-t", "2"]);
    run(&c, &["--seed", "8"]);
    let (fa, fb, fc) = (
        std::fs::read(&a).unwrap(),
        std::fs::read(&b).unwrap(),
        std::fs::read(&c).unwrap(),
    );
    assert_eq!(fa, fb, "same seed, different thread count");
    assert_ne!(fa, fc, "different seeds");

    let g = GgufFile::open(&a).unwrap();
    let cfg = Config::from_gguf(&g).unwrap();
    assert_eq!(check_layout(&cfg, &g), vec![]);
    let fixture_gguf = GgufFile::open(fixture("tiny-q2.gguf")).unwrap();
    for key in [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
    ] {
        assert_eq!(g.get(key), fixture_gguf.get(key), "{key}");
    }
    for (x, y) in g.tensors().iter().zip(fixture_gguf.tensors()) {
        assert_eq!((&x.name, &x.dims, x.ty), (&y.name, &y.dims, y.ty));
    }
    // No temporary file is left behind.
    assert!(!a.with_extension("gguf.tmp").exists());
}

#[test]
fn inspect_reads_every_fixture() {
    for f in ["tiny-q2.gguf", "tiny-q4.gguf", "tiny-plain.gguf"] {
        let out = tool_ok(&["inspect", fixture(f).to_str().unwrap()]);
        assert!(out.contains("178 tensors"), "{f}");
        assert!(out.contains("deepseek4.attention.compress_ratios"), "{f}");
        assert!(out.contains("n_embd: 256 (Flash: 4096)"), "{f}");
        if f == "tiny-plain.gguf" {
            assert!(out.contains("0 prevent loading"), "{out}");
        } else {
            assert!(out.contains("exactly the published layout"), "{out}");
        }
    }
}

#[test]
fn inspect_rejects_garbage_with_a_message() {
    let p = tmp("garbage.gguf");
    std::fs::write(&p, b"not a gguf file at all").unwrap();
    let err = tool_err(&["inspect", p.to_str().unwrap()]);
    assert!(err.contains("not a GGUF file"), "{err}");
    let err = tool_err(&["inspect", "/nonexistent/x.gguf"]);
    assert!(
        err.contains("'/nonexistent/x.gguf' for '<FILE>': no such file"),
        "{err}"
    );
}

#[test]
fn dump_tensor_writes_dequantized_f32() {
    let out = tmp("t.bin");
    let f = fixture("tiny-q2.gguf");
    tool_ok(&[
        "dump-tensor",
        f.to_str().unwrap(),
        "blk.3.ffn_down_exps.weight",
        "--out",
        out.to_str().unwrap(),
    ]);
    let g = GgufFile::open(&f).unwrap();
    let t = g.tensor("blk.3.ffn_down_exps.weight").unwrap();
    let want = ds4_gguf::quant::dequantize_to_vec(t.ty(), t.data, 256 * 256 * 8).unwrap();
    assert_eq!(common::read_f32(&out), want);
    let err = tool_err(&["dump-tensor", f.to_str().unwrap(), "blk.3.nope"]);
    assert!(err.contains("no tensor named"), "{err}");
}

// #19 item 4: `ds4-tool inspect … | head` panicked in `println!` once the reader left.
#[test]
fn a_closed_stdout_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    // A child that another test thread forks at the wrong moment holds a copy of the
    // read end until its exec, and then the writes fit the pipe buffer and succeed: a
    // few tries, of which one must see the broken pipe and none may panic.
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ds4-tool"))
            .args(["inspect", "--full-arrays"])
            .arg(fixture("tiny-q2.gguf"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Close the read end before the child writes: its first write meets a broken pipe.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.is_empty(), "{err}");
        if out.status.signal() == Some(13) {
            return;
        }
        statuses.push(out.status);
    }
    panic!("no SIGPIPE in 5 tries: {statuses:?}");
}

// #19 item 4: `ds4-tool synth` with no arguments wrote the full 86.7 GB model to a
// default path; the output is now required (the dry run needs none).
#[test]
fn synth_without_an_output_path_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_ds4-tool"))
        .args(["synth", "--dims", "tiny", "--layers", "2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--out"), "{err}");
}

// #19 item 4: Ctrl+C during `synth` removes the half-written temporary file. A one-layer
// full-size model (3.6 GB, written sparse) takes long enough to interrupt; the signal
// goes out as soon as the temporary file appears, so little is actually written.
#[test]
fn ctrl_c_during_synth_removes_the_temporary_file() {
    let dir = std::env::temp_dir().join(format!("ds4-tool-sigint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("full1.gguf");
    let free = ds4_cli::disk::free_space(&out).unwrap();
    if free < 8 << 30 {
        record_skip::record_skip(&format!(
            "synth Ctrl+C test: {free} bytes free, 8 GiB wanted"
        ));
        return;
    }
    let tmp = ds4_synth::Plan::temp_path(&out);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ds4-tool"))
        .args(["synth", "--dims", "full", "--layers", "1", "-t", "1", "-o"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !tmp.exists() {
        assert!(
            t0.elapsed().as_secs() < 60,
            "no {} after 60 s",
            tmp.display()
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "synth ended before writing"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // SAFETY: kill(2) on the child's pid, which has not been waited for yet.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted; removed"), "{err}");
    assert!(!tmp.exists(), "{} left behind", tmp.display());
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).ok();
}
