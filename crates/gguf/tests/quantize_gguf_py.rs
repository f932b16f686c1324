//! Our Q8_0 weight quantiser against the `gguf` PyPI package's (gguf 0.19.0, numpy;
//! its `Q8_0.quantize_blocks` is "bit-exact with ggml-quants.c"): eight fixed blocks
//! (ordinary, tiny, zero, constant, rounding ties, large, an f16-subnormal scale, a
//! single spike) quantised by the package, stored in tests/golden/q8_0_quantize_gguf_py.json
//! (`x` and the package's bytes, with provenance). The package has no Q2_K, Q4_K or
//! IQ2_XXS quantiser; their dequantisers are checked bit for bit in python_gguf.rs.

use ds4_gguf::{quant, GgmlType};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn q8_0_quantiser_equals_the_gguf_package() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/golden/q8_0_quantize_gguf_py.json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let x: Vec<f32> = hex(v["x_f32_le_hex"].as_str().unwrap())
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let want = hex(v["q8_0_hex"].as_str().unwrap());
    assert_eq!(x.len(), 256);
    let got = quant::quantize_weights(GgmlType::Q8_0, &x).unwrap();
    for (b, (g, w)) in got.chunks(34).zip(want.chunks(34)).enumerate() {
        assert_eq!(g, w, "block {b}");
    }
}
