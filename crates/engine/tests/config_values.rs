//! #18 item 11: every GGUF hyperparameter value that could hang, overflow or poison the
//! model with NaN is refused at load with an error naming the key, never a panic.

use std::path::PathBuf;

use ds4_engine::dev::config::Config;
use ds4_gguf::{GgufFile, GgufWriter, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny/tiny-plain.gguf")
}

/// The tiny model's metadata (no tensors) with `key` set to `value`.
fn metadata_with(key: &str, value: Value) -> Vec<u8> {
    metadata_with_all(&[(key, value)])
}

/// The tiny model's metadata (no tensors) with each `(key, value)` set.
fn metadata_with_all(set: &[(&str, Value)]) -> Vec<u8> {
    let src = GgufFile::open(fixture()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        if k != "general.alignment" && !set.iter().any(|s| s.0 == k) {
            w.add(k.clone(), v.clone()).unwrap();
        }
    }
    for (k, v) in set {
        w.add(*k, v.clone()).unwrap();
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes, |_, _| Ok(())).unwrap();
    bytes
}

fn config_err(key: &str, value: Value) -> String {
    let g = GgufFile::from_bytes(metadata_with(key, value)).unwrap();
    match Config::from_gguf(&g) {
        Ok(_) => panic!("{key} accepted"),
        Err(e) => e.to_string(),
    }
}

fn assert_refused(key: &str, value: Value, want: &str) {
    let err = config_err(key, value.clone());
    assert!(
        err.contains(key) && err.contains(want),
        "{key}={value:?}: {err}"
    );
}

#[test]
fn the_unchanged_metadata_parses() {
    let g = GgufFile::from_bytes(metadata_with("general.name", Value::String("x".into())));
    Config::from_gguf(&g.unwrap()).unwrap();
}

#[test]
fn sinkhorn_iterations_are_bounded() {
    let key = "deepseek4.hyper_connection.sinkhorn_iterations";
    assert_refused(key, Value::U32(1 << 31), "limit");
}

#[test]
fn counts_stay_in_a_sane_range() {
    for key in [
        "deepseek4.block_count",
        "deepseek4.embedding_length",
        "deepseek4.vocab_size",
        "deepseek4.attention.head_count",
        "deepseek4.expert_count",
        "deepseek4.hyper_connection.count",
    ] {
        assert_refused(key, Value::U32(u32::MAX), "limit");
        assert_refused(key, Value::U32(0), "positive");
    }
}

#[test]
fn epsilons_must_be_positive_and_finite() {
    for key in [
        "deepseek4.attention.layer_norm_rms_epsilon",
        "deepseek4.hyper_connection.epsilon",
    ] {
        assert_refused(key, Value::F32(0.0), "> 0");
        assert_refused(key, Value::F32(-1e-6), "> 0");
        assert_refused(key, Value::F32(f32::NAN), "finite");
        assert_refused(key, Value::F32(f32::INFINITY), "finite");
    }
}

#[test]
fn rope_bases_and_scale_must_be_positive_and_finite() {
    for key in [
        "deepseek4.rope.freq_base",
        "deepseek4.attention.compress_rope_freq_base",
        "deepseek4.rope.scaling.factor",
        "deepseek4.expert_weights_scale",
    ] {
        assert_refused(key, Value::F32(0.0), "> 0");
        assert_refused(key, Value::F32(-10000.0), "> 0");
        assert_refused(key, Value::F32(f32::NAN), "finite");
        // Finite as f64, inf once narrowed to the f32 the model computes in.
        assert_refused(key, Value::F64(1e300), "finite");
    }
}

#[test]
fn clamps_must_be_finite() {
    let n = GgufFile::open(fixture())
        .unwrap()
        .get("deepseek4.block_count")
        .and_then(Value::as_i64)
        .unwrap() as usize;
    for key in ["deepseek4.swiglu_clamp_exp", "deepseek4.swiglu_clamp_shexp"] {
        for bad in [f32::NAN, f32::INFINITY, -1.0] {
            let mut v = vec![10.0; n];
            v[n - 1] = bad;
            assert_refused(key, Value::f32_array(&v), "finite and > 0");
        }
    }
}

#[test]
fn a_non_string_architecture_is_an_error() {
    let err = config_err("general.architecture", Value::U32(7));
    assert!(
        err.contains("general.architecture") && err.contains("not a string"),
        "{err}"
    );
}

/// Writes the metadata with `set` applied to a file and loads its tokenizer.
fn tokenizer_err(set: &[(&str, Value)]) -> String {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("config_values-{}.gguf", set[0].0.replace('.', "_")));
    std::fs::write(&path, metadata_with_all(set)).unwrap();
    let res = ds4_engine::load_tokenizer(&path);
    std::fs::remove_file(&path).unwrap();
    match res {
        Ok(_) => panic!("{set:?} accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bos_and_eos_must_lie_inside_the_vocabulary() {
    for key in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"] {
        let err = tokenizer_err(&[(key, Value::U32(1 << 30))]);
        assert!(err.contains(key) && err.contains("outside"), "{err}");
        // Inside the token list but past the model's embedding rows.
        let err = tokenizer_err(&[
            (key, Value::U32(10)),
            ("deepseek4.vocab_size", Value::U32(4)),
        ]);
        assert!(err.contains("id 10, outside the vocabulary of 4"), "{err}");
    }
}

#[test]
fn an_inf_or_nan_in_a_norm_vector_is_refused_at_load() {
    use ds4_engine::dev::{LoadOptions, Model};
    let name = "output_norm.weight";
    for bad in [f32::INFINITY, f32::NAN] {
        let src = GgufFile::open(fixture()).unwrap();
        let info = src.tensor_info(name).unwrap();
        let at = info.offset as usize + 4 * 3;
        let mut bytes = src.bytes().to_vec();
        bytes[at..at + 4].copy_from_slice(&bad.to_le_bytes());
        let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("config_values-norm.gguf");
        std::fs::write(&path, bytes).unwrap();
        let res = Model::load(&path, LoadOptions::default());
        std::fs::remove_file(&path).unwrap();
        let Err(err) = res else {
            panic!("a non-finite norm was accepted")
        };
        let err = err.to_string();
        assert!(err.contains(name) && err.contains("element 3"), "{err}");
    }
}
