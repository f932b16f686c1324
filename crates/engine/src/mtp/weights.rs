//! Binding of an MTP GGUF against the main model's config: the block as a
//! [`LayerWeights`] (so the main layer code runs it) plus the draft-specific tensors.

use std::sync::Arc;

use ds4_gguf::GgufFile;

use crate::config::Config;
use crate::error::{EngineError, Result};
use crate::layout::{ExpertQuant, LayoutIssue};
use crate::mtp::layout::{check_mtp_layout, is_fatal_for_mtp, mtp_name, mtp_tensors};
use crate::weights::{Binder, HcWeights, LayerWeights, Mat};

/// The tensors of the MTP block, pointing into the mapped MTP file.
pub struct MtpWeights {
    /// The transformer block: ratio 0, top-k routed with `exp_probs_b`.
    pub layer: LayerWeights,
    /// `[n_embd] → [n_embd]` projection of the normed token embedding.
    pub e_proj: Mat,
    /// `[n_embd] → [n_embd]` projection of each normed incoming HC stream.
    pub h_proj: Mat,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// The head's final norm (replaces the main `output_norm`).
    pub norm: Vec<f32>,
    /// The head's stream collapse (replaces the main `output_hc_*`).
    pub head_hc: HcWeights,
}

/// The layer index the block runs as. ds4 uses 1 (architecture.md §7): a ratio-0 layer
/// whose per-layer tables (SwiGLU clamps) apply; 0 when the model has one layer.
pub fn mtp_layer_index(cfg: &Config) -> usize {
    1.min(cfg.n_layer - 1)
}

impl MtpWeights {
    /// Checks `file` against the layout `cfg` implies and binds it. Every refusal names
    /// the tensor; dims errors give both shapes.
    pub fn bind(cfg: &Config, file: &Arc<GgufFile>) -> Result<MtpWeights> {
        if let Some(why) = crate::mtp::layout::not_mtp_reason(file) {
            return Err(EngineError::NotMtp(why));
        }
        if let Some(issue) = check_mtp_layout(cfg, file)
            .into_iter()
            .find(is_fatal_for_mtp)
        {
            return Err(issue_error(issue));
        }
        let b = Binder::new(file, mtp_tensors(cfg, ExpertQuant::Q4));
        let il = mtp_layer_index(cfg);
        let layer = b.layer(cfg, il, 0, false, &mtp_name)?;
        debug_assert!(layer.exp_probs_b.is_some(), "the layout requires the bias");
        Ok(MtpWeights {
            layer,
            e_proj: b.mat(&mtp_name("e_proj"))?,
            h_proj: b.mat(&mtp_name("h_proj"))?,
            enorm: b.vec(&mtp_name("enorm"))?,
            hnorm: b.vec(&mtp_name("hnorm"))?,
            norm: b.vec(&mtp_name("norm"))?,
            head_hc: b.hc(
                &mtp_name("hc_head_fn"),
                &mtp_name("hc_head_scale"),
                &mtp_name("hc_head_base"),
            )?,
        })
    }
}

fn issue_error(issue: LayoutIssue) -> EngineError {
    match issue {
        LayoutIssue::Missing { name } => EngineError::MissingTensor {
            name,
            expected: "by the MTP block of this model".into(),
        },
        LayoutIssue::WrongDims { name, got, want } => EngineError::TensorDims {
            name,
            got,
            expected: want,
        },
        LayoutIssue::UnsupportedType { name, got } => EngineError::TensorType {
            name,
            got,
            expected: "a type the kernels support for this tensor".into(),
        },
        other => EngineError::TensorData {
            name: match &other {
                LayoutIssue::Unexpected { name } => name.clone(),
                LayoutIssue::GateUpMismatch { .. } => mtp_name("ffn_up_exps"),
                _ => String::new(),
            },
            msg: match &other {
                LayoutIssue::Unexpected { .. } => {
                    "is not part of the MTP block (a file for another layout?)".into()
                }
                _ => other.to_string(),
            },
        },
    }
}
