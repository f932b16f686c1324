//! Weight binding: every tensor the forward pass needs, checked once against the
//! layout table and bound into typed per-layer structs that point into the mmap.
//!
//! Kernels dispatch on each tensor's own type, so mixed files (Q4_K experts spliced
//! into a Q2 file, the all-F32 debug file) need no special cases.

use std::sync::Arc;

use ds4_gguf::quant::dequantize;
use ds4_gguf::{GgmlType, GgufFile};

use crate::config::Config;
use crate::error::{EngineError, Result};
use crate::layout::{expected_tensors, layer_name, ExpertQuant, Role, TensorSpec};

/// A borrowed matrix of `n_out` rows × `n_in` inputs in its stored encoding.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    pub row_bytes: usize,
    pub data: &'a [u8],
}

impl<'a> MatRef<'a> {
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Rows `start..start+n`.
    pub fn rows(&self, start: usize, n: usize) -> MatRef<'a> {
        MatRef {
            n_out: n,
            data: &self.data[start * self.row_bytes..(start + n) * self.row_bytes],
            ..*self
        }
    }

    /// Dequantises row `r` into `out` (`n_in` values, exact for every supported type).
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        dequantize(self.ty, self.row(r), out).expect("row types are checked at load");
    }
}

/// A 2-D weight (or a stack of `n_mat` matrices, for routed experts) in the file.
#[derive(Clone)]
pub struct Mat {
    pub name: String,
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    pub n_mat: usize,
    row_bytes: usize,
    file: Arc<GgufFile>,
    /// Absolute byte range of the tensor in `file.bytes()`.
    start: usize,
    len: usize,
}

impl std::fmt::Debug for Mat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Mat({} {:?} {}x{}x{})",
            self.name, self.ty, self.n_out, self.n_in, self.n_mat
        )
    }
}

impl Mat {
    pub fn data(&self) -> &[u8] {
        &self.file.bytes()[self.start..self.start + self.len]
    }

    /// The whole matrix (or matrix 0 of a stack).
    pub fn view(&self) -> MatRef<'_> {
        self.expert(0)
    }

    /// Matrix `e` of a stack.
    pub fn expert(&self, e: usize) -> MatRef<'_> {
        let per = self.n_out * self.row_bytes;
        MatRef {
            ty: self.ty,
            n_in: self.n_in,
            n_out: self.n_out,
            row_bytes: self.row_bytes,
            data: &self.data()[e * per..(e + 1) * per],
        }
    }

    /// Every value as f32 (for small tensors only).
    pub fn to_f32(&self) -> Vec<f32> {
        let n = self.n_in * self.n_out * self.n_mat;
        let mut v = vec![0.0; n];
        dequantize(self.ty, self.data(), &mut v).expect("checked at load");
        v
    }
}

/// Where a model's tensors live: the host (bound to the mapped file) or a device
/// ([`crate::cuda::weights::Device`]). One field list serves both, so the host and the
/// device layer structs cannot drift apart.
pub trait Storage {
    /// A weight matrix (or expert stack).
    type Mat;
    /// A small f32 vector (norms, biases, position tables).
    type F32s;
    /// A small i32 vector (the hash-routing table).
    type I32s;
}

/// The host storage: matrices borrow the mapped file, vectors are decoded to f32.
#[derive(Clone, Copy, Debug)]
pub struct Host;

impl Storage for Host {
    type Mat = Mat;
    type F32s = Vec<f32>;
    type I32s = Vec<i32>;
}

/// Hyper-connection parameters of one sublayer (or the head).
#[derive(Clone, Debug)]
pub struct Hc<S: Storage> {
    /// The mix weights: hc_mix() rows of n_hc · n_embd.
    pub fn_: S::Mat,
    pub scale: S::F32s,
    pub base: S::F32s,
}

/// A KV compressor (main or indexer).
#[derive(Clone, Debug)]
pub struct Compressor<S: Storage> {
    pub ratio: usize,
    /// 2 for the overlapping ratio-4 compressor, else 1.
    pub lanes: usize,
    /// Output row width (head_dim or idx_head_dim).
    pub dim: usize,
    /// `ape[q·lanes·dim + j]`: position bias of slot q, column j.
    pub ape: S::F32s,
    pub kv: S::Mat,
    pub gate: S::Mat,
    pub norm: S::F32s,
}

pub struct Indexer<S: Storage> {
    pub q_b: S::Mat,
    pub proj: S::Mat,
    pub compressor: Compressor<S>,
}

/// The tensors of one transformer layer.
pub struct Layer<S: Storage> {
    pub il: usize,
    pub ratio: usize,
    pub hc_attn: Hc<S>,
    pub attn_norm: S::F32s,
    pub q_a: S::Mat,
    pub q_a_norm: S::F32s,
    pub q_b: S::Mat,
    pub kv: S::Mat,
    pub kv_norm: S::F32s,
    pub sinks: S::F32s,
    /// `o_groups` blocks of `o_lora_rank` rows (one matrix each on the device).
    pub out_a: S::Mat,
    pub out_b: S::Mat,
    pub compressor: Option<Compressor<S>>,
    pub indexer: Option<Indexer<S>>,
    pub hc_ffn: Hc<S>,
    pub ffn_norm: S::F32s,
    pub gate_inp: S::Mat,
    pub exp_probs_b: Option<S::F32s>,
    /// `tid2eid[token·n_expert_used + k]`.
    pub tid2eid: Option<S::I32s>,
    pub gate_exps: S::Mat,
    pub up_exps: S::Mat,
    pub down_exps: S::Mat,
    pub gate_sh: S::Mat,
    pub up_sh: S::Mat,
    pub down_sh: S::Mat,
}

pub type HcWeights = Hc<Host>;
pub type CompressorWeights = Compressor<Host>;
pub type IndexerWeights = Indexer<Host>;
pub type LayerWeights = Layer<Host>;

impl CompressorWeights {
    pub fn pool(&self) -> crate::ops::compressor::Pool<'_> {
        crate::ops::compressor::Pool {
            ratio: self.ratio,
            lanes: self.lanes,
            dim: self.dim,
            ape: &self.ape,
        }
    }
}

pub struct Weights {
    pub token_embd: Mat,
    pub layers: Vec<LayerWeights>,
    pub head_hc: HcWeights,
    pub output_norm: Vec<f32>,
    pub output: Mat,
}

/// Types whose dequantisation is exact and which the kernels implement.
fn kernel_type_ok(role: Role, ty: GgmlType) -> bool {
    use GgmlType::*;
    match role {
        Role::Matrix => matches!(ty, Q8_0 | F16 | BF16 | F32),
        Role::ExpertGateUp | Role::ExpertDown => {
            matches!(ty, IQ2_XXS | Q2_K | Q4_K | Q8_0 | F16 | BF16 | F32)
        }
        Role::Vector => matches!(ty, F32 | F16 | BF16),
        Role::TokenTable => ty == I32,
    }
}

fn expected_types(role: Role) -> &'static str {
    match role {
        Role::Matrix => "Q8_0, F16, BF16 or F32",
        Role::ExpertGateUp | Role::ExpertDown => "IQ2_XXS, Q2_K, Q4_K, Q8_0, F16, BF16 or F32",
        Role::Vector => "F32, F16 or BF16",
        Role::TokenTable => "I32",
    }
}

/// Binds tensors of `file` checked against `specs` (the main layout, or the MTP
/// block's in [`crate::mtp`]).
pub(crate) struct Binder<'a> {
    file: &'a Arc<GgufFile>,
    specs: std::collections::HashMap<String, TensorSpec>,
}

impl<'a> Binder<'a> {
    pub(crate) fn new(file: &'a Arc<GgufFile>, specs: Vec<TensorSpec>) -> Binder<'a> {
        let specs = specs.into_iter().map(|s| (s.name.clone(), s)).collect();
        Binder { file, specs }
    }

    fn spec(&self, name: &str) -> &TensorSpec {
        self.specs
            .get(name)
            .unwrap_or_else(|| panic!("{name} is not in the layout table"))
    }

    /// Checks presence, dims and type; `None` only for an absent optional tensor.
    fn info(&self, name: &str) -> Result<Option<&ds4_gguf::TensorInfo>> {
        let spec = self.spec(name);
        let Some(info) = self.file.tensor_info(name) else {
            if spec.optional {
                return Ok(None);
            }
            return Err(EngineError::MissingTensor {
                name: name.into(),
                expected: format!("{:?} dims {:?}", spec.published, spec.dims),
            });
        };
        if info.dims != spec.dims {
            return Err(EngineError::TensorDims {
                name: name.into(),
                got: info.dims.clone(),
                expected: spec.dims.clone(),
            });
        }
        if !kernel_type_ok(spec.role, info.ty) {
            return Err(EngineError::TensorType {
                name: name.into(),
                got: info.ty,
                expected: expected_types(spec.role).into(),
            });
        }
        Ok(Some(info))
    }

    pub(crate) fn mat(&self, name: &str) -> Result<Mat> {
        let info = self.info(name)?.expect("matrices are not optional");
        let d = &info.dims;
        let n_in = d[0] as usize;
        let n_out = d.get(1).copied().unwrap_or(1) as usize;
        let n_mat = d.get(2).copied().unwrap_or(1) as usize;
        let row_bytes = info
            .ty
            .row_bytes(n_in)
            .ok_or_else(|| EngineError::TensorData {
                name: name.into(),
                msg: format!("rows of {n_in} do not fill whole {:?} blocks", info.ty),
            })?;
        let start = info.offset as usize;
        let len = info.size as usize;
        if len != row_bytes * n_out * n_mat || start + len > self.file.bytes().len() {
            return Err(EngineError::TensorData {
                name: name.into(),
                msg: "data size does not match dims and type".into(),
            });
        }
        Ok(Mat {
            name: name.into(),
            ty: info.ty,
            n_in,
            n_out,
            n_mat,
            row_bytes,
            file: self.file.clone(),
            start,
            len,
        })
    }

    fn vec_opt(&self, name: &str) -> Result<Option<Vec<f32>>> {
        if self.info(name)?.is_none() {
            return Ok(None);
        }
        let v = self.mat(name)?.to_f32();
        // #18 item 11: one inf/NaN in a norm or scale vector turns every logit into NaN;
        // these vectors are small and read anyway, so the check costs nothing.
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(EngineError::TensorData {
                name: name.to_string(),
                msg: format!("element {i} is {} (must be finite)", v[i]),
            });
        }
        Ok(Some(v))
    }

    pub(crate) fn vec(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.vec_opt(name)?.expect("vectors are not optional"))
    }

    fn i32s(&self, name: &str) -> Result<Vec<i32>> {
        let info = self.info(name)?.expect("tables are not optional");
        let bytes = &self.file.bytes()[info.offset as usize..(info.offset + info.size) as usize];
        Ok(bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    pub(crate) fn hc(&self, fn_: &str, scale: &str, base: &str) -> Result<HcWeights> {
        Ok(HcWeights {
            fn_: self.mat(fn_)?,
            scale: self.vec(scale)?,
            base: self.vec(base)?,
        })
    }

    fn compressor(
        &self,
        name: &dyn Fn(&str) -> String,
        prefix: &str,
        ratio: usize,
        dim: usize,
    ) -> Result<CompressorWeights> {
        let n = |s: &str| name(&format!("{prefix}{s}"));
        Ok(CompressorWeights {
            ratio,
            lanes: Config::compressor_lanes(ratio),
            dim,
            ape: self.mat(&n("ape"))?.to_f32(),
            kv: self.mat(&n("kv"))?,
            gate: self.mat(&n("gate"))?,
            norm: self.vec(&n("norm"))?,
        })
    }

    /// The tensors of layer `il` with compress ratio `ratio`, named by `n` (`blk.N.*`
    /// for the main model, `mtp.0.*` for the MTP block); `hash` layers route by token.
    pub(crate) fn layer(
        &self,
        cfg: &Config,
        il: usize,
        ratio: usize,
        hash: bool,
        n: &dyn Fn(&str) -> String,
    ) -> Result<LayerWeights> {
        let compressor = if ratio != 0 {
            Some(self.compressor(n, "attn_compressor_", ratio, cfg.head_dim)?)
        } else {
            None
        };
        let indexer = if ratio != 0 && cfg.has_indexer(il) {
            Some(IndexerWeights {
                q_b: self.mat(&n("indexer.attn_q_b"))?,
                proj: self.mat(&n("indexer.proj"))?,
                compressor: self.compressor(n, "indexer_compressor_", ratio, cfg.idx_head_dim)?,
            })
        } else {
            None
        };
        let lw = LayerWeights {
            il,
            ratio,
            hc_attn: self.hc(&n("hc_attn_fn"), &n("hc_attn_scale"), &n("hc_attn_base"))?,
            attn_norm: self.vec(&n("attn_norm"))?,
            q_a: self.mat(&n("attn_q_a"))?,
            q_a_norm: self.vec(&n("attn_q_a_norm"))?,
            q_b: self.mat(&n("attn_q_b"))?,
            kv: self.mat(&n("attn_kv"))?,
            kv_norm: self.vec(&n("attn_kv_a_norm"))?,
            sinks: self.vec(&n("attn_sinks"))?,
            out_a: self.mat(&n("attn_output_a"))?,
            out_b: self.mat(&n("attn_output_b"))?,
            compressor,
            indexer,
            hc_ffn: self.hc(&n("hc_ffn_fn"), &n("hc_ffn_scale"), &n("hc_ffn_base"))?,
            ffn_norm: self.vec(&n("ffn_norm"))?,
            gate_inp: self.mat(&n("ffn_gate_inp"))?,
            exp_probs_b: if hash {
                None
            } else {
                self.vec_opt(&n("exp_probs_b"))?
            },
            tid2eid: if hash {
                Some(self.i32s(&n("ffn_gate_tid2eid"))?)
            } else {
                None
            },
            gate_exps: self.mat(&n("ffn_gate_exps"))?,
            up_exps: self.mat(&n("ffn_up_exps"))?,
            down_exps: self.mat(&n("ffn_down_exps"))?,
            gate_sh: self.mat(&n("ffn_gate_shexp"))?,
            up_sh: self.mat(&n("ffn_up_shexp"))?,
            down_sh: self.mat(&n("ffn_down_shexp"))?,
        };
        if lw.gate_exps.ty != lw.up_exps.ty {
            return Err(EngineError::TensorType {
                name: lw.up_exps.name.clone(),
                got: lw.up_exps.ty,
                expected: format!("the type of {} ({:?})", lw.gate_exps.name, lw.gate_exps.ty),
            });
        }
        if let Some(t) = &lw.tid2eid {
            if let Some(bad) = t.iter().find(|&&e| e < 0 || e as usize >= cfg.n_expert) {
                return Err(EngineError::TensorData {
                    name: n("ffn_gate_tid2eid"),
                    msg: format!("expert id {bad} outside 0..{}", cfg.n_expert),
                });
            }
        }
        Ok(lw)
    }
}

impl Weights {
    pub fn bind(cfg: &Config, file: &Arc<GgufFile>) -> Result<Weights> {
        let b = Binder::new(file, expected_tensors(cfg, ExpertQuant::Q2));
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let n = |s: &str| layer_name(il, s);
            let hash = il < cfg.n_hash_layer;
            layers.push(b.layer(cfg, il, cfg.compress_ratios[il], hash, &n)?);
        }
        Ok(Weights {
            token_embd: b.mat("token_embd.weight")?,
            layers,
            head_hc: b.hc(
                "output_hc_fn.weight",
                "output_hc_scale.weight",
                "output_hc_base.weight",
            )?,
            output_norm: b.vec("output_norm.weight")?,
            output: b.mat("output.weight")?,
        })
    }
}
