//! The model hyperparameters of a checkpoint directory: `inference/config.json` (the
//! official `ModelArgs` keys: `dim`, `n_layers`, `moe_inter_dim`, …) or `config.json`
//! (the same keys, or the Hugging Face `transformers` names where they differ). A key
//! that is absent keeps the published DeepSeek V4 Flash value.

use std::path::Path;

use anyhow::{bail, Context, Result};
use ds4_engine::dev::Config;
use serde_json::Value;

/// (official `ModelArgs` key, `transformers` alias).
type Keys = (&'static str, &'static str);

fn get(v: &Value, (a, b): Keys) -> Option<&Value> {
    v.get(a).or_else(|| v.get(b)).filter(|x| !x.is_null())
}

fn usize_key(v: &Value, k: Keys, dst: &mut usize) -> Result<()> {
    if let Some(x) = get(v, k) {
        *dst = x
            .as_u64()
            .with_context(|| format!("config key {} is not an unsigned integer", k.0))?
            as usize;
    }
    Ok(())
}

fn f32_key(v: &Value, k: Keys, dst: &mut f32) -> Result<()> {
    if let Some(x) = get(v, k) {
        *dst = x
            .as_f64()
            .with_context(|| format!("config key {} is not a number", k.0))? as f32;
    }
    Ok(())
}

/// Reads the config of checkpoint `dir`.
pub fn read(dir: &Path) -> Result<Config> {
    for p in [dir.join("inference/config.json"), dir.join("config.json")] {
        if p.exists() {
            let text =
                std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
            let v: Value =
                serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
            return parse(&v).with_context(|| format!("{}", p.display()));
        }
    }
    bail!(
        "{} has no inference/config.json or config.json",
        dir.display()
    )
}

/// The config of one JSON object.
pub fn parse(v: &Value) -> Result<Config> {
    let mut c = Config::flash();
    c.name = Some("DeepSeek-V4-Flash".into());
    usize_key(v, ("vocab_size", "vocab_size"), &mut c.vocab)?;
    usize_key(v, ("dim", "hidden_size"), &mut c.n_embd)?;
    usize_key(v, ("n_layers", "num_hidden_layers"), &mut c.n_layer)?;
    usize_key(
        v,
        ("moe_inter_dim", "moe_intermediate_size"),
        &mut c.n_ff_exp,
    )?;
    usize_key(v, ("n_hash_layers", "num_hash_layers"), &mut c.n_hash_layer)?;
    usize_key(v, ("n_heads", "num_attention_heads"), &mut c.n_head)?;
    usize_key(v, ("n_routed_experts", "n_routed_experts"), &mut c.n_expert)?;
    usize_key(
        v,
        ("n_shared_experts", "n_shared_experts"),
        &mut c.n_expert_shared,
    )?;
    usize_key(
        v,
        ("n_activated_experts", "num_experts_per_tok"),
        &mut c.n_expert_used,
    )?;
    usize_key(v, ("q_lora_rank", "q_lora_rank"), &mut c.q_lora_rank)?;
    usize_key(v, ("head_dim", "head_dim"), &mut c.head_dim)?;
    usize_key(v, ("rope_head_dim", "qk_rope_head_dim"), &mut c.rope_dim)?;
    usize_key(v, ("o_groups", "o_groups"), &mut c.o_groups)?;
    usize_key(v, ("o_lora_rank", "o_lora_rank"), &mut c.o_lora_rank)?;
    usize_key(v, ("window_size", "sliding_window"), &mut c.window)?;
    usize_key(v, ("index_n_heads", "index_n_heads"), &mut c.idx_heads)?;
    usize_key(v, ("index_head_dim", "index_head_dim"), &mut c.idx_head_dim)?;
    usize_key(v, ("index_topk", "index_topk"), &mut c.idx_topk)?;
    usize_key(v, ("hc_mult", "hc_mult"), &mut c.n_hc)?;
    usize_key(
        v,
        ("hc_sinkhorn_iters", "hc_sinkhorn_iters"),
        &mut c.sinkhorn_iters,
    )?;
    let mut orig = c.rope_orig_ctx as usize;
    usize_key(
        v,
        ("original_seq_len", "original_max_position_embeddings"),
        &mut orig,
    )?;
    c.rope_orig_ctx = orig as u64;
    if let Some(n) = get(v, ("max_seq_len", "max_position_embeddings")).and_then(Value::as_u64) {
        c.context_length = Some(n);
    }
    f32_key(
        v,
        ("route_scale", "routed_scaling_factor"),
        &mut c.expert_weights_scale,
    )?;
    f32_key(v, ("rope_theta", "rope_theta"), &mut c.rope_freq_base)?;
    f32_key(
        v,
        ("rope_factor", "rope_factor"),
        &mut c.rope_scaling_factor,
    )?;
    f32_key(v, ("beta_fast", "beta_fast"), &mut c.yarn_beta_fast)?;
    f32_key(v, ("beta_slow", "beta_slow"), &mut c.yarn_beta_slow)?;
    f32_key(
        v,
        ("compress_rope_theta", "compress_rope_theta"),
        &mut c.compress_rope_freq_base,
    )?;
    f32_key(v, ("norm_eps", "rms_norm_eps"), &mut c.rms_eps)?;
    f32_key(v, ("hc_eps", "hc_eps"), &mut c.hc_eps)?;
    let mut limit = 10.0f32;
    f32_key(v, ("swiglu_limit", "swiglu_limit"), &mut limit)?;
    c.swiglu_clamp = vec![limit; c.n_layer];
    c.swiglu_clamp_shexp = vec![limit; c.n_layer];
    c.compress_ratios = match get(v, ("compress_ratios", "compress_ratios")) {
        Some(Value::Array(a)) => {
            let r: Option<Vec<usize>> = a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect();
            let r = r.context("compress_ratios holds a non-integer")?;
            // The official list has one more entry (the MTP block).
            if r.len() < c.n_layer {
                bail!(
                    "compress_ratios has {} entries for {} layers",
                    r.len(),
                    c.n_layer
                );
            }
            r[..c.n_layer].to_vec()
        }
        Some(_) => bail!("compress_ratios is not an array"),
        None => Config::flash_ratios(c.n_layer),
    };
    c.n_hash_layer = c.n_hash_layer.min(c.n_layer);
    if let Some(s) = get(v, ("score_func", "scoring_func")).and_then(Value::as_str) {
        if s != "sqrtsoftplus" {
            bail!("score_func {s:?}: DS4 supports sqrtsoftplus only");
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_official_inference_config_is_flash() {
        // The published inference/config.json (architecture.md §9: 44 ratios, the last
        // one the MTP block's).
        let mut ratios: Vec<usize> = Config::flash_ratios(43);
        ratios.push(0);
        let v = serde_json::json!({
            "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43,
            "n_hash_layers": 3, "n_heads": 64, "n_routed_experts": 256,
            "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
            "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512,
            "rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
            "original_seq_len": 65536, "rope_theta": 10000, "rope_factor": 16,
            "beta_fast": 32, "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128,
            "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "dtype": "fp8",
            "scale_fmt": "ue8m0", "expert_dtype": "fp4", "compress_rope_theta": 160000,
            "compress_ratios": ratios
        });
        let c = parse(&v).unwrap();
        let f = Config::flash();
        assert_eq!(c.compress_ratios, f.compress_ratios);
        assert_eq!(
            (c.n_layer, c.n_embd, c.n_ff_exp, c.window),
            (43, 4096, 2048, 128)
        );
        assert_eq!(c.profile_deviations(), Vec::<String>::new());
        let bad = serde_json::json!({"n_layers": 4, "compress_ratios": [0, 0]});
        assert!(parse(&bad).is_err());
    }
}
