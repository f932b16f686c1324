//! A tiny checkpoint in the official naming, dtypes and scale layout, made from the
//! weights of a DS4 GGUF (the tiny fixtures): the conversion's input in tests, so the
//! whole path (safetensors shards, FP8/FP4 decoding, names, types, metadata) runs
//! without the 160 GB download.
//!
//! Official dtypes (architecture.md §9): FP8 E4M3 with UE8M0 128×128 block scales for
//! the attention projections (wq_a, wq_b, wkv, wo_a, wo_b), the shared experts and the
//! indexer's wq_b; FP4 E2M1 with UE8M0 per-32 scales for the routed experts (packed two
//! per byte as `I8`); F32 for the HC tensors, sinks, APE and the router bias; I64 for
//! tid2eid; BF16 for everything else.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use ds4_engine::dev::layout::expected_tensors;
use ds4_engine::dev::{Config, ExpertQuant};
use ds4_gguf::quant::{dequantize_to_vec, f32_to_bf16};
use ds4_gguf::{GgmlType, GgufFile};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::formats::{encode_fp4, encode_fp8};
use crate::names::{self, Source};

/// How the official checkpoint stores one (non-expert) parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stored {
    Fp8,
    F32,
    Bf16,
    I64,
}

/// The official storage of parameter `hf` (a non-expert name).
pub fn stored(hf: &str) -> Stored {
    const FP8: &[&str] = &[
        "attn.wq_a.weight",
        "attn.wq_b.weight",
        "attn.wkv.weight",
        "attn.wo_a.weight",
        "attn.wo_b.weight",
        "ffn.shared_experts.w1.weight",
        "ffn.shared_experts.w2.weight",
        "ffn.shared_experts.w3.weight",
        "attn.indexer.wq_b.weight",
    ];
    let tail = hf.split_once('.').map_or(hf, |(_, t)| t);
    let tail = tail.split_once('.').map_or(tail, |(_, t)| t); // after "layers.N."
    if FP8.iter().any(|s| hf.ends_with(s) && tail == *s) {
        Stored::Fp8
    } else if hf.ends_with("tid2eid") {
        Stored::I64
    } else if hf.contains("hc_")
        || hf.ends_with("attn_sink")
        || hf.ends_with(".ape")
        || hf.ends_with("gate.bias")
    {
        Stored::F32
    } else {
        Stored::Bf16
    }
}

struct Out {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes `dir/model-0000{1,2}-of-00002.safetensors`, the index, `config.json` (the
/// official `ModelArgs` keys) and, if given, `tokenizer.json`, from the weights of
/// `src` (a DS4 GGUF of config `cfg`).
pub fn write_checkpoint(
    src: &GgufFile,
    cfg: &Config,
    dir: &Path,
    tokenizer: Option<&Path>,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut outs: Vec<Out> = Vec::new();
    for spec in expected_tensors(cfg, ExpertQuant::Q2) {
        let Some(view) = src.tensor(&spec.name) else {
            continue; // an optional tensor the source lacks
        };
        let n: usize = view.dims().iter().product::<u64>() as usize;
        let shape: Vec<usize> = view.dims().iter().rev().map(|&d| d as usize).collect();
        let src_name = spec.name.clone();
        match names::source(&spec.name).context("unmapped tensor")? {
            Source::Experts { layer, part } => {
                let (cols, rows, ne) = (shape[2], shape[1], shape[0]);
                let x = dequantize_to_vec(view.ty(), view.data, n)?;
                for e in 0..ne {
                    let m = &x[e * rows * cols..(e + 1) * rows * cols];
                    let (packed, scales) = encode_fp4(m);
                    let name = names::expert_name(layer, e, part);
                    let [sn, _] = names::scale_names(&name);
                    outs.push(Out {
                        name,
                        dtype: Dtype::I8,
                        shape: vec![rows, cols / 2],
                        data: packed,
                    });
                    outs.push(Out {
                        name: sn,
                        dtype: Dtype::F8_E8M0,
                        shape: vec![rows, cols / 32],
                        data: scales,
                    });
                }
            }
            Source::Tensor(hf) => {
                if view.ty() == GgmlType::I32 {
                    let data = view
                        .data
                        .chunks_exact(4)
                        .flat_map(|c| {
                            (i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).to_le_bytes()
                        })
                        .collect();
                    outs.push(Out {
                        name: hf,
                        dtype: Dtype::I64,
                        shape,
                        data,
                    });
                    continue;
                }
                let x = dequantize_to_vec(view.ty(), view.data, n)
                    .with_context(|| format!("dequantising {src_name}"))?;
                match stored(&hf) {
                    Stored::Fp8 => {
                        let (out, inp) = (shape[0], shape[1]);
                        let (codes, scales) = encode_fp8(&x, out, inp);
                        let [sn, _] = names::scale_names(&hf);
                        outs.push(Out {
                            name: hf,
                            dtype: Dtype::F8_E4M3,
                            shape,
                            data: codes,
                        });
                        outs.push(Out {
                            name: sn,
                            dtype: Dtype::F8_E8M0,
                            shape: vec![out.div_ceil(128), inp.div_ceil(128)],
                            data: scales,
                        });
                    }
                    Stored::F32 => outs.push(Out {
                        name: hf,
                        dtype: Dtype::F32,
                        shape,
                        data: f32_bytes(&x),
                    }),
                    Stored::Bf16 => outs.push(Out {
                        name: hf,
                        dtype: Dtype::BF16,
                        shape,
                        data: x
                            .iter()
                            .flat_map(|v| f32_to_bf16(*v).to_le_bytes())
                            .collect(),
                    }),
                    Stored::I64 => unreachable!("integer tensors are I32 in the GGUF"),
                }
            }
        }
    }
    // Two shards (layers below half in the first), as the real checkpoint has many.
    let half = cfg.n_layer / 2;
    let shard_of = |name: &str| -> usize {
        match name
            .strip_prefix("layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(l) if l >= half => 2,
            _ => 1,
        }
    };
    let mut weight_map = serde_json::Map::new();
    for shard in 1..=2 {
        let file = format!("model-0000{shard}-of-00002.safetensors");
        let mut views = Vec::new();
        for o in outs.iter().filter(|o| shard_of(&o.name) == shard) {
            views.push((
                o.name.clone(),
                TensorView::new(o.dtype, o.shape.clone(), &o.data)?,
            ));
            weight_map.insert(o.name.clone(), serde_json::Value::String(file.clone()));
        }
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        safetensors::serialize_to_file(views, Some(meta), &dir.join(&file))?;
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(&index)?,
    )?;
    let mut ratios: Vec<usize> = cfg.compress_ratios.clone();
    ratios.push(0);
    let config = serde_json::json!({
        "vocab_size": cfg.vocab, "dim": cfg.n_embd, "moe_inter_dim": cfg.n_ff_exp,
        "n_layers": cfg.n_layer, "n_hash_layers": cfg.n_hash_layer, "n_heads": cfg.n_head,
        "n_routed_experts": cfg.n_expert, "n_shared_experts": cfg.n_expert_shared,
        "n_activated_experts": cfg.n_expert_used, "score_func": "sqrtsoftplus",
        "route_scale": cfg.expert_weights_scale, "swiglu_limit": cfg.swiglu_clamp.first().copied().unwrap_or(10.0),
        "q_lora_rank": cfg.q_lora_rank, "head_dim": cfg.head_dim, "rope_head_dim": cfg.rope_dim,
        "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank, "window_size": cfg.window,
        "original_seq_len": cfg.rope_orig_ctx, "rope_theta": cfg.rope_freq_base,
        "rope_factor": cfg.rope_scaling_factor, "beta_fast": cfg.yarn_beta_fast,
        "beta_slow": cfg.yarn_beta_slow, "index_n_heads": cfg.idx_heads,
        "index_head_dim": cfg.idx_head_dim, "index_topk": cfg.idx_topk, "hc_mult": cfg.n_hc,
        "hc_sinkhorn_iters": cfg.sinkhorn_iters, "dtype": "fp8", "scale_fmt": "ue8m0",
        "expert_dtype": "fp4", "compress_rope_theta": cfg.compress_rope_freq_base,
        "compress_ratios": ratios, "norm_eps": cfg.rms_eps, "hc_eps": cfg.hc_eps,
        "max_seq_len": cfg.context_length,
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    if let Some(t) = tokenizer {
        std::fs::copy(t, dir.join("tokenizer.json"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn official_dtypes() {
        assert_eq!(stored("layers.3.attn.wq_a.weight"), Stored::Fp8);
        assert_eq!(stored("layers.3.attn.indexer.wq_b.weight"), Stored::Fp8);
        assert_eq!(stored("layers.3.ffn.shared_experts.w2.weight"), Stored::Fp8);
        assert_eq!(stored("layers.3.attn.compressor.wkv.weight"), Stored::Bf16);
        assert_eq!(
            stored("layers.3.attn.indexer.compressor.wkv.weight"),
            Stored::Bf16
        );
        assert_eq!(stored("layers.3.hc_attn_fn"), Stored::F32);
        assert_eq!(stored("hc_head_scale"), Stored::F32);
        assert_eq!(stored("layers.0.ffn.gate.tid2eid"), Stored::I64);
        assert_eq!(stored("layers.3.ffn.gate.bias"), Stored::F32);
        assert_eq!(stored("layers.3.ffn.gate.weight"), Stored::Bf16);
        assert_eq!(stored("embed.weight"), Stored::Bf16);
        assert_eq!(stored("layers.3.attn.compressor.ape"), Stored::F32);
    }
}
