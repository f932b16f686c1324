//! Model weights resident on the GPU, uploaded once and shared by every CUDA session.

use std::sync::{Arc, Mutex};

use ds4_cuda::{
    CudaError, DecodePlan, DeviceBuf, DeviceMatrix, Gpu, Part, RopeP, WT_BF16, WT_F16, WT_F32,
    WT_Q8_0,
};
use ds4_gguf::GgmlType;

use crate::config::Config;
use crate::model::Model;
use crate::mtp::weights::mtp_layer_index;
use crate::mtp::Mtp;
use crate::ops::rope::Rope;
use crate::placement::{MemoryNeeds, MemoryOptions, Placement, DEFAULT_PLAN_CTX};
use crate::weights::{
    Compressor, CompressorWeights, Hc, HcWeights, Indexer, Layer, LayerWeights, Mat, Storage,
};

/// A small dense tensor kept in its file encoding (F32/F16/BF16) for the layer kernels
/// (the token embedding: on the device, or in mapped host memory when offloaded).
pub struct DenseTensor {
    pub buf: Part,
    pub ty: i32,
}

/// The device storage: every tensor a device allocation of its own.
pub struct Device;

impl Storage for Device {
    type Mat = DeviceMatrix;
    type F32s = DeviceBuf<f32>;
    type I32s = DeviceBuf<i32>;
}

pub type HcDev = Hc<Device>;
pub type CompressorDev = Compressor<Device>;
pub type IndexerDev = Indexer<Device>;
pub type LayerDev = Layer<Device>;

pub struct CudaWeights {
    pub gpu: Arc<Gpu>,
    pub config: Config,
    pub token_embd: DenseTensor,
    /// Per layer its weights: `Some` for the layers of [`CudaWeights::range`] (all of
    /// them unless the model is split over several GPUs, `cuda/split.rs`).
    pub layers: Vec<Option<LayerDev>>,
    /// The layers this device runs.
    pub range: std::ops::Range<usize>,
    /// Per layer, the RoPE frequencies ([`CudaWeights::rope`]).
    pub freqs: Vec<DeviceBuf<f32>>,
    pub head_hc: HcDev,
    pub output_norm: DeviceBuf<f32>,
    pub output: DeviceMatrix,
    /// 0..o_groups, the matrix ids of the grouped output projection.
    pub group_ids: DeviceBuf<i32>,
    /// Weight bytes on the device.
    pub bytes: usize,
    /// Weight bytes in mapped host memory (expert offload, [`Placement`]).
    pub host_bytes: usize,
    /// What lives in host memory.
    pub placement: Placement,
    /// The placement reserved room for one session only: its prefill chunk may use
    /// what is left (state.rs `prefill_chunk`) instead of a fraction.
    pub tight: bool,
    /// The decode plan new sessions follow ([`DecodePlan::from_env`], read once here).
    pub plan: DecodePlan,
    /// The MTP block last uploaded ([`CudaWeights::mtp`]), shared by every session.
    mtp: Mutex<Option<MtpCache>>,
    /// The buffers and graphs of batched steps over several sessions
    /// ([`CudaWeights::batch_step`]), shared by every session of this upload.
    batch: Mutex<Option<super::state::BatchStep>>,
    /// The prefill chunk's buffers ([`CudaWeights::prefill_work`]), shared by every
    /// session of this upload.
    prefill: Mutex<Option<super::state::PrefillWork>>,
}

/// The MTP draft block (architecture.md §7) on the device: the block as a layer and the
/// draft-specific tensors. The embedding and the output matrix are the main model's.
pub struct CudaMtpWeights {
    pub layer: LayerDev,
    /// The layer index the block runs as ([`mtp_layer_index`]).
    pub il: usize,
    /// RoPE frequencies of a ratio-0 layer (base `rope_freq_base`, no YaRN), as the
    /// CPU block's: whatever the main model's layer `il` uses.
    pub freqs: DeviceBuf<f32>,
    pub e_proj: DeviceMatrix,
    pub h_proj: DeviceMatrix,
    pub enorm: DeviceBuf<f32>,
    pub hnorm: DeviceBuf<f32>,
    pub norm: DeviceBuf<f32>,
    pub head_hc: HcDev,
    pub bytes: usize,
}

impl CudaMtpWeights {
    /// The head's stream collapse and final norm (the block's own).
    pub fn head(&self) -> (&HcDev, &DeviceBuf<f32>) {
        (&self.head_hc, &self.norm)
    }

    pub fn rope(&self, gpu: &Gpu, rope_dim: usize) -> RopeP {
        RopeP {
            freqs: gpu.ptr(&self.freqs),
            rope_dim: rope_dim as i32,
            pad: 0,
        }
    }
}

/// The cached upload and the block it came from: holding the [`Mtp`] keeps its file
/// mapped, so the identity (the file's address) cannot be reused by another file.
struct MtpCache {
    mtp: Mtp,
    dev: Arc<CudaMtpWeights>,
}

/// Whether two handles are the same loaded MTP file.
fn same_mtp(a: &Mtp, b: &Mtp) -> bool {
    std::ptr::eq(a.gguf(), b.gguf())
}

fn wt_code(ty: GgmlType) -> Result<i32, CudaError> {
    Ok(match ty {
        GgmlType::F32 => WT_F32,
        GgmlType::F16 => WT_F16,
        GgmlType::BF16 => WT_BF16,
        GgmlType::Q8_0 => WT_Q8_0,
        other => {
            return Err(CudaError::Invalid(format!(
                "{other} is not a dense layer-kernel type"
            )))
        }
    })
}

/// Out of memory unless `need` bytes are free on `gpu` (when it can tell).
fn check_fits(gpu: &Gpu, need: usize) -> Result<(), CudaError> {
    if let Ok((free, total)) = gpu.mem_info() {
        if need > free {
            let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
            return Err(CudaError::OutOfMemory {
                name: gpu.info().name.clone(),
                need_gib: gib(need),
                free_gib: gib(free),
                total_gib: gib(total),
            });
        }
    }
    Ok(())
}

struct Uploader<'a> {
    gpu: &'a Arc<Gpu>,
    bytes: usize,
    host_bytes: usize,
    progress: &'a dyn Fn(usize),
}

impl Uploader<'_> {
    /// An expert stack: in mapped host memory when its layer is offloaded.
    fn experts(&mut self, m: &Mat, host: bool) -> Result<DeviceMatrix, CudaError> {
        if !host {
            return self.mat(m);
        }
        let d = DeviceMatrix::upload_host(self.gpu, m.ty, m.data(), m.n_out, m.n_in, m.n_mat)
            .map_err(|e| match e {
                CudaError::Driver(_) => e,
                e => CudaError::Invalid(format!("{}: {e}", m.name)),
            })?;
        self.host_bytes += d.bytes();
        (self.progress)(m.data().len());
        Ok(d)
    }

    fn mat(&mut self, m: &Mat) -> Result<DeviceMatrix, CudaError> {
        self.mat_grouped(m, 1)
    }

    /// Uploads `m` as `groups` consecutive matrices of n_out/groups rows (or its own
    /// expert stack when groups = 1).
    fn mat_grouped(&mut self, m: &Mat, groups: usize) -> Result<DeviceMatrix, CudaError> {
        let (rows, mats) = if groups > 1 {
            (m.n_out / groups, groups)
        } else {
            (m.n_out, m.n_mat)
        };
        let d = if m.ty == GgmlType::BF16 {
            DeviceMatrix::upload_bf16(self.gpu, m.data(), rows, m.n_in, mats)
        } else {
            DeviceMatrix::upload(self.gpu, m.ty, m.data(), rows, m.n_in, mats)
        }
        .map_err(|e| match e {
            // Driver errors (out of memory above all) keep their kind.
            CudaError::Driver(_) => e,
            e => CudaError::Invalid(format!("{}: {e}", m.name)),
        })?;
        self.bytes += d.bytes();
        (self.progress)(m.data().len());
        Ok(d)
    }

    fn dense(&mut self, m: &Mat, host: bool) -> Result<DenseTensor, CudaError> {
        let ty = wt_code(m.ty).map_err(|e| CudaError::Invalid(format!("{}: {e}", m.name)))?;
        (self.progress)(m.data().len());
        let buf = if host {
            self.host_bytes += m.data().len();
            Part::Host(self.gpu.host_gather(m.data(), 1, 0, 1)?)
        } else {
            self.bytes += m.data().len();
            Part::Device(self.gpu.upload_bulk(m.data())?)
        };
        Ok(DenseTensor { buf, ty })
    }

    fn vec(&mut self, v: &[f32]) -> Result<DeviceBuf<f32>, CudaError> {
        self.bytes += v.len() * 4;
        self.gpu.upload(v)
    }

    fn hc(&mut self, h: &HcWeights) -> Result<HcDev, CudaError> {
        Ok(HcDev {
            fn_: self.mat(&h.fn_)?,
            scale: self.vec(&h.scale)?,
            base: self.vec(&h.base)?,
        })
    }

    fn compressor(&mut self, c: &CompressorWeights) -> Result<CompressorDev, CudaError> {
        Ok(CompressorDev {
            ratio: c.ratio,
            lanes: c.lanes,
            dim: c.dim,
            ape: self.vec(&c.ape)?,
            kv: self.mat(&c.kv)?,
            gate: self.mat(&c.gate)?,
            norm: self.vec(&c.norm)?,
        })
    }

    /// One transformer block: a main layer, or the MTP block bound as a layer; its
    /// routed experts in host memory when `host_experts`.
    fn layer(
        &mut self,
        lw: &LayerWeights,
        cfg: &Config,
        host_experts: bool,
    ) -> Result<LayerDev, CudaError> {
        let gpu = self.gpu;
        Ok(LayerDev {
            il: lw.il,
            ratio: lw.ratio,
            hc_attn: self.hc(&lw.hc_attn)?,
            attn_norm: self.vec(&lw.attn_norm)?,
            q_a: self.mat(&lw.q_a)?,
            q_a_norm: self.vec(&lw.q_a_norm)?,
            q_b: self.mat(&lw.q_b)?,
            kv: self.mat(&lw.kv)?,
            kv_norm: self.vec(&lw.kv_norm)?,
            sinks: self.vec(&lw.sinks)?,
            out_a: self.mat_grouped(&lw.out_a, cfg.o_groups)?,
            out_b: self.mat(&lw.out_b)?,
            compressor: lw
                .compressor
                .as_ref()
                .map(|c| self.compressor(c))
                .transpose()?,
            indexer: match &lw.indexer {
                Some(ix) => Some(IndexerDev {
                    q_b: self.mat(&ix.q_b)?,
                    proj: self.mat(&ix.proj)?,
                    compressor: self.compressor(&ix.compressor)?,
                }),
                None => None,
            },
            hc_ffn: self.hc(&lw.hc_ffn)?,
            ffn_norm: self.vec(&lw.ffn_norm)?,
            gate_inp: self.mat(&lw.gate_inp)?,
            exp_probs_b: lw.exp_probs_b.as_ref().map(|b| self.vec(b)).transpose()?,
            tid2eid: lw.tid2eid.as_ref().map(|t| gpu.upload(t)).transpose()?,
            gate_exps: self.experts(&lw.gate_exps, host_experts)?,
            up_exps: self.experts(&lw.up_exps, host_experts)?,
            down_exps: self.experts(&lw.down_exps, host_experts)?,
            gate_sh: self.mat(&lw.gate_sh)?,
            up_sh: self.mat(&lw.up_sh)?,
            down_sh: self.mat(&lw.down_sh)?,
        })
    }
}

/// File bytes of each layer's tensors (`blk.N.*`).
fn layer_file_bytes(model: &Model) -> Vec<u64> {
    let mut out = vec![0u64; model.config().n_layer];
    for t in model.gguf().tensors() {
        let il = (t.name.strip_prefix("blk."))
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok());
        if let Some(b) = il.and_then(|il| out.get_mut(il)) {
            *b += t.size;
        }
    }
    out
}

/// The byte counts the memory planner decides from (`placement.rs`), for `model` with
/// one session at `ctx`.
pub fn memory_needs(model: &Model, ctx: usize) -> MemoryNeeds {
    let c = model.config();
    let w = model.weights();
    let ctx = if ctx == 0 { DEFAULT_PLAN_CTX } else { ctx };
    let chunk = super::state::PLAN_CHUNK.min(ctx);
    MemoryNeeds {
        weights: model.gguf().tensor_bytes(),
        embedding: w.token_embd.data().len() as u64,
        experts: (w.layers.iter())
            .map(|l| [&l.gate_exps, &l.up_exps, &l.down_exps].map(|m| m.data().len() as u64))
            .map(|b| b.iter().sum())
            .collect(),
        layers: layer_file_bytes(model),
        session: super::state::session_bytes(c, ctx, chunk) as u64,
        reserve: PLAN_RESERVE,
    }
}

/// Device memory the planner leaves besides the weights and one session: the weights'
/// own allocation rounding (on the H100 the free memory after the upload was within
/// 0.02 GiB of the plan's). The MTP block is not included (it is checked when loaded).
const PLAN_RESERVE: u64 = 256 << 20;

impl CudaWeights {
    /// Uploads every weight of `model` to the device. `progress(bytes)` is called as
    /// file bytes are uploaded.
    pub fn upload(
        gpu: &Arc<Gpu>,
        model: &Model,
        progress: &dyn Fn(usize),
    ) -> Result<CudaWeights, CudaError> {
        let n_layer = model.config().n_layer;
        let all = Placement::resident(n_layer);
        Self::upload_placed(gpu, model, all, 0..n_layer, false, progress)
    }

    /// Plans where the weights go on `gpu` for `memory` ([`Placement::plan`] on its
    /// free memory) and uploads them there. Returns the weights and the startup line
    /// saying what went where.
    pub fn upload_planned(
        gpu: &Arc<Gpu>,
        model: &Model,
        memory: &MemoryOptions,
        progress: &dyn Fn(usize),
    ) -> Result<(CudaWeights, String), CudaError> {
        let needs = memory_needs(model, memory.ctx);
        let free = gpu.mem_info().map_or(u64::MAX, |(free, _)| free as u64);
        let placement = Placement::plan(&needs, free, memory.offload).map_err(|e| {
            CudaError::Invalid(format!("{} ({}): {e}", gpu.info().name, "memory plan"))
        })?;
        let line = placement.describe(&needs, free);
        let tight = placement.offloads();
        let all = 0..model.config().n_layer;
        let w = Self::upload_placed(gpu, model, placement, all, tight, progress)?;
        let after = gpu.mem_info().map_or(0, |(free, _)| free as u64);
        let line = format!(
            "{line}; {:.2} GiB free after the upload",
            crate::placement::gib(after)
        );
        Ok((w, line))
    }

    /// Uploads the weights of the layers in `range` and those outside the layers (the
    /// embedding, the head: every stage of a split holds them) with `placement`'s
    /// tensors in mapped host memory.
    pub(crate) fn upload_placed(
        gpu: &Arc<Gpu>,
        model: &Model,
        placement: Placement,
        range: std::ops::Range<usize>,
        tight: bool,
        progress: &dyn Fn(usize),
    ) -> Result<CudaWeights, CudaError> {
        // A misspelt DS4_CUDA_FUSE fails here, before the upload.
        let plan = DecodePlan::from_env()?;
        let cfg = model.config().clone();
        let w = model.weights();
        if placement.experts_on_host.len() != cfg.n_layer {
            return Err(CudaError::Invalid(format!(
                "a placement of {} layers for a model of {}",
                placement.experts_on_host.len(),
                cfg.n_layer
            )));
        }
        // Fail before uploading anything when the weights cannot fit (the q2 file on an
        // 80 GB card without offload): otherwise the allocation fails a minute later.
        if range.is_empty() || range.end > cfg.n_layer {
            return Err(CudaError::Invalid(format!(
                "layers {range:?} of a model of {}",
                cfg.n_layer
            )));
        }
        let stage = memory_needs(model, 0).stage(&range);
        check_fits(gpu, placement.device_bytes(&stage) as usize)?;
        let inner = model.inner();
        let mut up = Uploader {
            gpu,
            bytes: 0,
            host_bytes: 0,
            progress,
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        let mut freqs = Vec::with_capacity(cfg.n_layer);
        for (il, lw) in w.layers.iter().enumerate() {
            freqs.push(up.vec(inner.ropes[il].freqs())?);
            // Another GPU's layer (a split) is uploaded there.
            layers.push(if range.contains(&il) {
                Some(up.layer(lw, &cfg, placement.experts_on_host[il])?)
            } else {
                None
            });
        }
        let group_ids: Vec<i32> = (0..cfg.o_groups as i32).collect();
        let weights = CudaWeights {
            gpu: gpu.clone(),
            token_embd: up.dense(&w.token_embd, placement.embedding_on_host)?,
            layers,
            range,
            freqs,
            head_hc: up.hc(&w.head_hc)?,
            output_norm: up.vec(&w.output_norm)?,
            output: up.mat(&w.output)?,
            group_ids: gpu.upload(&group_ids)?,
            bytes: up.bytes,
            host_bytes: up.host_bytes,
            placement,
            tight,
            config: cfg,
            plan,
            mtp: Mutex::new(None),
            batch: Mutex::new(None),
            prefill: Mutex::new(None),
        };
        gpu.release_staging()?;
        Ok(weights)
    }

    /// The shared buffers and graphs of batched steps over several sessions (allocated
    /// by the first step; `state/batch.rs`). After a panic mid-step (a poisoned lock)
    /// they are dropped and built again.
    pub(crate) fn batch_step(&self) -> std::sync::MutexGuard<'_, Option<super::state::BatchStep>> {
        self.batch.lock().unwrap_or_else(|e| {
            let mut g = e.into_inner();
            *g = None;
            g
        })
    }

    /// The prefill chunk's buffers, one per GPU (`state.rs` [`super::state::PrefillWork`]:
    /// sessions prefill one chunk at a time). After a panic mid-chunk (a poisoned lock)
    /// they are dropped and allocated again.
    pub(crate) fn prefill_work(
        &self,
    ) -> std::sync::MutexGuard<'_, Option<super::state::PrefillWork>> {
        self.prefill.lock().unwrap_or_else(|e| {
            let mut g = e.into_inner();
            *g = None;
            g
        })
    }

    /// Layer `il`'s weights (one of [`CudaWeights::range`]).
    pub fn layer(&self, il: usize) -> &LayerDev {
        self.layers[il]
            .as_ref()
            .unwrap_or_else(|| panic!("layer {il} runs on another GPU ({:?} here)", self.range))
    }

    /// The output head's stream collapse and final norm.
    pub fn head(&self) -> (&HcDev, &DeviceBuf<f32>) {
        (&self.head_hc, &self.output_norm)
    }

    /// The device copy of `mtp`'s block, uploaded on first use and shared by every
    /// session; a different block replaces it (one MTP file per engine).
    pub fn mtp(&self, mtp: &Mtp) -> Result<Arc<CudaMtpWeights>, CudaError> {
        let mut cache = self.mtp.lock().expect("MTP weights lock");
        if let Some(c) = cache.as_ref().filter(|c| same_mtp(&c.mtp, mtp)) {
            return Ok(c.dev.clone());
        }
        let c = &self.config;
        let main = mtp.main().config();
        if (main.n_embd, main.n_hc, main.vocab, main.n_layer)
            != (c.n_embd, c.n_hc, c.vocab, c.n_layer)
        {
            return Err(CudaError::Invalid(
                "the MTP block was loaded for another model than this GPU's".into(),
            ));
        }
        // Drop the old block before uploading the new one (one fits where two may not).
        *cache = None;
        check_fits(&self.gpu, mtp.gguf().tensor_bytes() as usize)?;
        let dev = Arc::new(self.upload_mtp(mtp)?);
        *cache = Some(MtpCache {
            mtp: mtp.clone(),
            dev: dev.clone(),
        });
        Ok(dev)
    }

    fn upload_mtp(&self, mtp: &Mtp) -> Result<CudaMtpWeights, CudaError> {
        let w = mtp.weights();
        let cfg = &self.config;
        let mut up = Uploader {
            gpu: &self.gpu,
            bytes: 0,
            host_bytes: 0,
            progress: &|_| {},
        };
        let rope = Rope::new(cfg.rope_dim, cfg.rope_freq_base, None);
        let dev = CudaMtpWeights {
            layer: up.layer(&w.layer, cfg, false)?,
            il: mtp_layer_index(cfg),
            freqs: up.vec(rope.freqs())?,
            e_proj: up.mat(&w.e_proj)?,
            h_proj: up.mat(&w.h_proj)?,
            enorm: up.vec(&w.enorm)?,
            hnorm: up.vec(&w.hnorm)?,
            norm: up.vec(&w.norm)?,
            head_hc: up.hc(&w.head_hc)?,
            bytes: 0,
        };
        self.gpu.release_staging()?;
        Ok(CudaMtpWeights {
            bytes: up.bytes,
            ..dev
        })
    }

    pub fn rope(&self, il: usize) -> RopeP {
        RopeP {
            freqs: self.gpu.ptr(&self.freqs[il]),
            rope_dim: self.config.rope_dim as i32,
            pad: 0,
        }
    }
}
