//! The vendored tiny DS4 models: every tensor's name, dims and type match the manifest,
//! and its dequantized values hash to the manifest's SHA-256 (exact dequantisation).

use std::path::PathBuf;

use ds4_gguf::{quant, GgmlType, GgufFile};
use sha2::{Digest, Sha256};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny")
}

fn manifest() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn check_file(variant: &str, weights: &str) {
    let m = manifest();
    let file = m["files"][variant]["path"].as_str().unwrap();
    let gguf = GgufFile::open(fixtures().join(file)).unwrap();
    let tensors = m["tensors"].as_array().unwrap();
    assert_eq!(
        gguf.tensors().len(),
        tensors.len(),
        "{variant}: tensor count"
    );
    assert_eq!(gguf.len(), m["files"][variant]["bytes"].as_u64().unwrap());
    for (info, t) in gguf.tensors().iter().zip(tensors) {
        let name = t["name"].as_str().unwrap();
        assert_eq!(info.name, name, "{variant}: tensor order");
        let dims: Vec<u64> = t["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(info.dims, dims, "{variant}: dims of {name}");
        let ty = GgmlType::from_name(t[variant].as_str().unwrap()).unwrap();
        assert_eq!(info.ty, ty, "{variant}: type of {name}");
        let view = gguf.view(info);
        let bytes: Vec<u8> = if ty == GgmlType::I32 {
            view.data.to_vec()
        } else {
            let v = quant::dequantize_to_vec(ty, view.data, info.n_elements() as usize).unwrap();
            v.iter().flat_map(|x| x.to_le_bytes()).collect()
        };
        let got = format!("{:x}", Sha256::digest(&bytes));
        let want = t["f32_sha256"][weights].as_str().unwrap();
        assert_eq!(got, want, "{variant}: dequantized values of {name} ({ty})");
    }
}

#[test]
fn tiny_q2_dequantizes_exactly() {
    check_file("q2", "q2");
}

#[test]
fn tiny_q4_dequantizes_exactly() {
    check_file("q4", "q4");
}

#[test]
fn tiny_plain_holds_the_q2_values() {
    check_file("plain", "q2");
}

#[test]
fn tiny_metadata_reads() {
    let gguf = GgufFile::open(fixtures().join("tiny-q2.gguf")).unwrap();
    assert_eq!(gguf.get_str("general.architecture"), Some("deepseek4"));
    assert_eq!(gguf.alignment(), 32);
    let ratios = gguf.get("deepseek4.attention.compress_ratios").unwrap();
    let (_, items) = ratios.as_array().unwrap();
    let r: Vec<i64> = items.iter().map(|v| v.as_i64().unwrap()).collect();
    assert_eq!(r, vec![0, 0, 4, 128, 4, 128, 0]);
    let tokens = gguf
        .get("tokenizer.ggml.tokens")
        .unwrap()
        .as_str_array()
        .unwrap();
    assert_eq!(tokens.len(), 512);
    assert_eq!(tokens[0], "<｜begin▁of▁sentence｜>");
}
