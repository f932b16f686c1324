//! [`Engine`]: a loaded model on the backend chosen once, at open, and the sessions
//! that run on it. This is the API the `ds4` CLI and `ds4-server` use; it names no
//! tensor or device type (those are in [`crate::dev`]).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use ds4_gguf::GgmlType;
use ds4_tokenizer::Tokenizer;

use crate::config::Config;
use crate::error::{EngineError, Result};
use crate::model::{LoadOptions, Model};
use crate::ops::linear::Numerics;
use crate::session::{Session, SessionOptions};
use crate::steer::Steering;

/// Which backend [`Engine::open`] should run the model on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA device 0 when a driver and a device are usable and the weights upload;
    /// the CPU otherwise ([`Engine::backend_reason`] says why).
    #[default]
    Auto,
    /// The CPU reference backend; `threads`: a pool of its own for the forward pass
    /// (`None`: rayon's global pool).
    Cpu { threads: Option<usize> },
    /// CUDA device `device`. An error when it cannot be used (no fallback).
    Cuda { device: usize },
}

impl std::str::FromStr for BackendChoice {
    type Err = String;

    /// The `--backend` values of every binary: `auto`, `cpu`, `cuda` (device 0) or
    /// `cuda:N`.
    fn from_str(s: &str) -> Result<BackendChoice, String> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "cpu" => Ok(BackendChoice::Cpu { threads: None }),
            "cuda" => Ok(BackendChoice::Cuda { device: 0 }),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(device)) => Ok(BackendChoice::Cuda { device }),
                _ => Err(format!(
                    "unknown backend `{s}` (valid: auto, cpu, cuda, cuda:N)"
                )),
            },
        }
    }
}

/// The backend an engine runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

impl BackendKind {
    /// `cpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Upload progress: `(bytes done, bytes in all)` of the model's tensor data.
pub type UploadProgress = Box<dyn Fn(u64, u64) + Send + Sync>;

/// How to open a model.
#[derive(Default)]
pub struct EngineOptions {
    pub backend: BackendChoice,
    /// The numeric mode of the engine's sessions (a session may override it).
    pub numerics: Numerics,
    /// Called while the weights are uploaded to a device (not called on the CPU).
    pub progress: Option<UploadProgress>,
    /// Expert offload and the context to leave device room for (`--offload-experts`,
    /// `--ctx`); the CPU ignores it.
    pub memory: crate::placement::MemoryOptions,
}

impl EngineOptions {
    /// `backend` in `numerics`, without upload progress.
    pub fn new(backend: BackendChoice, numerics: Numerics) -> EngineOptions {
        EngineOptions {
            backend,
            numerics,
            progress: None,
            memory: Default::default(),
        }
    }
}

impl std::fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineOptions")
            .field("backend", &self.backend)
            .field("numerics", &self.numerics)
            .field("progress", &self.progress.is_some())
            .field("memory", &self.memory)
            .finish()
    }
}

/// What a model file is: its hyperparameters and tensor data, for summaries.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ModelInfo {
    /// The hyperparameters (GGUF keys), as the engine validated them.
    pub hparams: Config,
    /// The GGML type name of the routed experts' gate/up tensors (`IQ2_XXS`, `Q4_K`).
    pub routed_quant: Option<&'static str>,
    /// Every way the hyperparameters differ from DeepSeek V4 Flash (empty: none).
    pub profile_deviations: Vec<String>,
    /// File size, tensor count and tensor data bytes.
    pub file_bytes: u64,
    pub n_tensors: usize,
    pub tensor_bytes: u64,
    /// The model's identity: SHA-256 of the GGUF's metadata and tensor table (every byte
    /// before the tensor data) and the first bytes of each tensor, so another tokenizer,
    /// config or set of weights with the same shapes gets another value. Disk KV cache
    /// files record it and are refused by another model.
    pub fingerprint: [u8; 32],
}

impl ModelInfo {
    fn of(model: &Model) -> ModelInfo {
        let c = model.config();
        let g = model.gguf();
        ModelInfo {
            hparams: c.clone(),
            routed_quant: routed_type(model).map(GgmlType::name),
            profile_deviations: c.profile_deviations(),
            file_bytes: g.len(),
            n_tensors: g.tensors().len(),
            tensor_bytes: g.tensor_bytes(),
            fingerprint: fingerprint(g),
        }
    }
}

/// Tensor bytes sampled per tensor: enough to tell weights apart, while touching only
/// one page of each tensor (the load computes this once).
const FINGERPRINT_SAMPLE: u64 = 256;

fn fingerprint(g: &ds4_gguf::GgufFile) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let bytes = g.bytes();
    let mut d = Sha256::new();
    let table_end = (g.data_offset() as usize).min(bytes.len());
    d.update(&bytes[..table_end]);
    for info in g.tensors() {
        let view = g.view(info);
        d.update(&view.data[..view.data.len().min(FINGERPRINT_SAMPLE as usize)]);
    }
    d.finalize().into()
}

/// The routed experts' gate type (every layer has the same; binding checks that).
fn routed_type(model: &Model) -> Option<GgmlType> {
    model.weights().layers.first().map(|l| l.gate_exps.ty)
}

/// Routed-expert bits as the disk KV cache header records them: 4 for the 4-bit
/// encodings (the published q4 file's Q4_K), 2 for everything else (the q2 file's
/// IQ2_XXS/Q2_K, and test models).
fn quant_bits(ty: Option<GgmlType>) -> u8 {
    use GgmlType::*;
    match ty {
        Some(Q4_0 | Q4_1 | Q4_K | IQ4_NL | IQ4_XS) => 4,
        _ => 2,
    }
}

/// Where the sessions of an engine run.
enum Device {
    Cpu(Option<Arc<rayon::ThreadPool>>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<crate::cuda::CudaWeights>),
    /// The layers split over several GPUs (`cuda/split.rs`), one upload per stage.
    #[cfg(feature = "cuda")]
    CudaSplit(Vec<Arc<crate::cuda::CudaWeights>>),
}

/// A model loaded on one backend. Sessions share its weights.
pub struct Engine {
    model: Model,
    numerics: Numerics,
    device: Device,
    reason: String,
    info: ModelInfo,
    tokenizer: OnceLock<Arc<Tokenizer>>,
    /// Directional steering of the sessions created from now on (`crate::steer`).
    steering: Option<Arc<Steering>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.info.hparams.name)
            .field("backend", &self.backend())
            .field("reason", &self.reason)
            .field("numerics", &self.numerics)
            .finish()
    }
}

impl Engine {
    /// Maps the GGUF at `path`, binds its tensors and brings the model up on the
    /// backend `opts.backend` asks for (see [`BackendChoice`]).
    pub fn open(path: impl AsRef<Path>, opts: EngineOptions) -> Result<Engine> {
        let model = Model::load(
            path,
            LoadOptions {
                numerics: opts.numerics,
            },
        )?;
        Engine::open_model(model, opts)
    }

    /// An engine over a model already loaded (in-memory models of tools and tests);
    /// `opts.numerics` replaces the model's.
    pub(crate) fn open_model(model: Model, opts: EngineOptions) -> Result<Engine> {
        let (device, reason) = pick(&model, &opts)?;
        Ok(Engine {
            info: ModelInfo::of(&model),
            model,
            numerics: opts.numerics,
            device,
            reason,
            tokenizer: OnceLock::new(),
            steering: None,
        })
    }

    /// The backend the sessions run on.
    pub fn backend(&self) -> BackendKind {
        match self.device {
            Device::Cpu(_) => BackendKind::Cpu,
            #[cfg(feature = "cuda")]
            Device::Cuda(_) | Device::CudaSplit(_) => BackendKind::Cuda,
        }
    }

    /// Why that backend: the device used, what was requested, or why `Auto` fell
    /// back to the CPU. One line, for a startup message.
    pub fn backend_reason(&self) -> &str {
        &self.reason
    }

    /// The default numeric mode of the sessions.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Routed-expert quantisation bits (2 or 4), as disk KV cache headers record them.
    pub fn routed_quant_bits(&self) -> u8 {
        quant_bits(routed_type(&self.model))
    }

    /// The model's tokenizer, from its `tokenizer.ggml.*` metadata (built on the first
    /// call, then shared).
    pub fn tokenizer(&self) -> Result<Arc<Tokenizer>> {
        if let Some(t) = self.tokenizer.get() {
            return Ok(t.clone());
        }
        let t = Arc::new(self.model.tokenizer()?);
        Ok(self.tokenizer.get_or_init(|| t).clone())
    }

    /// Steers the sessions created from now on (`--dir-steering-*`; docs/architecture.md
    /// §8 item 17): the directions must match the model's layers and width. `None`, or
    /// both scales 0, turns steering off: sessions then run the unsteered forward pass,
    /// bit for bit. Existing sessions keep theirs ([`Session::set_steering`]).
    pub fn set_steering(&mut self, steering: Option<Steering>) -> Result<()> {
        let c = self.model.config();
        if let Some(s) = &steering {
            s.check_shape(c.n_layer, c.n_embd)?;
        }
        self.steering = steering.filter(Steering::active).map(Arc::new);
        Ok(())
    }

    /// The `--dir-steering-file/-ffn/-attn` flags of every binary: the file (checked
    /// against the model's shape) with the FFN scale (default 1) and the attention scale
    /// (default 0). A nonzero scale without a file is refused, as the reference does;
    /// zero scales leave steering off. Returns the steering now in force.
    pub fn steer_from_flags(
        &mut self,
        file: Option<&Path>,
        ffn: Option<f32>,
        attn: Option<f32>,
    ) -> Result<Option<&Steering>> {
        let Some(path) = file else {
            if ffn.is_some_and(|s| s != 0.0) || attn.is_some_and(|s| s != 0.0) {
                return Err(EngineError::Invalid(
                    "directional steering needs --dir-steering-file".into(),
                ));
            }
            return Ok(None);
        };
        let c = self.model.config();
        let s = Steering::load(
            path,
            c.n_layer,
            c.n_embd,
            ffn.unwrap_or(Steering::DEFAULT_FFN),
            attn.unwrap_or(Steering::DEFAULT_ATTN),
        )?;
        self.set_steering(Some(s))?;
        Ok(self.steering())
    }

    /// The steering of new sessions (`None`: off).
    pub fn steering(&self) -> Option<&Steering> {
        self.steering.as_deref()
    }

    /// A new, empty session of `ctx` tokens with the engine's numerics.
    pub fn new_session(&self, ctx: usize) -> Result<Session> {
        self.new_session_with(SessionOptions::new(ctx))
    }

    /// A new, empty session. On CUDA the prefill chunk is the backend's own (sized to
    /// the device memory); `opts.prefill_chunk` (default: that chunk) splits calls above
    /// it.
    pub fn new_session_with(&self, mut opts: SessionOptions) -> Result<Session> {
        opts.numerics = opts.numerics.or(Some(self.numerics));
        let mut session = self.new_session_unsteered(opts)?;
        if self.steering.is_some() {
            session.set_steering(self.steering.clone())?;
        }
        Ok(session)
    }

    fn new_session_unsteered(&self, opts: SessionOptions) -> Result<Session> {
        match &self.device {
            Device::Cpu(pool) => Session::cpu(&self.model, opts, pool.clone()),
            #[cfg(feature = "cuda")]
            Device::Cuda(w) => {
                crate::session::check_ctx(opts.ctx)?;
                let numerics = opts.numerics.unwrap_or(self.numerics);
                let b = crate::cuda::CudaBackend::new(w, opts.ctx, numerics)?;
                let chunk = opts.prefill_chunk.unwrap_or_else(|| b.prefill_chunk());
                Ok(Session::on_backend(
                    &self.model,
                    Box::new(b),
                    numerics,
                    chunk,
                ))
            }
            #[cfg(feature = "cuda")]
            Device::CudaSplit(stages) => {
                crate::session::check_ctx(opts.ctx)?;
                let numerics = opts.numerics.unwrap_or(self.numerics);
                let b = crate::cuda::SplitBackend::new(stages, opts.ctx, numerics)?;
                let chunk = opts
                    .prefill_chunk
                    .unwrap_or_else(|| crate::backend::Backend::preferred_batch(&b));
                Ok(Session::on_backend(
                    &self.model,
                    Box::new(b),
                    numerics,
                    chunk,
                ))
            }
        }
    }

    /// Loads the optional MTP GGUF at `path` (architecture.md §2.5), checked against
    /// this model. On the CUDA backend the block is uploaded here, once for every
    /// session (the drafts then run on the GPU); running out of device memory is
    /// reported now, not at the first draft.
    pub fn load_mtp(&self, path: impl AsRef<Path>) -> Result<crate::mtp::Mtp> {
        let path = path.as_ref();
        let mtp = crate::mtp::Mtp::load(&self.model, path)?.with_numerics(self.numerics);
        #[cfg(feature = "cuda")]
        if let Device::Cuda(w) = &self.device {
            w.mtp(&mtp).map_err(|e| mtp_upload_error(path, e))?;
        }
        // A split model drafts on its last stage's GPU (cuda/split.rs).
        #[cfg(feature = "cuda")]
        if let Device::CudaSplit(stages) = &self.device {
            if let Some(w) = stages.last() {
                w.mtp(&mtp).map_err(|e| mtp_upload_error(path, e))?;
            }
        }
        Ok(mtp)
    }

    pub(crate) fn model_ref(&self) -> &Model {
        &self.model
    }

    pub(crate) fn cpu_pool_ref(&self) -> Option<&Arc<rayon::ThreadPool>> {
        match &self.device {
            Device::Cpu(pool) => pool.as_ref(),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) | Device::CudaSplit(_) => None,
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_weights_ref(&self) -> Option<&Arc<crate::cuda::CudaWeights>> {
        match &self.device {
            Device::Cuda(w) => Some(w),
            Device::Cpu(_) | Device::CudaSplit(_) => None,
        }
    }
}

/// The tokenizer of the DS4 GGUF at `path`, without loading the model: the file is
/// mapped and only its `tokenizer.ggml.*` metadata is read.
pub fn load_tokenizer(path: impl AsRef<Path>) -> Result<Tokenizer> {
    let path = path.as_ref();
    let gguf = ds4_gguf::GgufFile::open(path).map_err(|source| EngineError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    crate::tokenizer::from_gguf(&gguf)
}

fn cpu(threads: Option<usize>) -> Result<Device> {
    let pool = threads
        .map(|n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .map(Arc::new)
                .map_err(|e| EngineError::Invalid(format!("a CPU pool of {n} threads: {e}")))
        })
        .transpose()?;
    Ok(Device::Cpu(pool))
}

/// The one place that decides the backend.
fn pick(model: &Model, opts: &EngineOptions) -> Result<(Device, String)> {
    // A device map that does not fit the model is refused on every backend, before
    // `Auto` could fall back to the CPU over it.
    (opts.memory)
        .check(model.config().n_layer)
        .map_err(|e| EngineError::Invalid(e.to_string()))?;
    match opts.backend {
        BackendChoice::Cpu { threads } => {
            let reason = match threads {
                Some(n) => format!("requested, {n} threads"),
                None => "requested".to_string(),
            };
            Ok((cpu(threads)?, reason))
        }
        BackendChoice::Cuda { device } => cuda(model, device, opts),
        BackendChoice::Auto => match cuda(model, 0, opts) {
            Ok(found) => Ok(found),
            Err(EngineError::Unavailable { reason, .. }) => Ok((cpu(None)?, reason)),
            Err(e) => Ok((cpu(None)?, format!("CUDA unavailable ({e})"))),
        },
    }
}

#[cfg(feature = "cuda")]
fn cuda(model: &Model, device: usize, opts: &EngineOptions) -> Result<(Device, String)> {
    use crate::cuda::{driver_present, CudaWeights};
    if !driver_present() {
        return Err(EngineError::Unavailable {
            backend: "cuda",
            reason: "no CUDA driver on this machine".into(),
        });
    }
    let mut gpus = choose_gpus(model, device, &opts.memory)?;
    if gpus.len() > 1 || opts.memory.device_map.is_some() {
        return cuda_split(model, &gpus, opts);
    }
    let (device, gpu) = gpus.pop().expect("at least one GPU");
    let total = model.gguf().tensor_bytes();
    let done = std::sync::atomic::AtomicU64::new(0);
    let progress = |n: usize| {
        if let Some(p) = &opts.progress {
            let now = done.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed) + n as u64;
            p(now, total);
        }
    };
    let (w, placed) = CudaWeights::upload_planned(&gpu, model, &opts.memory, &progress)?;
    let w = Arc::new(w);
    let mut reason = format!("CUDA device {device} ({})", w.gpu.info().name);
    if w.placement.offloads() {
        reason += &format!("; {placed}");
    }
    tracing::info!("weights: {placed}");
    Ok((Device::Cuda(w), reason))
}

/// The GPUs to run on: those of `--device-map` or `--gpus` as given; otherwise
/// `device`, or every visible GPU when there are several and the model with one session
/// does not fit `device` (expert offload is for a single card that is a little too
/// small; a split uses no offload).
///
/// Returns each chosen ordinal with its opened device (each opened once: the upload
/// uses the one whose free memory was read).
#[cfg(feature = "cuda")]
fn choose_gpus(
    model: &Model,
    device: usize,
    memory: &crate::placement::MemoryOptions,
) -> Result<Vec<(usize, Arc<crate::cuda::Gpu>)>> {
    let open = |d: usize| -> Result<(usize, Arc<crate::cuda::Gpu>)> {
        Ok((d, Arc::new(crate::cuda::Gpu::open(d)?)))
    };
    let count = crate::cuda::device_count();
    let (named, flag) = match &memory.device_map {
        Some(map) => (map.gpus(), "--device-map"),
        None => (memory.gpus.clone(), "--gpus"),
    };
    if !named.is_empty() {
        if let Some(d) = named.iter().find(|&&d| d >= count) {
            return Err(EngineError::Unavailable {
                backend: "cuda",
                reason: format!("{flag} names device {d} but {count} are visible"),
            });
        }
        return named.iter().map(|&d| open(d)).collect();
    }
    let first = open(device)?;
    if count < 2 || memory.offload != crate::placement::Offload::Auto {
        return Ok(vec![first]);
    }
    let free = first.1.mem_info().map_or(u64::MAX, |(free, _)| free as u64);
    let needs = crate::cuda::weights::memory_needs(model, memory.ctx);
    if needs.weights + needs.session + needs.reserve <= free {
        return Ok(vec![first]);
    }
    let mut first = Some(first);
    (0..count)
        .map(|d| match first.take_if(|f| f.0 == d) {
            Some(f) => Ok(f),
            None => open(d),
        })
        .collect()
}

/// The model split by layers over `gpus` (`cuda/split.rs`, the plan from
/// [`crate::placement::plan_split`], or [`crate::placement::plan_device_map`] for
/// `--device-map`: with expert offload where the cards need it). A map of one entry
/// runs as one GPU does (no split backend).
#[cfg(feature = "cuda")]
fn cuda_split(
    model: &Model,
    gpus: &[(usize, Arc<crate::cuda::Gpu>)],
    opts: &EngineOptions,
) -> Result<(Device, String)> {
    use crate::cuda::CudaWeights;
    let free: Vec<u64> = (gpus.iter())
        .map(|(_, g)| g.mem_info().map_or(0, |(free, _)| free as u64))
        .collect();
    let needs = crate::cuda::weights::memory_needs(model, opts.memory.ctx);
    let map = opts.memory.device_map.as_ref();
    let offload = opts.memory.offload;
    let plan = match map {
        Some(map) => crate::placement::plan_device_map(&needs, map, &free, offload),
        None => crate::placement::plan_split(&needs, &free, offload),
    }
    .map_err(|e| EngineError::OutOfMemory {
        backend: "cuda",
        source: e.to_string().into(),
    })?;
    let names: Vec<(usize, String)> = (gpus.iter())
        .map(|(d, g)| (*d, g.info().name.clone()))
        .collect();
    let line = crate::placement::describe_split(&needs, &plan, &names, &free, map);
    // Every stage uploads the tensors outside the layers too.
    let outside = needs.weights - needs.layers.iter().sum::<u64>();
    let total = needs.weights + outside * (gpus.len() as u64 - 1);
    let done = std::sync::atomic::AtomicU64::new(0);
    let progress = |n: usize| {
        if let Some(p) = &opts.progress {
            let now = done.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed) + n as u64;
            p(now, total);
        }
    };
    let mut stages = Vec::with_capacity(gpus.len());
    for ((_, gpu), stage) in gpus.iter().zip(plan) {
        let tight = stage.placement.offloads();
        let (placement, range) = (stage.placement, stage.layers);
        let w = CudaWeights::upload_placed(gpu, model, placement, range, tight, &progress)?;
        stages.push(Arc::new(w));
    }
    tracing::info!("weights: {line}");
    let reason = format!("CUDA, {line}");
    if stages.len() == 1 {
        return Ok((Device::Cuda(stages.pop().expect("one stage")), reason));
    }
    Ok((Device::CudaSplit(stages), reason))
}

/// A failed MTP upload; out of memory says what to do about it.
#[cfg(feature = "cuda")]
fn mtp_upload_error(path: &Path, e: crate::cuda::CudaError) -> EngineError {
    if e.is_out_of_memory() {
        EngineError::OutOfMemory {
            backend: "cuda",
            source: format!(
                "the MTP block {} does not fit beside the model ({e}); run without --mtp, \
                 or free device memory (a smaller --ctx, fewer sessions)",
                path.display()
            )
            .into(),
        }
    } else {
        e.into()
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &Model, _: usize, _: &EngineOptions) -> Result<(Device, String)> {
    Err(EngineError::Unavailable {
        backend: "cuda",
        reason: "this build has no CUDA support (built without the `cuda` feature)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "cuda")]
    #[test]
    fn a_failed_mtp_upload_keeps_its_kind_and_says_what_to_do() {
        use crate::cuda::CudaError;
        let path = Path::new("/models/mtp.gguf");
        // The pre-check's error (the driver's own needs a driver to print).
        let full = CudaError::OutOfMemory {
            name: "GPU".into(),
            need_gib: 3.5,
            free_gib: 1.0,
            total_gib: 80.0,
        };
        let oom = mtp_upload_error(path, full);
        assert!(oom.is_out_of_memory());
        let why = std::error::Error::source(&oom).unwrap().to_string();
        assert!(
            why.contains("/models/mtp.gguf") && why.contains("without --mtp"),
            "{why}"
        );
        let other = mtp_upload_error(path, CudaError::Invalid("bad".into()));
        assert!(!other.is_out_of_memory());
        assert!(other.to_string().contains("bad"), "{other}");
    }

    #[test]
    fn quant_bits_follow_the_type() {
        assert_eq!(quant_bits(Some(GgmlType::IQ2_XXS)), 2);
        assert_eq!(quant_bits(Some(GgmlType::Q2_K)), 2);
        assert_eq!(quant_bits(Some(GgmlType::Q4_K)), 4);
        assert_eq!(quant_bits(Some(GgmlType::F32)), 2);
        assert_eq!(quant_bits(None), 2);
    }

    #[test]
    fn backend_flag_values_parse() {
        assert_eq!("auto".parse(), Ok(BackendChoice::Auto));
        assert_eq!("cpu".parse(), Ok(BackendChoice::Cpu { threads: None }));
        assert_eq!("cuda".parse(), Ok(BackendChoice::Cuda { device: 0 }));
        assert_eq!("cuda:3".parse(), Ok(BackendChoice::Cuda { device: 3 }));
        for bad in ["", "gpu", "cuda:", "cuda:x", "CPU"] {
            let err = bad.parse::<BackendChoice>().unwrap_err();
            assert!(err.contains("auto, cpu, cuda, cuda:N"), "{bad}: {err}");
        }
    }
}
