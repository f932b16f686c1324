//! Model loading: every variant binds, and broken files fail with an error that
//! names the tensor and what was expected.

mod common;

use std::sync::Arc;

use common::*;
use ds4_engine::dev::{LoadOptions, Model};
use ds4_engine::{EngineError, Numerics};
use ds4_gguf::{GgmlType, GgufFile, GgufWriter};

#[test]
fn all_variants_load_with_their_own_types() {
    for (v, exp) in [
        ("q2", GgmlType::IQ2_XXS),
        ("q4", GgmlType::Q4_K),
        ("plain", GgmlType::IQ2_XXS),
    ] {
        let m = load(v, Numerics::Exact);
        let l = &m.weights().layers[3];
        assert_eq!(l.gate_exps.ty, exp, "{v}");
        let dense = if v == "plain" {
            GgmlType::F32
        } else {
            GgmlType::Q8_0
        };
        assert_eq!(l.q_a.ty, dense, "{v}");
        assert!(l.exp_probs_b.is_some());
        assert!(m.weights().layers[0].tid2eid.is_some());
        assert!(m.weights().layers[2].indexer.is_some());
        assert!(m.weights().layers[3].indexer.is_none());
        assert!(m.weights().layers[1].compressor.is_none());
    }
}

/// Rewrites tiny-q2 with `edit` applied to each tensor's (name, dims, type); `None`
/// drops the tensor. Data of changed tensors is zero-filled.
fn rewrite(
    edit: impl Fn(&str, &[u64], GgmlType) -> Option<(Vec<u64>, GgmlType)>,
) -> Result<Model, EngineError> {
    let src = GgufFile::open(dir().join("tiny-q2.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add(k.clone(), v.clone()).unwrap();
    }
    let mut kept = Vec::new();
    for t in src.tensors() {
        if let Some((dims, ty)) = edit(&t.name, &t.dims, t.ty) {
            let same = dims == t.dims && ty == t.ty;
            w.add_tensor(t.name.clone(), &dims, ty).unwrap();
            let n: u64 = dims.iter().product();
            kept.push((t.clone(), same, ty.bytes_for(n).unwrap() as usize));
        }
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes, |i, buf| {
        let (info, same, size) = &kept[i];
        if *same {
            buf.extend_from_slice(src.view(info).data);
        } else {
            buf.resize(*size, 0);
        }
        Ok(())
    })
    .unwrap();
    let file = GgufFile::from_bytes(bytes).unwrap();
    Model::from_gguf(Arc::new(file), LoadOptions::default())
}

/// [`rewrite`] with only tensor `name` changed, to the (dims, type) `f` gives.
fn rewrite_one(
    name: &str,
    f: impl Fn(&[u64], GgmlType) -> (Vec<u64>, GgmlType),
) -> Result<Model, EngineError> {
    rewrite(|n, d, t| Some(if n == name { f(d, t) } else { (d.to_vec(), t) }))
}

#[test]
fn unchanged_rewrite_loads() {
    rewrite(|_, d, t| Some((d.to_vec(), t))).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let err =
        rewrite(|n, d, t| (n != "blk.2.attn_kv.weight").then(|| (d.to_vec(), t))).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, EngineError::MissingTensor { .. }), "{msg}");
    assert!(msg.contains("blk.2.attn_kv.weight"), "{msg}");
}

#[test]
fn missing_optional_bias_is_fine() {
    let m = rewrite(|n, d, t| (n != "blk.4.exp_probs_b.bias").then(|| (d.to_vec(), t))).unwrap();
    assert!(m.weights().layers[4].exp_probs_b.is_none());
    assert!(m.weights().layers[5].exp_probs_b.is_some());
}

#[test]
fn wrong_type_is_named_with_the_accepted_types() {
    let err =
        rewrite_one("blk.0.attn_q_a.weight", |d, _| (d.to_vec(), GgmlType::Q2_K)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, EngineError::TensorType { .. }), "{msg}");
    assert!(
        msg.contains("blk.0.attn_q_a.weight") && msg.contains("Q8_0"),
        "{msg}"
    );
}

#[test]
fn wrong_dims_are_named() {
    let err = rewrite_one("blk.1.attn_sinks.weight", |_, t| (vec![5], t)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, EngineError::TensorDims { .. }), "{msg}");
    assert!(msg.contains("blk.1.attn_sinks.weight"), "{msg}");
}

#[test]
fn mixed_expert_types_are_rejected() {
    let err = rewrite_one("blk.3.ffn_up_exps.weight", |d, _| {
        (d.to_vec(), GgmlType::Q4_K)
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("blk.3.ffn_up_exps.weight"),
        "{err}"
    );
}
