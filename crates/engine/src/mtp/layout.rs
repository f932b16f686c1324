//! The tensor layout of an MTP GGUF (architecture.md §2.5): one block `mtp.0.*` whose
//! per-layer tensors are those of a ratio-0, top-k routed main layer (same dims, taken
//! from the main layout table so the two cannot drift apart), plus the draft-specific
//! projections, norms and HC head. The embedding and `output` come from the main file.

use ds4_gguf::{GgmlType, GgufFile};

use crate::config::Config;
use crate::layout::{
    block_name, check_specs, expected_tensors, layer_name, ExpertQuant, LayoutIssue, Role,
    TensorSpec,
};

/// Prefix of every tensor of the block.
pub const MTP_PREFIX: &str = "mtp.0.";

/// A tensor every MTP file has (the draft's embedding projection).
pub const MTP_MARKER: &str = "mtp.0.e_proj.weight";

/// `mtp.0.NAME.weight` (`.bias` for `exp_probs_b`), like [`layer_name`].
pub fn mtp_name(name: &str) -> String {
    block_name(MTP_PREFIX, name)
}

/// The MTP tensor table for a main model with config `cfg`, in file order: the block's
/// layer tensors, then e_proj, h_proj, enorm, hnorm, norm and the HC head. `experts`
/// picks the published type of the routed experts (the shipped file is Q4_K).
pub fn mtp_tensors(cfg: &Config, experts: ExpertQuant) -> Vec<TensorSpec> {
    use GgmlType::*;
    // A one-layer config whose layer 0 is ratio 0 and top-k routed: exactly the block.
    let mut one = cfg.clone();
    one.n_layer = 1;
    one.compress_ratios = vec![0];
    one.swiglu_clamp = vec![cfg.swiglu_clamp.first().copied().unwrap_or(0.0)];
    one.swiglu_clamp_shexp = vec![cfg.swiglu_clamp_shexp.first().copied().unwrap_or(0.0)];
    one.n_hash_layer = 0;
    let blk = layer_name(0, "");
    let blk = &blk[..blk.len() - ".weight".len()]; // "blk.0."
    let mut out: Vec<TensorSpec> = expected_tensors(&one, experts)
        .into_iter()
        .filter_map(|mut s| {
            let rest = s.name.strip_prefix(blk)?.to_string();
            s.name = format!("{MTP_PREFIX}{rest}");
            // The block always routes with the bias (§2.5: required).
            s.optional = false;
            // The shipped file stores the HC mix weights as F32.
            if rest.starts_with("hc_") && rest.contains("_fn") {
                s.published = F32;
            }
            Some(s)
        })
        .collect();
    let e = cfg.n_embd as u64;
    let mut push = |name: &str, dims: &[u64], role: Role, published: GgmlType| {
        out.push(TensorSpec {
            name: mtp_name(name),
            dims: dims.to_vec(),
            role,
            published,
            optional: false,
        })
    };
    push("e_proj", &[e, e], Role::Matrix, Q8_0);
    push("h_proj", &[e, e], Role::Matrix, Q8_0);
    push("enorm", &[e], Role::Vector, F32);
    push("hnorm", &[e], Role::Vector, F32);
    push("norm", &[e], Role::Vector, F32);
    let nhc = cfg.n_hc as u64;
    push("hc_head_fn", &[nhc * e, nhc], Role::Matrix, F32);
    push("hc_head_scale", &[1], Role::Vector, F32);
    push("hc_head_base", &[nhc], Role::Vector, F32);
    out
}

/// Why `gguf` is not an MTP file at all (`None` if it has any `mtp.0.*` tensor; what
/// such a file lacks is then reported tensor by tensor).
pub fn not_mtp_reason(gguf: &GgufFile) -> Option<String> {
    if gguf
        .tensors()
        .iter()
        .any(|t| t.name.starts_with(MTP_PREFIX))
    {
        return None;
    }
    Some(if gguf.tensor_info("token_embd.weight").is_some() {
        "it has token_embd.weight and no mtp.0.* tensor: this is a main model GGUF, not the MTP GGUF".into()
    } else {
        "it has no mtp.0.* tensor".into()
    })
}

/// Compares an MTP file's tensor table with the layout the main model's `cfg`
/// implies. Unlike [`crate::layout::check_layout`], unexpected tensors are fatal here
/// (returned as `Missing`-free [`LayoutIssue::Unexpected`]; see [`is_fatal_for_mtp`]),
/// since a stray tensor means the file was made for another layout.
pub fn check_mtp_layout(cfg: &Config, gguf: &GgufFile) -> Vec<LayoutIssue> {
    let specs = mtp_tensors(cfg, ExpertQuant::Q4);
    let gate_up = (
        cfg.n_layer,
        mtp_name("ffn_gate_exps"),
        mtp_name("ffn_up_exps"),
    );
    // §2.5: hc_*_fn, hc_head_fn and ffn_gate_inp may be F16 or F32.
    let published = |spec: &TensorSpec, ty: GgmlType| {
        let either = (spec.name.contains("hc_") && spec.name.contains("_fn"))
            || spec.name.ends_with("ffn_gate_inp.weight");
        if either && matches!(ty, GgmlType::F16 | GgmlType::F32) {
            ty
        } else {
            spec.published
        }
    };
    check_specs(&specs, gguf, published, std::iter::once(gate_up))
}

/// Whether an issue of [`check_mtp_layout`] prevents loading: the fatal ones of the
/// main layout, and also unexpected tensors.
pub fn is_fatal_for_mtp(issue: &LayoutIssue) -> bool {
    issue.is_fatal() || matches!(issue, LayoutIssue::Unexpected { .. })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::tensor_data_bytes;

    #[test]
    fn flash_mtp_layout_matches_the_shipped_file() {
        let specs = mtp_tensors(&Config::flash(), ExpertQuant::Q4);
        let find = |n: &str| specs.iter().find(|s| s.name == n).unwrap();
        assert_eq!(find("mtp.0.e_proj.weight").dims, vec![4096, 4096]);
        assert_eq!(find("mtp.0.e_proj.weight").published, GgmlType::Q8_0);
        assert_eq!(find("mtp.0.hc_head_fn.weight").dims, vec![16384, 4]);
        assert_eq!(find("mtp.0.hc_attn_fn.weight").dims, vec![16384, 24]);
        assert!(!find("mtp.0.exp_probs_b.bias").optional);
        assert_eq!(find("mtp.0.ffn_down_exps.weight").published, GgmlType::Q4_K);
        for s in &specs {
            assert!(s.name.starts_with(MTP_PREFIX), "{}", s.name);
            assert!(!s.name.contains("compressor") && !s.name.contains("indexer"));
            assert!(!s.name.contains("tid2eid"));
        }
        // "about 3.55 GiB" (architecture.md §2.5) for the MTP-Q4K-Q8_0-F32 file.
        let gib = tensor_data_bytes(&specs) as f64 / (1u64 << 30) as f64;
        assert!((3.5..3.6).contains(&gib), "{gib} GiB");
    }
}
