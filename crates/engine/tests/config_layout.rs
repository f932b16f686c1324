//! Config parsing and the layout check against the vendored tiny models.

use std::path::PathBuf;

use ds4_engine::dev::config::Config;
use ds4_engine::dev::layout::{check_layout, LayoutIssue};
use ds4_gguf::GgufFile;

fn open(name: &str) -> GgufFile {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/tiny")
        .join(name);
    GgufFile::open(p).unwrap()
}

#[test]
fn tiny_configs_parse_and_match_the_tiny_profile() {
    for f in ["tiny-q2.gguf", "tiny-q4.gguf", "tiny-plain.gguf"] {
        let cfg = Config::from_gguf(&open(f)).unwrap();
        let mut want = Config::tiny(6);
        want.name = cfg.name.clone();
        assert_eq!(cfg, want, "{f}");
        let dev = cfg.profile_deviations();
        assert!(dev.iter().any(|d| d.starts_with("n_embd: 256")), "{dev:?}");
    }
}

#[test]
fn published_layouts_have_no_issues() {
    for f in ["tiny-q2.gguf", "tiny-q4.gguf"] {
        let g = open(f);
        let cfg = Config::from_gguf(&g).unwrap();
        assert_eq!(check_layout(&cfg, &g), vec![], "{f}");
    }
}

#[test]
fn plain_layout_runs_but_differs_from_the_published_types() {
    let g = open("tiny-plain.gguf");
    let cfg = Config::from_gguf(&g).unwrap();
    let issues = check_layout(&cfg, &g);
    assert!(!issues.is_empty());
    assert!(issues.iter().all(|i| !i.is_fatal()), "{issues:?}");
    assert!(issues.iter().any(|i| matches!(i, LayoutIssue::NotPublishedType { name, .. } if name == "blk.0.attn_q_a.weight")));
}

#[test]
fn missing_keys_and_wrong_types_are_named() {
    use ds4_gguf::{GgufWriter, Value};
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::String("deepseek4".into()))
        .unwrap();
    w.add("deepseek4.block_count", Value::U64(6)).unwrap();
    let mut bytes = Vec::new();
    w.write_to(&mut bytes, |_, _| Ok(())).unwrap();
    let err = Config::from_gguf(&GgufFile::from_bytes(bytes).unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("deepseek4.block_count") && err.to_string().contains("u32"),
        "{err}"
    );

    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::String("llama".into()))
        .unwrap();
    let mut bytes = Vec::new();
    w.write_to(&mut bytes, |_, _| Ok(())).unwrap();
    let err = Config::from_gguf(&GgufFile::from_bytes(bytes).unwrap()).unwrap_err();
    assert!(err.to_string().contains("llama"), "{err}");
}
