//! The tensor layout of a DeepSeek V4 GGUF for a given [`Config`]: names, dims and the
//! types the published files use. One table serves weight binding, `inspect`'s
//! profile check and the synthetic-model writer.

use ds4_gguf::{GgmlType, GgufFile, Value, ValueType};

use crate::config::Config;

/// Which routed-expert encoding a file uses (the published variants differ only here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertQuant {
    /// gate/up IQ2_XXS, down Q2_K (the 81 GB file).
    Q2,
    /// gate/up/down Q4_K (the 153 GB file).
    Q4,
    /// Plain F32 experts (tests only; no published file).
    F32,
}

impl ExpertQuant {
    pub fn gate_up(self) -> GgmlType {
        match self {
            ExpertQuant::Q2 => GgmlType::IQ2_XXS,
            ExpertQuant::Q4 => GgmlType::Q4_K,
            ExpertQuant::F32 => GgmlType::F32,
        }
    }
    pub fn down(self) -> GgmlType {
        match self {
            ExpertQuant::Q2 => GgmlType::Q2_K,
            ExpertQuant::Q4 => GgmlType::Q4_K,
            ExpertQuant::F32 => GgmlType::F32,
        }
    }
}

/// What a tensor is for; decides which types are acceptable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A matrix multiplied with activations (Q8_0 or F16 in the published files).
    Matrix,
    /// A routed-expert stack (IQ2_XXS / Q2_K / Q4_K in the published files).
    ExpertGateUp,
    ExpertDown,
    /// Small f32 vectors: norms, scales, bases, sinks, biases.
    Vector,
    /// The hash-routing table.
    TokenTable,
}

/// One expected tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub role: Role,
    /// The type of the published files (experts: per [`ExpertQuant`]).
    pub published: GgmlType,
    /// `exp_probs_b` may be absent.
    pub optional: bool,
}

impl TensorSpec {
    /// Types the CPU and GPU kernels accept for this tensor.
    pub fn accepts(&self, ty: GgmlType) -> bool {
        use GgmlType::*;
        match self.role {
            Role::Matrix => matches!(ty, Q8_0 | F16 | BF16 | F32),
            Role::ExpertGateUp | Role::ExpertDown => {
                matches!(ty, IQ2_XXS | Q2_K | Q4_K | Q8_0 | F16 | F32)
            }
            Role::Vector => matches!(ty, F32 | F16),
            Role::TokenTable => ty == I32,
        }
    }
}

/// `blk.IL.NAME.weight` (`.bias` for `exp_probs_b`).
pub fn layer_name(il: usize, name: &str) -> String {
    block_name(&format!("blk.{il}."), name)
}

/// `PREFIX` `NAME.weight`, or `NAME.bias` for `exp_probs_b` (the only bias): the file
/// name of a block tensor (main layers, the MTP block).
pub fn block_name(prefix: &str, name: &str) -> String {
    let suffix = if name == "exp_probs_b" {
        "bias"
    } else {
        "weight"
    };
    format!("{prefix}{name}.{suffix}")
}

/// The complete tensor table in file order: `token_embd`, each layer, then the head.
pub fn expected_tensors(cfg: &Config, experts: ExpertQuant) -> Vec<TensorSpec> {
    use GgmlType::*;
    let e = cfg.n_embd as u64;
    let hc = (cfg.n_hc * cfg.n_embd) as u64;
    let mix = cfg.hc_mix() as u64;
    let hd = cfg.head_dim as u64;
    let ql = cfg.q_lora_rank as u64;
    let ff = cfg.n_ff_exp as u64;
    let ne = cfg.n_expert as u64;
    let sh = (cfg.n_ff_exp * cfg.n_expert_shared) as u64;
    let idx_q = (cfg.idx_heads * cfg.idx_head_dim) as u64;
    let idx_d = cfg.idx_head_dim as u64;
    let group_in = (cfg.q_dim() / cfg.o_groups) as u64;
    let low = (cfg.o_groups * cfg.o_lora_rank) as u64;

    let mut out = Vec::new();
    let mut push = |name: String, dims: &[u64], role: Role, published: GgmlType, optional: bool| {
        out.push(TensorSpec {
            name,
            dims: dims.to_vec(),
            role,
            published,
            optional,
        })
    };
    push(
        "token_embd.weight".into(),
        &[e, cfg.vocab as u64],
        Role::Matrix,
        F16,
        false,
    );
    for il in 0..cfg.n_layer {
        let n = |s: &str| layer_name(il, s);
        let ratio = cfg.compress_ratios[il] as u64;
        let lanes = Config::compressor_lanes(ratio as usize) as u64;
        push(n("hc_attn_fn"), &[hc, mix], Role::Matrix, F16, false);
        push(n("hc_attn_scale"), &[3], Role::Vector, F32, false);
        push(n("hc_attn_base"), &[mix], Role::Vector, F32, false);
        push(n("attn_norm"), &[e], Role::Vector, F32, false);
        push(n("attn_q_a"), &[e, ql], Role::Matrix, Q8_0, false);
        push(n("attn_q_a_norm"), &[ql], Role::Vector, F32, false);
        push(
            n("attn_q_b"),
            &[ql, cfg.q_dim() as u64],
            Role::Matrix,
            Q8_0,
            false,
        );
        push(n("attn_kv"), &[e, hd], Role::Matrix, Q8_0, false);
        push(n("attn_kv_a_norm"), &[hd], Role::Vector, F32, false);
        push(
            n("attn_sinks"),
            &[cfg.n_head as u64],
            Role::Vector,
            F32,
            false,
        );
        push(
            n("attn_output_a"),
            &[group_in, low],
            Role::Matrix,
            Q8_0,
            false,
        );
        push(n("attn_output_b"), &[low, e], Role::Matrix, Q8_0, false);
        if ratio != 0 {
            push(
                n("attn_compressor_ape"),
                &[lanes * hd, ratio],
                Role::Matrix,
                F16,
                false,
            );
            push(
                n("attn_compressor_kv"),
                &[e, lanes * hd],
                Role::Matrix,
                F16,
                false,
            );
            push(
                n("attn_compressor_gate"),
                &[e, lanes * hd],
                Role::Matrix,
                F16,
                false,
            );
            push(n("attn_compressor_norm"), &[hd], Role::Vector, F32, false);
        }
        if cfg.has_indexer(il) {
            push(
                n("indexer.attn_q_b"),
                &[ql, idx_q],
                Role::Matrix,
                F16,
                false,
            );
            push(
                n("indexer.proj"),
                &[e, cfg.idx_heads as u64],
                Role::Matrix,
                F16,
                false,
            );
            push(
                n("indexer_compressor_ape"),
                &[2 * idx_d, 4],
                Role::Matrix,
                F16,
                false,
            );
            push(
                n("indexer_compressor_kv"),
                &[e, 2 * idx_d],
                Role::Matrix,
                F16,
                false,
            );
            push(
                n("indexer_compressor_gate"),
                &[e, 2 * idx_d],
                Role::Matrix,
                F16,
                false,
            );
            push(
                n("indexer_compressor_norm"),
                &[idx_d],
                Role::Vector,
                F32,
                false,
            );
        }
        push(n("hc_ffn_fn"), &[hc, mix], Role::Matrix, F16, false);
        push(n("hc_ffn_scale"), &[3], Role::Vector, F32, false);
        push(n("hc_ffn_base"), &[mix], Role::Vector, F32, false);
        push(n("ffn_norm"), &[e], Role::Vector, F32, false);
        push(n("ffn_gate_inp"), &[e, ne], Role::Matrix, F16, false);
        let hash = il < cfg.n_hash_layer;
        if !hash {
            push(n("exp_probs_b"), &[ne], Role::Vector, F32, true);
        }
        push(
            n("ffn_gate_exps"),
            &[e, ff, ne],
            Role::ExpertGateUp,
            experts.gate_up(),
            false,
        );
        push(
            n("ffn_up_exps"),
            &[e, ff, ne],
            Role::ExpertGateUp,
            experts.gate_up(),
            false,
        );
        push(
            n("ffn_down_exps"),
            &[ff, e, ne],
            Role::ExpertDown,
            experts.down(),
            false,
        );
        push(n("ffn_gate_shexp"), &[e, sh], Role::Matrix, Q8_0, false);
        push(n("ffn_up_shexp"), &[e, sh], Role::Matrix, Q8_0, false);
        push(n("ffn_down_shexp"), &[sh, e], Role::Matrix, Q8_0, false);
        if hash {
            push(
                n("ffn_gate_tid2eid"),
                &[cfg.n_expert_used as u64, cfg.vocab as u64],
                Role::TokenTable,
                I32,
                false,
            );
        }
    }
    push(
        "output_hc_base.weight".into(),
        &[cfg.n_hc as u64],
        Role::Vector,
        F32,
        false,
    );
    push(
        "output_hc_fn.weight".into(),
        &[hc, cfg.n_hc as u64],
        Role::Matrix,
        F16,
        false,
    );
    push(
        "output_hc_scale.weight".into(),
        &[1],
        Role::Vector,
        F32,
        false,
    );
    push("output_norm.weight".into(), &[e], Role::Vector, F32, false);
    push(
        "output.weight".into(),
        &[e, cfg.vocab as u64],
        Role::Matrix,
        Q8_0,
        false,
    );
    out
}

/// Bytes of tensor data of the published layout (no alignment padding).
pub fn tensor_data_bytes(specs: &[TensorSpec]) -> u64 {
    specs
        .iter()
        .map(|s| {
            s.published
                .bytes_for(s.dims.iter().product())
                .expect("layout sizes are whole blocks")
        })
        .sum()
}

/// One way a file's tensors differ from the expected layout.
#[derive(Clone, Debug, PartialEq)]
pub enum LayoutIssue {
    /// Fatal: the engine cannot run this file.
    Missing {
        name: String,
    },
    WrongDims {
        name: String,
        got: Vec<u64>,
        want: Vec<u64>,
    },
    UnsupportedType {
        name: String,
        got: GgmlType,
    },
    GateUpMismatch {
        layer: usize,
        gate: GgmlType,
        up: GgmlType,
    },
    /// Informational: runs, but differs from the published files.
    NotPublishedType {
        name: String,
        got: GgmlType,
        want: GgmlType,
    },
    Unexpected {
        name: String,
    },
}

impl LayoutIssue {
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            LayoutIssue::NotPublishedType { .. } | LayoutIssue::Unexpected { .. }
        )
    }
}

impl std::fmt::Display for LayoutIssue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayoutIssue::Missing { name } => write!(f, "tensor {name} is missing"),
            LayoutIssue::WrongDims { name, got, want } => {
                write!(f, "tensor {name} has dims {got:?}, expected {want:?}")
            }
            LayoutIssue::UnsupportedType { name, got } => {
                write!(
                    f,
                    "tensor {name} has type {got}, which no kernel supports for this tensor"
                )
            }
            LayoutIssue::GateUpMismatch { layer, gate, up } => {
                write!(
                    f,
                    "layer {layer}: expert gate is {gate} but up is {up}; they must match"
                )
            }
            LayoutIssue::NotPublishedType { name, got, want } => {
                write!(f, "tensor {name} is {got}; the published files use {want}")
            }
            LayoutIssue::Unexpected { name } => write!(f, "tensor {name} is not used by the model"),
        }
    }
}

/// Compares a file's tensor table with the layout its config implies. The expert
/// reference types are taken from the file itself (layer by layer, since mixed q2/q4
/// files exist), so a q4 expert in a q2 file is not reported.
pub fn check_layout(cfg: &Config, gguf: &GgufFile) -> Vec<LayoutIssue> {
    let specs = expected_tensors(cfg, ExpertQuant::Q2);
    let gate_up = (0..cfg.n_layer).map(|il| {
        let name = |s| layer_name(il, s);
        (il, name("ffn_gate_exps"), name("ffn_up_exps"))
    });
    check_specs(&specs, gguf, |spec, _| spec.published, gate_up)
}

/// The type the published files use for `spec`'s tensor, given the file's `ty`:
/// experts may be the q2 or the q4 encoding, everything else has one type.
pub(crate) fn published_type(spec: &TensorSpec, ty: GgmlType) -> bool {
    match spec.role {
        Role::ExpertGateUp => matches!(ty, GgmlType::IQ2_XXS | GgmlType::Q4_K),
        Role::ExpertDown => matches!(ty, GgmlType::Q2_K | GgmlType::Q4_K),
        _ => ty == spec.published,
    }
}

/// Checks a tensor table against `specs`: every non-optional spec present, its dims,
/// a supported type and a published one (experts by [`published_type`], the rest
/// against `published(spec, ty)`, the type the published files use when the file has
/// `ty`); the gate and up experts of each `(layer, gate, up)` of one type; no tensor
/// that no spec names.
pub(crate) fn check_specs(
    specs: &[TensorSpec],
    gguf: &GgufFile,
    published: impl Fn(&TensorSpec, GgmlType) -> GgmlType,
    gate_up: impl Iterator<Item = (usize, String, String)>,
) -> Vec<LayoutIssue> {
    let mut issues = Vec::new();
    for spec in specs {
        let Some(info) = gguf.tensor_info(&spec.name) else {
            if !spec.optional {
                issues.push(LayoutIssue::Missing {
                    name: spec.name.clone(),
                });
            }
            continue;
        };
        if info.dims != spec.dims {
            issues.push(LayoutIssue::WrongDims {
                name: spec.name.clone(),
                got: info.dims.clone(),
                want: spec.dims.clone(),
            });
        }
        if !spec.accepts(info.ty) {
            issues.push(LayoutIssue::UnsupportedType {
                name: spec.name.clone(),
                got: info.ty,
            });
            continue;
        }
        let want = published(spec, info.ty);
        let ok = match spec.role {
            Role::ExpertGateUp | Role::ExpertDown => published_type(spec, info.ty),
            _ => info.ty == want,
        };
        if !ok {
            issues.push(LayoutIssue::NotPublishedType {
                name: spec.name.clone(),
                got: info.ty,
                want,
            });
        }
    }
    for (layer, gate, up) in gate_up {
        let ty = |n: &str| gguf.tensor_info(n).map(|t| t.ty);
        if let (Some(gate), Some(up)) = (ty(&gate), ty(&up)) {
            if gate != up {
                issues.push(LayoutIssue::GateUpMismatch { layer, gate, up });
            }
        }
    }
    let known: std::collections::HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    for t in gguf.tensors() {
        if !known.contains(t.name.as_str()) {
            issues.push(LayoutIssue::Unexpected {
                name: t.name.clone(),
            });
        }
    }
    issues
}

/// The `deepseek4.*` metadata of a file with this config, as the published files
/// carry it (used by the synthetic-model writer).
pub fn metadata(cfg: &Config) -> Vec<(String, Value)> {
    let u = |v: usize| Value::U32(v as u32);
    let k = |s: &str| format!("deepseek4.{s}");
    let mut ratios: Vec<i32> = cfg.compress_ratios.iter().map(|&r| r as i32).collect();
    ratios.push(0); // the MTP block, as in the official config
    vec![
        (
            k("context_length"),
            Value::U32(cfg.context_length.unwrap_or(1 << 20).min(u32::MAX as u64) as u32),
        ),
        (k("block_count"), u(cfg.n_layer)),
        (k("embedding_length"), u(cfg.n_embd)),
        (k("vocab_size"), u(cfg.vocab)),
        (k("attention.head_count"), u(cfg.n_head)),
        (k("attention.head_count_kv"), u(cfg.n_head_kv)),
        (k("attention.key_length"), u(cfg.head_dim)),
        (k("attention.value_length"), u(cfg.head_dim)),
        (k("rope.dimension_count"), u(cfg.rope_dim)),
        (k("attention.q_lora_rank"), u(cfg.q_lora_rank)),
        (k("attention.output_lora_rank"), u(cfg.o_lora_rank)),
        (k("attention.output_group_count"), u(cfg.o_groups)),
        (k("expert_count"), u(cfg.n_expert)),
        (k("expert_used_count"), u(cfg.n_expert_used)),
        (k("expert_feed_forward_length"), u(cfg.n_ff_exp)),
        (k("expert_shared_count"), u(cfg.n_expert_shared)),
        (k("hash_layer_count"), u(cfg.n_hash_layer)),
        (k("expert_gating_func"), Value::U32(4)),
        (
            k("expert_weights_scale"),
            Value::F32(cfg.expert_weights_scale),
        ),
        (
            k("expert_weights_norm"),
            Value::Bool(cfg.expert_weights_norm),
        ),
        (k("attention.sliding_window"), u(cfg.window)),
        (k("attention.indexer.head_count"), u(cfg.idx_heads)),
        (k("attention.indexer.key_length"), u(cfg.idx_head_dim)),
        (k("attention.indexer.top_k"), u(cfg.idx_topk)),
        (k("attention.compress_ratios"), Value::i32_array(&ratios)),
        (
            k("attention.compress_rope_freq_base"),
            Value::F32(cfg.compress_rope_freq_base),
        ),
        (k("hyper_connection.count"), u(cfg.n_hc)),
        (
            k("hyper_connection.sinkhorn_iterations"),
            u(cfg.sinkhorn_iters),
        ),
        (k("hyper_connection.epsilon"), Value::F32(cfg.hc_eps)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_eps),
        ),
        (k("swiglu_clamp_exp"), Value::f32_array(&cfg.swiglu_clamp)),
        (
            k("swiglu_clamp_shexp"),
            Value::f32_array(&cfg.swiglu_clamp_shexp),
        ),
        (k("rope.freq_base"), Value::F32(cfg.rope_freq_base)),
        (k("rope.scaling.type"), Value::String("yarn".into())),
        (
            k("rope.scaling.factor"),
            Value::F32(cfg.rope_scaling_factor),
        ),
        (
            k("rope.scaling.original_context_length"),
            Value::U32(cfg.rope_orig_ctx as u32),
        ),
        (
            k("rope.scaling.yarn_beta_fast"),
            Value::F32(cfg.yarn_beta_fast),
        ),
        (
            k("rope.scaling.yarn_beta_slow"),
            Value::F32(cfg.yarn_beta_slow),
        ),
    ]
}

/// An empty string array (typed), for metadata placeholders.
pub fn empty_string_array() -> Value {
    Value::Array(ValueType::String, Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_layout_matches_the_published_files() {
        let cfg = Config::flash();
        let q2 = expected_tensors(&cfg, ExpertQuant::Q2);
        assert_eq!(q2.len(), 1328);
        assert_eq!(tensor_data_bytes(&q2), 86_714_775_900);
        let q4 = expected_tensors(&cfg, ExpertQuant::Q4);
        assert_eq!(tensor_data_bytes(&q4), 164_628_167_004);
        let embd = &q2[0];
        assert_eq!(embd.name, "token_embd.weight");
        assert_eq!(embd.dims, vec![4096, 129_280]);
        let ape = q2
            .iter()
            .find(|s| s.name == "blk.2.attn_compressor_ape.weight")
            .unwrap();
        assert_eq!(ape.dims, vec![1024, 4]);
        let ape = q2
            .iter()
            .find(|s| s.name == "blk.3.attn_compressor_ape.weight")
            .unwrap();
        assert_eq!(ape.dims, vec![512, 128]);
        assert_eq!(cfg.profile_deviations(), Vec::<String>::new());
    }
}
