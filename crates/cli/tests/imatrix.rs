//! `ds4 --imatrix-dataset/--imatrix-out` end to end on the tiny fixture: the file equals
//! an in-process collection over the same prompts (so --imatrix-max-prompts and
//! --imatrix-max-tokens cut where they should), it reads back, and bad datasets are
//! usage errors (status 2) before the model loads.

mod common;

use std::path::Path;
use std::process::Command;

use ds4_engine::{BackendChoice, Engine, EngineOptions, Imatrix, ImatrixCollector, Numerics};

const PROMPTS: [&str; 3] = [
    "<｜begin▁of▁sentence｜><｜User｜>Tell me about the sea and the sky.<｜Assistant｜></think>",
    "<｜begin▁of▁sentence｜>system<｜User｜>Count: one two three four five.<｜Assistant｜><think>",
    "<｜begin▁of▁sentence｜><｜User｜>A third prompt that must not be seen.<｜Assistant｜></think>",
];

fn dataset() -> String {
    let mut s = String::from("# calibration prompts\n");
    for (i, p) in PROMPTS.iter().enumerate() {
        s += &format!("===== DS4_IMATRIX_PROMPT {i} =====\n{p}\n\n");
    }
    s
}

fn ds4(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ds4"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The file the CLI should write: prompts tokenized as rendered chats, each from an
/// empty session, the token budget cutting the last one.
fn expected(prompts: &[&str], max_tokens: Option<usize>, name: &Path) -> Vec<u8> {
    let engine = Engine::open(
        common::model(),
        EngineOptions {
            backend: BackendChoice::Cpu { threads: None },
            numerics: Numerics::Fast,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let tok = engine.tokenizer().unwrap();
    let mut c = ImatrixCollector::new(&engine.info().hparams);
    let mut left = max_tokens.unwrap_or(usize::MAX);
    for p in prompts {
        let mut ids = tok.encode(p);
        ids.truncate(left);
        left -= ids.len();
        let mut s = engine.new_session(512).unwrap();
        s.prefill_observed(&ids, &mut c).unwrap();
        if left == 0 {
            break;
        }
    }
    let mut buf = Vec::new();
    c.to_imatrix(&name.to_string_lossy())
        .write_to(&mut buf)
        .unwrap();
    buf
}

fn collect(extra: &[&str]) -> (Vec<u8>, String, std::path::PathBuf) {
    let dir = common::tmp_dir(&format!("imatrix{}", extra.join("")));
    let ds = common::write_file(&dir, "prompts.txt", dataset());
    let out = dir.join("out.dat");
    let model = common::model();
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--cpu",
        "--ctx",
        "512",
        "--imatrix-dataset",
        ds.to_str().unwrap(),
        "--imatrix-out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (code, err) = ds4(&args);
    assert_eq!(code, 0, "{err}");
    (std::fs::read(&out).unwrap(), err, ds)
}

#[test]
fn max_prompts_is_respected() {
    let (got, err, ds) = collect(&["--imatrix-max-prompts", "2"]);
    assert!(err.contains("from 2 prompts"), "{err}");
    assert!(err.contains("tokens/s"), "{err}");
    assert!(got == expected(&PROMPTS[..2], None, &ds), "file differs");
    let m = Imatrix::read_from(&mut got.as_slice()).unwrap();
    assert_eq!(m.entries.len(), 3 * 6);
    assert_eq!(m.entries[2].name, "blk.0.ffn_down_exps.weight");
    // One prefill batch per prompt, six layers.
    assert_eq!(m.last_call, 2 * 6);
    // All three prompts differ from the first two.
    let (all, _, ds) = collect(&[]);
    assert!(all == expected(&PROMPTS, None, &ds));
    assert!(all != got);
}

#[test]
fn max_tokens_is_respected() {
    let n0 = {
        let tok = ds4_engine::load_tokenizer(common::model()).unwrap();
        tok.encode(PROMPTS[0]).len()
    };
    // The budget ends inside the second prompt.
    let budget = n0 + 5;
    let b = budget.to_string();
    let (got, err, ds) = collect(&["--imatrix-max-tokens", &b]);
    assert!(
        err.contains(&format!("from 2 prompts, {budget} tokens")),
        "{err}"
    );
    assert!(got == expected(&PROMPTS, Some(budget), &ds), "file differs");
}

#[test]
fn bad_datasets_are_usage_errors() {
    let dir = common::tmp_dir("imatrix-bad");
    let model = common::model();
    let m = model.to_str().unwrap();
    let out = dir.join("o.dat");
    let o = out.to_str().unwrap();
    let empty = common::write_file(&dir, "empty.txt", "\n===== DS4_IMATRIX_PROMPT 0\n  \n");
    let binary = common::write_file(&dir, "bin.txt", [0xffu8, 0xfe, 0x00, 0x41]);
    for (ds, want) in [
        (empty.to_str().unwrap(), "holds no prompt"),
        (binary.to_str().unwrap(), "is not UTF-8"),
        ("/nonexistent/prompts.txt", "--imatrix-dataset"),
    ] {
        let (code, err) = ds4(&["-m", m, "--imatrix-dataset", ds, "--imatrix-out", o]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(want), "{err}");
    }
    assert!(!out.exists());
    let (code, err) = ds4(&["-m", m, "--imatrix-out", o]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--imatrix-dataset"), "{err}");
}
