//! Writes the small, valid GGUF files that seed the `gguf_parse` fuzz target
//! (`cargo run -p ds4-gguf --example fuzz_seeds -- fuzz/seeds`). The vendored tiny
//! fixtures are megabytes; the fuzzer mutates small inputs far faster.

use ds4_gguf::{GgmlType, GgufWriter, Value, ValueType};

fn file(build: impl FnOnce(&mut GgufWriter)) -> Vec<u8> {
    let mut w = GgufWriter::new();
    build(&mut w);
    let mut out = Vec::new();
    w.write_to(&mut out, |i, buf| {
        let n = w_size(&w, i);
        buf.extend((0..n).map(|k| (k as u8).wrapping_mul(37).wrapping_add(i as u8)));
        Ok(())
    })
    .expect("seed file");
    out
}

fn w_size(w: &GgufWriter, i: usize) -> u64 {
    w.layout().tensor_sizes[i]
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "fuzz/seeds".into());
    std::fs::create_dir_all(&dir).unwrap();
    let seeds: Vec<(&str, Vec<u8>)> = vec![
        ("empty.gguf", file(|_| {})),
        (
            "metadata.gguf",
            file(|w| {
                w.add("general.architecture", Value::String("deepseek4".into()))
                    .unwrap();
                w.add("a.u8", Value::U8(7)).unwrap();
                w.add("a.i16", Value::I16(-3)).unwrap();
                w.add("a.f64", Value::F64(1.5)).unwrap();
                w.add("a.bool", Value::Bool(true)).unwrap();
                w.add("a.strs", Value::string_array(&["x", "yz", ""]))
                    .unwrap();
                w.add(
                    "a.nested",
                    Value::Array(
                        ValueType::Array,
                        vec![Value::i32_array(&[1, 2]), Value::i32_array(&[])],
                    ),
                )
                .unwrap();
            }),
        ),
        (
            "tensors.gguf",
            file(|w| {
                w.add("general.alignment", Value::U32(64)).unwrap();
                w.add_tensor("f32", &[4, 2], GgmlType::F32).unwrap();
                w.add_tensor("f16", &[8], GgmlType::F16).unwrap();
                w.add_tensor("q8_0", &[32, 2], GgmlType::Q8_0).unwrap();
                w.add_tensor("i32", &[3], GgmlType::I32).unwrap();
            }),
        ),
        (
            "kquants.gguf",
            file(|w| {
                w.add_tensor("q2_k", &[256], GgmlType::Q2_K).unwrap();
                w.add_tensor("q4_k", &[256], GgmlType::Q4_K).unwrap();
                w.add_tensor("iq2_xxs", &[256], GgmlType::IQ2_XXS).unwrap();
                w.add_tensor("q8_k", &[256], GgmlType::Q8_K).unwrap();
                w.add_tensor("bf16", &[2, 2, 2], GgmlType::BF16).unwrap();
            }),
        ),
    ];
    for (name, bytes) in seeds {
        let path = std::path::Path::new(&dir).join(name);
        std::fs::write(&path, &bytes).unwrap();
        println!("{} ({} bytes)", path.display(), bytes.len());
    }
}
