//! GGUF tensor names ↔ the official checkpoint's parameter names (the names of the
//! official `inference/model.py`, which the Hugging Face shards use; the same table
//! as the reference's `deepseek4-quantize.c` and fixtures/tiny/README.md).

/// Whole-model tensors.
const TOP: &[(&str, &str)] = &[
    ("token_embd.weight", "embed.weight"),
    ("output_norm.weight", "norm.weight"),
    ("output.weight", "head.weight"),
    ("output_hc_base.weight", "hc_head_base"),
    ("output_hc_fn.weight", "hc_head_fn"),
    ("output_hc_scale.weight", "hc_head_scale"),
];

/// Per-layer tensors: `blk.N.<gguf>` ↔ `layers.N.<official>`.
const LAYER: &[(&str, &str)] = &[
    ("hc_attn_base.weight", "hc_attn_base"),
    ("hc_attn_fn.weight", "hc_attn_fn"),
    ("hc_attn_scale.weight", "hc_attn_scale"),
    ("hc_ffn_base.weight", "hc_ffn_base"),
    ("hc_ffn_fn.weight", "hc_ffn_fn"),
    ("hc_ffn_scale.weight", "hc_ffn_scale"),
    ("attn_sinks.weight", "attn.attn_sink"),
    ("attn_q_a.weight", "attn.wq_a.weight"),
    ("attn_q_b.weight", "attn.wq_b.weight"),
    ("attn_q_a_norm.weight", "attn.q_norm.weight"),
    ("attn_kv.weight", "attn.wkv.weight"),
    ("attn_kv_a_norm.weight", "attn.kv_norm.weight"),
    ("attn_output_a.weight", "attn.wo_a.weight"),
    ("attn_output_b.weight", "attn.wo_b.weight"),
    ("attn_compressor_ape.weight", "attn.compressor.ape"),
    ("attn_compressor_kv.weight", "attn.compressor.wkv.weight"),
    (
        "attn_compressor_gate.weight",
        "attn.compressor.wgate.weight",
    ),
    ("attn_compressor_norm.weight", "attn.compressor.norm.weight"),
    ("indexer.attn_q_b.weight", "attn.indexer.wq_b.weight"),
    ("indexer.proj.weight", "attn.indexer.weights_proj.weight"),
    (
        "indexer_compressor_ape.weight",
        "attn.indexer.compressor.ape",
    ),
    (
        "indexer_compressor_kv.weight",
        "attn.indexer.compressor.wkv.weight",
    ),
    (
        "indexer_compressor_gate.weight",
        "attn.indexer.compressor.wgate.weight",
    ),
    (
        "indexer_compressor_norm.weight",
        "attn.indexer.compressor.norm.weight",
    ),
    ("attn_norm.weight", "attn_norm.weight"),
    ("ffn_norm.weight", "ffn_norm.weight"),
    ("ffn_gate_shexp.weight", "ffn.shared_experts.w1.weight"),
    ("ffn_up_shexp.weight", "ffn.shared_experts.w3.weight"),
    ("ffn_down_shexp.weight", "ffn.shared_experts.w2.weight"),
    ("ffn_gate_inp.weight", "ffn.gate.weight"),
    ("exp_probs_b.bias", "ffn.gate.bias"),
    ("ffn_gate_tid2eid.weight", "ffn.gate.tid2eid"),
];

/// The routed-expert stacks: GGUF part → official `w1`/`w3`/`w2`.
const EXPERTS: &[(&str, &str)] = &[
    ("ffn_gate_exps.weight", "w1"),
    ("ffn_up_exps.weight", "w3"),
    ("ffn_down_exps.weight", "w2"),
];

/// Where a GGUF tensor comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// One checkpoint tensor (plus its `.scale` when FP8).
    Tensor(String),
    /// A routed-expert stack: `layers.L.ffn.experts.E.<part>.weight` for each E.
    Experts { layer: usize, part: &'static str },
}

/// `blk.N.rest` → (N, rest).
pub fn split_layer(gguf: &str) -> Option<(usize, &str)> {
    let rest = gguf.strip_prefix("blk.")?;
    let (n, rest) = rest.split_once('.')?;
    Some((n.parse().ok()?, rest))
}

/// The source of GGUF tensor `gguf`, or `None` for a name outside the DS4 layout.
pub fn source(gguf: &str) -> Option<Source> {
    if let Some(&(_, hf)) = TOP.iter().find(|(g, _)| *g == gguf) {
        return Some(Source::Tensor(hf.into()));
    }
    let (layer, rest) = split_layer(gguf)?;
    if let Some(&(_, part)) = EXPERTS.iter().find(|(g, _)| *g == rest) {
        return Some(Source::Experts { layer, part });
    }
    let &(_, hf) = LAYER.iter().find(|(g, _)| *g == rest)?;
    Some(Source::Tensor(format!("layers.{layer}.{hf}")))
}

/// Expert `e`'s weight of a stack.
pub fn expert_name(layer: usize, e: usize, part: &str) -> String {
    format!("layers.{layer}.ffn.experts.{e}.{part}.weight")
}

/// The scale tensor of an FP8/FP4 weight: `X.weight` → `X.scale` (the official name),
/// or `X.weight_scale_inv` (the DeepSeek V3 convention, accepted as well).
pub fn scale_names(weight: &str) -> [String; 2] {
    let stem = weight.strip_suffix(".weight").unwrap_or(weight);
    [format!("{stem}.scale"), format!("{stem}.weight_scale_inv")]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_official_parameters() {
        assert_eq!(
            source("blk.7.attn_kv.weight"),
            Some(Source::Tensor("layers.7.attn.wkv.weight".into()))
        );
        assert_eq!(
            source("blk.0.attn_sinks.weight"),
            Some(Source::Tensor("layers.0.attn.attn_sink".into()))
        );
        assert_eq!(
            source("blk.3.exp_probs_b.bias"),
            Some(Source::Tensor("layers.3.ffn.gate.bias".into()))
        );
        assert_eq!(
            source("blk.42.ffn_down_exps.weight"),
            Some(Source::Experts {
                layer: 42,
                part: "w2"
            })
        );
        assert_eq!(
            source("output.weight"),
            Some(Source::Tensor("head.weight".into()))
        );
        assert_eq!(source("blk.1.nonsense.weight"), None);
        assert_eq!(expert_name(2, 5, "w3"), "layers.2.ffn.experts.5.w3.weight");
        assert_eq!(
            scale_names("layers.0.attn.wq_a.weight")[0],
            "layers.0.attn.wq_a.scale"
        );
    }

    #[test]
    fn every_layout_tensor_has_a_source() {
        use ds4_engine::dev::layout::expected_tensors;
        use ds4_engine::dev::{Config, ExpertQuant};
        for s in expected_tensors(&Config::flash(), ExpertQuant::Q2) {
            assert!(source(&s.name).is_some(), "{}", s.name);
        }
    }
}
