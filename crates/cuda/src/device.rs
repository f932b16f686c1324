use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::error::CudaError;

/// The fatbin built by build.rs (empty when nvcc was not available at build time).
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ds4_kernels.fatbin"));
/// The same kernels as one CUDA source, for NVRTC.
static SOURCE: &str = include_str!(concat!(env!("OUT_DIR"), "/ds4_kernels.cu"));

/// Whether the CUDA driver library can be loaded. Never panics.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// How the kernel module was obtained.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelSource {
    /// Compiled ahead of time by nvcc (sm_90a machine code + compute_90 PTX).
    Fatbin,
    /// Compiled by NVRTC at run time (possibly loaded from the disk cache).
    Nvrtc { cached: bool, path: Option<PathBuf> },
}

#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: i32,
    pub total_mem: usize,
    pub l2_bytes: i32,
    pub kernels: KernelSource,
}

/// One GPU with its main stream, side streams for parallel branches of a token's work
/// (see [`Gpu::fork`]) and the ds4 kernel module loaded.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Side streams; lane i ≥ 1 launches on `side[i - 1]`.
    side: Vec<Arc<CudaStream>>,
    /// The lane kernels launch on now (0: the main stream).
    lane: std::sync::atomic::AtomicUsize,
    /// `DS4_CUDA_BRANCHES=0`: every lane is the main stream (branches run in order).
    branches: bool,
    /// `DS4_CUDA_PDL=0`: captured graphs keep full (completion) dependencies.
    pdl: bool,
    module: Arc<CudaModule>,
    funcs: Mutex<HashMap<&'static str, CudaFunction>>,
    pub(crate) iq2_grid: CudaSlice<u64>,
    /// Matrix ids 0 and 1: the selections of a two-matrix launch (`matvec_q8act_pair`).
    pub(crate) pair_ids: CudaSlice<i32>,
    info: GpuInfo,
    /// `DS4_CUDA_PROFILE=1`: per-kernel device time (events around every launch).
    profile: Option<Mutex<Profile>>,
    /// `DS4_CUDA_SKIP=k1,k2`: kernels not launched at all (timing diagnosis: what a
    /// kernel costs inside the decode graph; every output after them is wrong).
    skip: Vec<String>,
    /// `DS4_CUDA_FUSE`: which decode-graph restructurings are on (unset: all; `0`:
    /// none; else a comma list of [`FUSIONS`]) — for A/B timing and bisecting.
    fuse: std::sync::RwLock<Vec<&'static str>>,
    /// `DS4_CUDA_TRACE=FILE`: every kernel's start and end (CUPTI), written by
    /// [`Gpu::trace_finish`].
    trace: Mutex<Option<crate::trace::KernelTrace>>,
    /// Pinned buffers of [`Gpu::upload_gather`] while weights are being uploaded.
    pub(crate) staging: Mutex<Option<crate::upload::Staging>>,
    /// The context's (least, greatest) priority when the driver supports node
    /// priorities. Under `prio` captured kernels get the greatest, those launched
    /// inside [`Gpu::background`] the least.
    prio_range: Option<(i32, i32)>,
    /// A graph capture is running (set by begin_capture / end_capture).
    capturing: std::sync::atomic::AtomicBool,
    /// Launches are background work (see [`Gpu::background`]).
    background: std::sync::atomic::AtomicBool,
    /// Launches select their matrices through ids that no kernel writes (see
    /// [`Gpu::constant_ids`]).
    const_ids: std::sync::atomic::AtomicBool,
}

/// The restructurings `DS4_CUDA_FUSE` can turn off (each keeps its plain twin, which
/// `ds4-tool gpu-selftest` checks it against bit for bit): `comb_lane` (hc_comb on a
/// lane of its own, not ahead of a branch's matvecs), `shared_pair` (the shared
/// expert's gate and up in one launch), `q_norm` (head_norm_rope inside the decode
/// attention), `iq2_rx` (the IQ2_XXS expert matvec with its activations in registers,
/// `matvec_iq2_xxs_q8_rx`), `q2k_rx` (the same for the Q2_K expert down at 2048
/// columns, `matvec_q2_k_q8_rx`), `q8_early` (`matvec_q8_0_q8_early`: the Q8_0 matvec's
/// first weight loads issued before the PDL wait, where the matrix selection is
/// fixed), `prio` (decode-graph kernels at the highest priority except the background
/// work — the attention's q_b, the shared expert, hc_comb — at the lowest, so that the
/// latency-bound chains beside the big matvecs get SMs first), `att_stage` (a decode
/// token's attention blocks copy their rows into shared memory,
/// `attention_split_staged`: one memory round trip per 32 rows instead of per 4),
/// `f16_early` (`matvec_f16_early`: the F16 matvec's first weight loads before the PDL
/// wait, as `q8_early`, where no ids select the matrix), `router4` (`router_wide`: the
/// router's rank loop reads four keys per shared-memory load).
///
/// Promoted in session 9 (H200, q2, 2k decode 148.9 → 161.2 tok/s together, each
/// alone within ±1 of the rest; 16k prefill 3,573 → 4,280): `hc_preload` (`hc_pre_pl`,
/// `hc_mix_pl`, `hc_post_pl`: the hyper-connection kernels with every load issued
/// before the first use or store, the norm and mix weights before the PDL wait; alone
/// +6 tok/s), `idx_banks` (`indexer_scores_sp`: a warp's loads staged as 16 rows × 2
/// k-quads so the transposed shared-memory stores hit 32 banks, not 2), `topk_reg`
/// (`topk_select_rg`: each thread's scores held in registers across the four radix
/// passes, n ≤ 4,096), `combine_pl` (`attention_combine_pl`: all 32 chunk partials in
/// flight at once, the RoPE table and position fetched first), `norm_pl`
/// (`rmsnorm_q8_pl`: norm weights before the PDL wait, x kept in registers),
/// `idxq_warp` (`indexer_q_warp`: the indexer query's RoPE, Hadamard and FP4 with one
/// warp per head, shuffles instead of 9 barriers), `att_early` (with `att_stage`,
/// `attention_split_early`: the first row copies issued before the query's load, norm
/// and RoPE), `router_split` (`router_split`: the rank loop split at the warp's own
/// experts, two instructions a key instead of five; takes the place of `router4`),
/// `iq2_early` (with `iq2_rx`, `matvec_iq2_xxs_q8_rxe`: the IQ2_XXS tables built before
/// the PDL wait), `idx_mma` (a batch's indexer scores on bf16 tensor cores,
/// `indexer_scores_mma`: exact products of the FP4-simulated operands; 16k prefill
/// +600 tok/s alone), `mm_pitch` (`mm_tc_*_p`: the prefill F16/BF16 tensor-core GEMM
/// tiles without their 4-way store conflicts). Later in session 9: `iq2_tab` (with
/// `iq2_rx`, `matvec_iq2_xxs_q8_rxt`: `iq2_xxs_dot_tab`'s lookups, one table addressed
/// by a single LOP3 each and raw prmt without selector masks: ~18% fewer instructions,
/// the same sums) and `iq2_pipe` (with `iq2_rx`: the next row unit's weights loaded
/// while the current one is computed, units of 2 rows; with `iq2_tab`
/// `matvec_iq2_xxs_q8_rxtp`): the 6-expert gate+up launch 19.2 → 17.8 µs (H200,
/// `gpu-selftest --probe-q8`), 2k decode ±0 (bit-identical, kept for the kernel's own
/// gain). `shexp_late`: a decode token's shared expert forked after the router's F16
/// matvec instead of beside it (that matvec is on the routed chain: 8.3 µs for 2 MB
/// while the shared expert's 27 MB streamed beside it, 2.8 µs after): 2k decode
/// 163.3 → 164.5 tok/s. `q8_rows` (`matvec_q8_0_q8_r4`: the early-load Q8_0 matvec
/// with 4 consecutive rows a warp where one warp takes a row of ≤ 1,024 columns — the
/// attention's q_b, 13.8 → 11.7 µs) and `q8_rows2` (`matvec_q8_0_q8_r2`: 2 rows a warp
/// for the longer one-warp rows: wo_b 12.4 → 12.1, the shared expert's down 5.5 → 5.3):
/// the same sums; 2k decode 166.3 → 168.2 tok/s together (5 rounds). `outa_early`: the
/// attention's grouped output projection through the early-load kernels (its group ids
/// are an uploaded constant, [`Gpu::constant_ids`]) and so through `_r2`: 167.9 → 171.6
/// (6 rounds; alone, before `q8_rows2`, it measured −0.3).
pub const FUSIONS: [&str; 27] = [
    "comb_lane",
    "shared_pair",
    "q_norm",
    "iq2_rx",
    "q2k_rx",
    "q8_early",
    "prio",
    "att_stage",
    "f16_early",
    "router4",
    "hc_preload",
    "idx_banks",
    "topk_reg",
    "combine_pl",
    "norm_pl",
    "idxq_warp",
    "att_early",
    "router_split",
    "iq2_early",
    "idx_mma",
    "mm_pitch",
    "iq2_tab",
    "iq2_pipe",
    "shexp_late",
    "q8_rows",
    "q8_rows2",
    "outa_early",
];

/// Restructurings off unless `DS4_CUDA_FUSE` names them, each measured without a gain
/// and kept for A/B. `iq2_lut32`: `matvec_iq2_xxs_q8_rx32` (the IQ2_XXS tables in 32
/// bank-interleaved copies) instead of `matvec_iq2_xxs_q8_rx` (session 7: no gain).
/// `carveout`: every kernel prefers the largest shared-memory carveout (one L1 /
/// shared split for all; session 8: 2k decode −7 tok/s). `exp_pitch`: the prefill
/// IQ2_XXS expert GEMM (`mm_exp_iq2_xxs_w_*`) with 112-byte stage rows, so the
/// decode's 8-byte reads of 8 rows are free of 2-way bank conflicts (session 9: 2k
/// prefill −29 tok/s alone, +23 when left out of the rest; the extra shared memory
/// costs more than the conflicts did).
pub const FUSIONS_OPT_IN: [&str; 3] = ["iq2_lut32", "carveout", "exp_pitch"];

fn fuse_env() -> Vec<&'static str> {
    parse_fuse(std::env::var("DS4_CUDA_FUSE").ok().as_deref())
}

/// The restructurings a `DS4_CUDA_FUSE` value keeps (`None`: unset, the defaults).
/// A plain comma list names exactly the ones kept; a list whose first item starts with
/// `+` or `-` edits the defaults (`+hc_preload,-prio`: the defaults with hc_preload,
/// without prio). Unknown names are ignored, so `0` (or an empty value) keeps none.
fn parse_fuse(v: Option<&str>) -> Vec<&'static str> {
    let Some(v) = v else {
        return FUSIONS.to_vec();
    };
    let items: Vec<&str> = v.split(',').map(str::trim).collect();
    let edit = items
        .first()
        .is_some_and(|f| f.starts_with('+') || f.starts_with('-'));
    let kept = |f: &str| {
        if !edit {
            return items.contains(&f);
        }
        // The last mention decides; unmentioned ones keep their default.
        let mut on = FUSIONS.contains(&f);
        for it in &items {
            match it.strip_prefix('-') {
                Some(name) if name == f => on = false,
                Some(_) => {}
                None if it.strip_prefix('+').unwrap_or(it) == f => on = true,
                None => {}
            }
        }
        on
    };
    FUSIONS
        .iter()
        .chain(FUSIONS_OPT_IN.iter())
        .copied()
        .filter(|f| kept(f))
        .collect()
}

#[derive(Default)]
struct Profile {
    pending: Vec<(
        &'static str,
        cudarc::driver::CudaEvent,
        cudarc::driver::CudaEvent,
    )>,
    totals: HashMap<&'static str, (u64, f64)>,
    /// Timed launches since the last `probe_spin`.
    since_spin: usize,
}

/// Profiling holds the stream in a `probe_spin` of this many ns every
/// `PROFILE_SPIN_EVERY` timed launches, so the host enqueues the next launches (and
/// their events) while the GPU waits: the events then bracket device time only, not
/// the host's launch latency (which made a 2 µs kernel read as 11 µs).
const PROFILE_SPIN_NS: u64 = 2_000_000;
const PROFILE_SPIN_EVERY: usize = 32;

/// A typed device buffer.
pub type DeviceBuf<T> = CudaSlice<T>;

impl Gpu {
    /// Opens device `ordinal`: driver check, context, stream and kernels.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count()?;
        if ordinal as i32 >= count {
            return Err(CudaError::NoDevice(ordinal, count));
        }
        let ctx = CudaContext::new(ordinal)?;
        // Work is ordered explicitly (one main stream; side branches fork from it and
        // join back through events): cudarc's per-argument event tracking only adds
        // launch overhead here (and gets in the way of graph capture).
        // SAFETY: buffers shared between lanes are ordered by fork/join (Gpu::fork).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let side = (0..SIDE_LANES)
            .map(|_| ctx.new_stream())
            .collect::<Result<Vec<_>, _>>()?;
        let cc = ctx.compute_capability()?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let multiprocessors = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let l2_bytes = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?;
        let (module, kernels) = load_kernels(&ctx, cc)?;
        let info = GpuInfo {
            name: ctx.name()?,
            compute_capability: cc,
            multiprocessors,
            total_mem: ctx.total_mem()?,
            l2_bytes,
            kernels,
        };
        let iq2_grid = stream.clone_htod(&ds4_gguf::quant::iq2xxs_grid()[..])?;
        let trace = match std::env::var_os("DS4_CUDA_TRACE").filter(|v| !v.is_empty()) {
            Some(path) => Some(crate::trace::KernelTrace::start(std::path::Path::new(
                &path,
            ))?),
            None => None,
        };
        let pair_ids = stream.clone_htod(&[0i32, 1][..])?;
        let profile = std::env::var("DS4_CUDA_PROFILE").is_ok_and(|v| v == "1");
        let fuse = fuse_env();
        Ok(Gpu {
            ctx,
            stream,
            side,
            lane: std::sync::atomic::AtomicUsize::new(0),
            // Profiling times kernels one after another on the main stream.
            branches: std::env::var("DS4_CUDA_BRANCHES").map_or(true, |v| v != "0") && !profile,
            pdl: std::env::var("DS4_CUDA_PDL").map_or(true, |v| v != "0"),
            module,
            iq2_grid,
            pair_ids,
            funcs: Mutex::new(HashMap::new()),
            info,
            profile: profile.then(Default::default),
            skip: std::env::var("DS4_CUDA_SKIP")
                .map(|v| {
                    v.split(',')
                        .map(|k| k.trim().to_string())
                        .filter(|k| !k.is_empty())
                        .collect()
                })
                .unwrap_or_default(),
            prio_range: priority_range(),
            fuse: std::sync::RwLock::new(fuse),
            trace: Mutex::new(trace),
            staging: Mutex::new(None),
            capturing: std::sync::atomic::AtomicBool::new(false),
            background: std::sync::atomic::AtomicBool::new(false),
            const_ids: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// Whether per-kernel profiling is on (graphs must then stay off).
    pub fn profiling(&self) -> bool {
        self.profile.is_some()
    }

    /// Finishes the `DS4_CUDA_TRACE` kernel trace (after the device work so far) and
    /// writes its CSV: the file and how many kernels it holds, or `None` without a
    /// trace (or when it was already written).
    pub fn trace_finish(&self) -> Result<Option<(std::path::PathBuf, usize)>, CudaError> {
        let Some(t) = self.trace.lock().expect("trace lock").take() else {
            return Ok(None);
        };
        self.stream.synchronize()?;
        for s in &self.side {
            s.synchronize()?;
        }
        let path = t.path().to_path_buf();
        Ok(Some((path, t.finish()?)))
    }

    /// Whether the decode-graph restructuring `name` (one of [`FUSIONS`]) is on.
    pub fn fused(&self, name: &str) -> bool {
        debug_assert!(
            FUSIONS.contains(&name) || FUSIONS_OPT_IN.contains(&name),
            "unknown fusion {name}"
        );
        self.fuse
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&name)
    }

    /// `variant` when the restructuring `fusion` is on, else `plain`: the kernel of a
    /// launcher that has an opt-in replacement.
    pub(crate) fn kernel_for(
        &self,
        fusion: &str,
        plain: &'static str,
        variant: &'static str,
    ) -> &'static str {
        if self.fused(fusion) {
            variant
        } else {
            plain
        }
    }

    /// Node priorities are on (`prio`) and the driver supports them.
    fn prio_on(&self) -> bool {
        self.prio_range.is_some() && self.fused("prio")
    }

    /// Runs `f` with `name` turned on or off, then restores the setting: the selftest's
    /// comparisons of a kernel variant with the kernel it replaces, through the same
    /// launcher.
    #[doc(hidden)]
    pub fn with_fusion<T>(&self, name: &'static str, on: bool, f: impl FnOnce() -> T) -> T {
        let before = self.fusions();
        let mut now = before.clone();
        now.retain(|n| *n != name);
        if on {
            now.push(name);
        }
        self.set_fusion_list(now);
        let r = f();
        self.set_fusion_list(before);
        r
    }

    /// The restructurings on now.
    pub fn fusions(&self) -> Vec<&'static str> {
        self.fuse.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the restructurings with those a `DS4_CUDA_FUSE` value names (`None`:
    /// the defaults) for what is launched or captured from now on (`ds4-bench
    /// --fuse-ab`: one process times several settings). Returns the list kept.
    pub fn set_fusions(&self, setting: Option<&str>) -> Vec<&'static str> {
        let list = parse_fuse(setting);
        self.set_fusion_list(list.clone());
        list
    }

    fn set_fusion_list(&self, list: Vec<&'static str>) {
        let carve_before = self.fused("carveout");
        let carve = list.contains(&"carveout");
        *self.fuse.write().unwrap_or_else(|e| e.into_inner()) = list;
        if carve != carve_before {
            // The attribute of every kernel loaded so far follows the setting.
            let funcs = self.funcs.lock().expect("kernel table lock");
            for f in funcs.values() {
                let _ = set_carveout(f, carve);
            }
        }
    }

    /// The kernels `DS4_CUDA_SKIP` keeps from launching (empty normally): a program
    /// that times with them skipped should say so, its outputs are wrong.
    pub fn skipped(&self) -> &[String] {
        &self.skip
    }

    /// Runs `launch` between two timing events when profiling; not at all when
    /// `DS4_CUDA_SKIP` names the kernel.
    pub(crate) fn timed(
        &self,
        name: &'static str,
        launch: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        if !self.skip.is_empty() && self.skip.iter().any(|k| k == name) {
            return Ok(());
        }
        let Some(p) = &self.profile else {
            launch()?;
            if self.capturing.load(std::sync::atomic::Ordering::Relaxed) && self.prio_on() {
                self.prioritise_last_node()?;
            }
            return Ok(());
        };
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        {
            let mut p = p.lock().expect("profile lock");
            if p.since_spin == 0 {
                self.spin(PROFILE_SPIN_NS)?;
            }
            p.since_spin = (p.since_spin + 1) % PROFILE_SPIN_EVERY;
        }
        let (a, b) = (self.ctx.new_event(timing)?, self.ctx.new_event(timing)?);
        a.record(self.launch_stream())?;
        launch()?;
        b.record(self.launch_stream())?;
        let mut p = p.lock().expect("profile lock");
        p.pending.push((name, a, b));
        if p.pending.len() >= 4096 {
            Self::fold(&mut p)?;
        }
        Ok(())
    }

    fn fold(p: &mut Profile) -> Result<(), CudaError> {
        for (name, a, b) in p.pending.drain(..) {
            b.synchronize()?;
            let e = p.totals.entry(name).or_default();
            e.0 += 1;
            e.1 += a.elapsed_ms(&b)? as f64;
        }
        Ok(())
    }

    /// (kernel, launches, total ms) since the last call, in no order; empty unless
    /// profiling.
    pub fn profile_take(&self) -> Result<Vec<(&'static str, u64, f64)>, CudaError> {
        let Some(p) = &self.profile else {
            return Ok(Vec::new());
        };
        let mut p = p.lock().expect("profile lock");
        Self::fold(&mut p)?;
        Ok(p.totals.drain().map(|(k, (n, ms))| (k, n, ms)).collect())
    }

    /// Lets kernel `name` use `bytes` of dynamic shared memory (beyond the default 48 KiB).
    pub(crate) fn allow_smem(&self, name: &'static str, bytes: usize) -> Result<(), CudaError> {
        if bytes <= 48 << 10 {
            return Ok(());
        }
        let f = self.func(name)?;
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )?;
        Ok(())
    }

    pub(crate) fn func(&self, name: &'static str) -> Result<CudaFunction, CudaError> {
        let mut f = self.funcs.lock().expect("kernel table lock");
        if let Some(k) = f.get(name) {
            return Ok(k.clone());
        }
        let k = self
            .module
            .load_function(name)
            .map_err(|_| CudaError::MissingKernel(name.to_string()))?;
        if self.fused("carveout") {
            set_carveout(&k, true)?;
        }
        f.insert(name, k.clone());
        Ok(k)
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(host)?)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros::<T>(n)?)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// The raw device address of a buffer (valid while the buffer lives).
    pub fn ptr<T>(&self, buf: &CudaSlice<T>) -> u64 {
        let (p, _sync) = buf.device_ptr(&self.stream);
        p
    }
}

fn load_kernels(
    ctx: &Arc<CudaContext>,
    cc: (i32, i32),
) -> Result<(Arc<CudaModule>, KernelSource), CudaError> {
    let force_nvrtc = std::env::var("DS4_CUDA_NVRTC").is_ok_and(|v| v == "1");
    if !FATBIN.is_empty() && !force_nvrtc {
        match ctx.load_module(Ptx::from_binary(FATBIN.to_vec())) {
            Ok(m) => return Ok((m, KernelSource::Fatbin)),
            // A GPU older than sm_90 cannot use the fatbin: compile for it instead.
            Err(e) if cc.0 < 9 => eprintln!(
                "ds4: prebuilt kernels do not load on sm_{}{} ({e}); compiling with NVRTC",
                cc.0, cc.1
            ),
            Err(e) => return Err(e.into()),
        }
    }
    // SAFETY: only tries to dlopen the NVRTC library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoCompiler(
            "libnvrtc not found; install the CUDA toolkit or a build with nvcc".into(),
        ));
    }
    let arch = format!("sm_{}{}", cc.0, cc.1);
    let hash = fnv1a(SOURCE.as_bytes()) ^ fnv1a(arch.as_bytes());
    let cache = cache_dir().map(|d| d.join(format!("kernels-{hash:016x}-{arch}.ptx")));
    if let Some(path) = &cache {
        if let Ok(ptx) = std::fs::read_to_string(path) {
            if let Ok(m) = ctx.load_module(Ptx::from_src(ptx)) {
                return Ok((
                    m,
                    KernelSource::Nvrtc {
                        cached: true,
                        path: cache.clone(),
                    },
                ));
            }
        }
    }
    let arch_static: &'static str = Box::leak(arch.into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch_static),
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| CudaError::Compile(e.to_string()))?;
    if let Some(path) = &cache {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, ptx.to_src()).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
    let m = ctx.load_module(ptx)?;
    Ok((
        m,
        KernelSource::Nvrtc {
            cached: false,
            path: cache,
        },
    ))
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("DS4_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("ds4"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("ds4"))
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Side lanes for parallel branches (lanes 1..=SIDE_LANES).
pub const SIDE_LANES: usize = 3;

impl Gpu {
    /// The stream kernels launch on now: the main stream, or the side stream of the
    /// lane entered with [`Gpu::branch`].
    pub(crate) fn launch_stream(&self) -> &Arc<CudaStream> {
        match self.lane.load(std::sync::atomic::Ordering::Relaxed) {
            0 => &self.stream,
            i => &self.side[i - 1],
        }
    }

    /// Makes side lane `lane` (1..=SIDE_LANES) wait for everything queued on the main
    /// stream so far. Under graph capture this forks the graph.
    pub fn fork(&self, lane: usize) -> Result<(), CudaError> {
        if !self.branches {
            return Ok(());
        }
        let side = self.side_stream(lane)?;
        Ok(side.join(&self.stream)?)
    }

    /// Makes the main stream wait for everything queued on side lane `lane`. Every
    /// branch must be joined before its results are used and before a capture ends.
    pub fn join(&self, lane: usize) -> Result<(), CudaError> {
        if !self.branches {
            return Ok(());
        }
        let side = self.side_stream(lane)?;
        Ok(self.stream.join(side)?)
    }

    /// Runs `f` with its launches on side lane `lane`, after everything queued on the
    /// main stream so far ([`Gpu::fork`]); [`Gpu::join`] before using what it wrote.
    pub fn branch<T>(
        &self,
        lane: usize,
        f: impl FnOnce() -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        use std::sync::atomic::Ordering;
        if !self.branches {
            return f();
        }
        self.fork(lane)?;
        let prev = self.lane.swap(lane, Ordering::Relaxed);
        let r = f();
        self.lane.store(prev, Ordering::Relaxed);
        r
    }

    fn side_stream(&self, lane: usize) -> Result<&Arc<CudaStream>, CudaError> {
        lane.checked_sub(1)
            .and_then(|i| self.side.get(i))
            .ok_or_else(|| CudaError::Invalid(format!("no side lane {lane}")))
    }
}

impl Gpu {
    /// Mean milliseconds per call of `f` over `reps` calls, timed with device events
    /// after `warmup` untimed calls.
    pub fn time_ms(
        &self,
        warmup: usize,
        reps: usize,
        mut f: impl FnMut(usize) -> Result<(), CudaError>,
    ) -> Result<f64, CudaError> {
        for i in 0..warmup {
            f(i)?;
        }
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(timing)?;
        let end = self.ctx.new_event(timing)?;
        start.record(&self.stream)?;
        for i in 0..reps {
            f(i)?;
        }
        end.record(&self.stream)?;
        end.synchronize()?;
        Ok(start.elapsed_ms(&end)? as f64 / reps.max(1) as f64)
    }
}

/// A captured sequence of launches (one decoded token), replayed with one call. With
/// programmatic dependencies (see [`Gpu::end_capture`]) it replays its own instance of
/// the rewritten graph.
pub struct TokenGraph {
    graph: cudarc::driver::CudaGraph,
    pdl: Option<PdlExec>,
}

/// A graph instance owned by a [`TokenGraph`].
struct PdlExec {
    exec: sys::CUgraphExec,
    stream: Arc<CudaStream>,
}

impl Drop for PdlExec {
    fn drop(&mut self) {
        // SAFETY: the instance was created by cuGraphInstantiateWithFlags and is
        // destroyed once; errors at teardown have nowhere to go.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
        }
    }
}

// SAFETY: the graph is owned by one session at a time (not Sync); launching binds the
// CUDA context on the calling thread first, so moving it between threads is sound.
unsafe impl Send for TokenGraph {}

impl TokenGraph {
    pub fn launch(&self) -> Result<(), CudaError> {
        match &self.pdl {
            Some(p) => {
                p.stream.context().bind_to_thread()?;
                // SAFETY: exec is a live instance; the stream belongs to its context.
                check(unsafe { sys::cuGraphLaunch(p.exec, p.stream.cu_stream()) })
            }
            None => Ok(self.graph.launch()?),
        }
    }
}

fn check(r: sys::CUresult) -> Result<(), CudaError> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(CudaError::Driver(cudarc::driver::DriverError(e))),
    }
}

/// Turns every kernel → kernel edge of `graph` into a programmatic dependency (the
/// downstream grid may launch once the upstream grid's blocks have triggered or
/// exited; every kernel starts with `griddepcontrol.wait`, which returns once its
/// upstream grids have completed and their writes are visible). Hides the launch and
/// ramp of each small decode kernel behind its predecessor's tail. Returns the number
/// of edges rewritten.
///
/// # Safety
/// `graph` must be a valid graph that is not being instantiated or launched meanwhile.
unsafe fn make_edges_programmatic(graph: sys::CUgraph) -> Result<usize, CudaError> {
    let mut n = 0usize;
    check(sys::cuGraphGetEdges_v2(
        graph,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        &mut n,
    ))?;
    let mut from = vec![std::ptr::null_mut(); n];
    let mut to = vec![std::ptr::null_mut(); n];
    let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); n];
    check(sys::cuGraphGetEdges_v2(
        graph,
        from.as_mut_ptr(),
        to.as_mut_ptr(),
        data.as_mut_ptr(),
        &mut n,
    ))?;
    let is_kernel = |node: sys::CUgraphNode| -> Result<bool, CudaError> {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        check(sys::cuGraphNodeGetType(node, &mut t))?;
        Ok(t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL)
    };
    let mut done = 0;
    for i in 0..n {
        if data[i].type_ != 0 || !is_kernel(from[i])? || !is_kernel(to[i])? {
            continue;
        }
        check(sys::cuGraphRemoveDependencies_v2(
            graph, &from[i], &to[i], &data[i], 1,
        ))?;
        let mut e: sys::CUgraphEdgeData = std::mem::zeroed();
        e.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
        e.type_ = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        check(sys::cuGraphAddDependencies_v2(
            graph, &from[i], &to[i], &e, 1,
        ))?;
        done += 1;
    }
    Ok(done)
}

/// `carveout`: every kernel asks for the same L1 / shared-memory split (the most shared
/// memory), so an SM never drains to reconfigure it between a kernel with a large
/// shared-memory block (indexer scores, staged attention) and its neighbours; off: the
/// driver's default per kernel.
fn set_carveout(f: &CudaFunction, on: bool) -> Result<(), CudaError> {
    f.set_attribute(
        sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        if on { 100 } else { -1 },
    )?;
    Ok(())
}

/// The current context's (least, greatest) stream priority, when the driver has what
/// node priorities need (capture info v3, kernel node attributes) and a range to use.
fn priority_range() -> Option<(i32, i32)> {
    // SAFETY: symbol lookups in the loaded driver library; the range query writes two
    // ints and needs only a current context (Gpu::open made one current).
    unsafe {
        let lib = sys::culib();
        let has = |name: &[u8]| lib.get::<unsafe extern "C" fn()>(name).is_ok();
        if !has(b"cuStreamGetCaptureInfo_v3\0") || !has(b"cuGraphKernelNodeSetAttribute\0") {
            return None;
        }
        let (mut least, mut greatest) = (0, 0);
        if sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
            != sys::CUresult::CUDA_SUCCESS
            || least == greatest
        {
            return None;
        }
        Some((least, greatest))
    }
}

impl Gpu {
    /// Runs `f` with its launches marked as background work: under `prio` their graph
    /// nodes get the lowest priority (throughput work beside a latency-bound chain).
    /// Runs `f` promising that the `sel.ids` of its matvecs are written by no kernel of
    /// the graph (an uploaded constant such as the output projection's group ids), so
    /// the kernels that read them before the PDL wait (`matvec_q8_0_q8_early` and its
    /// several-rows forms) may serve them. Only with `outa_early` (a default).
    pub fn constant_ids<T>(
        &self,
        f: impl FnOnce() -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        use std::sync::atomic::Ordering;
        let on = self.fused("outa_early");
        let prev = self.const_ids.swap(on, Ordering::Relaxed);
        let r = f();
        self.const_ids.store(prev, Ordering::Relaxed);
        r
    }

    pub(crate) fn ids_constant(&self) -> bool {
        self.const_ids.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn background<T>(&self, f: impl FnOnce() -> Result<T, CudaError>) -> Result<T, CudaError> {
        use std::sync::atomic::Ordering;
        let prev = self.background.swap(true, Ordering::Relaxed);
        let r = f();
        self.background.store(prev, Ordering::Relaxed);
        r
    }

    /// Sets the priority of the kernel node just captured on the launch stream (the
    /// stream's only dependency right after a launch).
    fn prioritise_last_node(&self) -> Result<(), CudaError> {
        let Some((least, greatest)) = self.prio_range else {
            return Ok(());
        };
        let p = if self.background.load(std::sync::atomic::Ordering::Relaxed) {
            least
        } else {
            greatest
        };
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let (mut id, mut graph, mut n) = (0u64, std::ptr::null_mut(), 0usize);
        let mut deps: *const sys::CUgraphNode = std::ptr::null();
        let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
        // SAFETY: out-pointers to locals; the returned dependency array is owned by the
        // capture and read before the next call on this stream.
        unsafe {
            check(sys::cuStreamGetCaptureInfo_v3(
                self.launch_stream().cu_stream(),
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                &mut edges,
                &mut n,
            ))?;
            if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
                || n != 1
                || deps.is_null()
            {
                return Ok(());
            }
            let node = *deps;
            let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            check(sys::cuGraphNodeGetType(node, &mut t))?;
            if t != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
                return Ok(());
            }
            let mut v: sys::CUkernelNodeAttrValue = std::mem::zeroed();
            v.priority = p;
            check(sys::cuGraphKernelNodeSetAttribute(
                node,
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY,
                &v,
            ))
        }
    }

    /// Starts recording this GPU's stream into a graph instead of running it.
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        use cudarc::driver::sys::CUstreamCaptureMode_enum as M;
        self.stream
            .begin_capture(M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        self.capturing
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Ends the recording and instantiates the graph; unless `DS4_CUDA_PDL=0`, its
    /// kernel-to-kernel edges become programmatic dependencies (a second instance).
    pub fn end_capture(&self) -> Result<TokenGraph, CudaError> {
        self.capturing
            .store(false, std::sync::atomic::Ordering::Relaxed);
        // Node priorities count only when the instance is told to use them.
        let flags = if self.prio_on() {
            sys::CUgraphInstantiate_flags_enum::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
        } else {
            sys::CUgraphInstantiate_flags_enum(0)
        };
        let Some(graph) = self.stream.end_capture(flags)? else {
            return Err(CudaError::Invalid("graph capture recorded nothing".into()));
        };
        if !self.pdl {
            return Ok(TokenGraph { graph, pdl: None });
        }
        // SAFETY: the graph was just captured and is owned by `graph`; the new instance
        // is owned by the returned TokenGraph and destroyed before it.
        let exec = unsafe {
            make_edges_programmatic(graph.cu_graph())?;
            let mut exec = std::ptr::null_mut();
            check(sys::cuGraphInstantiateWithFlags(
                &mut exec,
                graph.cu_graph(),
                flags.0 as _,
            ))?;
            exec
        };
        Ok(TokenGraph {
            graph,
            pdl: Some(PdlExec {
                exec,
                stream: self.stream.clone(),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_without_a_driver_gets_an_error_not_a_panic() {
        if !driver_present() {
            assert!(matches!(Gpu::open(0), Err(CudaError::NoDriver)));
        }
    }

    #[test]
    fn fuse_settings_parse() {
        assert_eq!(parse_fuse(None), FUSIONS.to_vec());
        assert!(parse_fuse(Some("0")).is_empty());
        assert!(parse_fuse(Some("")).is_empty());
        assert_eq!(
            parse_fuse(Some(" q_norm ,comb_lane,bogus")),
            vec!["comb_lane", "q_norm"]
        );
        // Opt-in names only when named.
        assert!(!parse_fuse(None).contains(&"iq2_lut32"));
        assert!(parse_fuse(Some("iq2_rx,iq2_lut32")).contains(&"iq2_lut32"));
        for opt in FUSIONS_OPT_IN {
            assert!(!FUSIONS.contains(&opt), "{opt} is both default and opt-in");
            assert!(parse_fuse(Some(opt)) == vec![opt]);
        }
        // Edits of the defaults.
        let plus = parse_fuse(Some("+exp_pitch"));
        assert_eq!(plus.len(), FUSIONS.len() + 1);
        assert!(plus.contains(&"exp_pitch") && plus.contains(&"prio"));
        let minus = parse_fuse(Some("-prio, +carveout, bogus"));
        assert!(!minus.contains(&"prio") && minus.contains(&"carveout"));
        assert_eq!(minus.len(), FUSIONS.len());
        assert_eq!(parse_fuse(Some("+exp_pitch,-exp_pitch")), FUSIONS.to_vec());
        assert_eq!(parse_fuse(Some("-q_norm,q_norm")), FUSIONS.to_vec());
    }

    #[test]
    fn the_kernel_source_is_embedded() {
        assert!(SOURCE.contains("matvec_q8_0") && SOURCE.contains("warp_sum"));
        if cfg!(ds4_fatbin) {
            assert!(!FATBIN.is_empty());
        }
    }
}
