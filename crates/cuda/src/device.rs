use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

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
    /// The most shared memory a block may ask for (opt-in): the 32-copy IQ2_XXS tables'
    /// kernels need 80 KB (`iq2_lut32`) and 128 KB (`iq2_prmt`), more than some GPUs give.
    pub smem_optin: usize,
    pub kernels: KernelSource,
}

/// CUDA devices visible to this process (0 without a driver).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// One GPU with its main stream, side streams for parallel branches of a token's work
/// (see [`Gpu::fork`]) and the ds4 kernel module loaded.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// Side streams; lane i ≥ 1 launches on `side[i - 1]`.
    pub(crate) side: Vec<Arc<CudaStream>>,
    /// The lane kernels launch on now (0: the main stream).
    lane: std::sync::atomic::AtomicUsize,
    /// `DS4_CUDA_BRANCHES=0`: every lane is the main stream (branches run in order).
    pub(crate) branches: bool,
    /// `DS4_CUDA_PDL=0`: captured graphs keep full (completion) dependencies.
    pub(crate) pdl: bool,
    module: Arc<CudaModule>,
    funcs: Mutex<HashMap<&'static str, CudaFunction>>,
    /// The dynamic shared memory each kernel has been allowed so far (`allow_smem`).
    smem_allowed: Mutex<HashMap<&'static str, usize>>,
    pub(crate) iq2_grid: CudaSlice<u64>,
    /// Matrix ids 0 and 1: the selections of a two-matrix launch (`matvec_q8act_pair`).
    pub(crate) pair_ids: CudaSlice<i32>,
    info: GpuInfo,
    /// `DS4_CUDA_PROFILE=1`: per-kernel device time (events around every launch).
    profile: Option<Mutex<Profile>>,
    /// `DS4_CUDA_SKIP=k1,k2`: kernels not launched at all (timing diagnosis: what a
    /// kernel costs inside the decode graph; every output after them is wrong).
    skip: Vec<String>,
    /// `DS4_CUDA_TRACE=FILE`: every kernel's start and end (CUPTI), written by
    /// [`Gpu::trace_finish`].
    trace: Mutex<Option<crate::trace::KernelTrace>>,
    /// Pinned buffers of [`Gpu::upload_gather`] while weights are being uploaded.
    pub(crate) staging: Mutex<Option<crate::upload::Staging>>,
    /// Page-locked host memory that [`Gpu::download_f32`] copies logits through
    /// (grown on demand; `None` inside when pinning failed: plain copies then).
    readback: Mutex<Option<cudarc::driver::PinnedHostSlice<f32>>>,
    /// The context's (least, greatest) priority when the driver supports node
    /// priorities. Under `prio` captured kernels get the greatest, those launched
    /// inside [`Gpu::background`] the least.
    pub(crate) prio_range: Option<(i32, i32)>,
    /// A graph capture is running (set by begin_capture / end_capture).
    pub(crate) capturing: std::sync::atomic::AtomicBool,
    /// Launches are background work (see [`Gpu::background`]).
    pub(crate) background: std::sync::atomic::AtomicBool,
    /// Launches select their matrices through ids that no kernel writes (see
    /// [`crate::Launcher::constant_ids`]).
    pub(crate) const_ids: std::sync::atomic::AtomicBool,
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
        let smem_optin = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            .max(0) as usize;
        let (module, kernels) = load_kernels(&ctx, cc)?;
        let info = GpuInfo {
            name: ctx.name()?,
            compute_capability: cc,
            multiprocessors,
            total_mem: ctx.total_mem()?,
            l2_bytes,
            smem_optin,
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
            smem_allowed: Mutex::new(HashMap::new()),
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
            prio_range: crate::graph::priority_range(),
            trace: Mutex::new(trace),
            staging: Mutex::new(None),
            readback: Mutex::new(None),
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

    /// The kernels `DS4_CUDA_SKIP` keeps from launching (empty normally): a program
    /// that times with them skipped should say so, its outputs are wrong.
    pub fn skipped(&self) -> &[String] {
        &self.skip
    }

    /// Runs `launch` between two timing events when profiling; not at all when
    /// `DS4_CUDA_SKIP` names the kernel.
    /// Under `prio` a captured launch gets its node priority (see [`Gpu::background`]).
    pub(crate) fn timed_prio(
        &self,
        name: &'static str,
        prio: bool,
        launch: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        if !self.skip.is_empty() && self.skip.iter().any(|k| k == name) {
            return Ok(());
        }
        let Some(p) = &self.profile else {
            launch()?;
            if prio && self.capturing.load(std::sync::atomic::Ordering::Relaxed) {
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
    /// The launchers call this before every launch; the driver is asked only when the
    /// kernel needs more than it was allowed before (the limit is a maximum).
    pub(crate) fn allow_smem(&self, name: &'static str, bytes: usize) -> Result<(), CudaError> {
        if bytes <= 48 << 10 {
            return Ok(());
        }
        let mut allowed = self.smem_allowed.lock().expect("shared memory table lock");
        if allowed.get(name).is_some_and(|&b| b >= bytes) {
            return Ok(());
        }
        let f = self.func(name)?;
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )?;
        allowed.insert(name, bytes);
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

    /// The first `n` values of an f32 device buffer (logits, every token), through
    /// page-locked memory: a pageable copy of a 129k-vocabulary row took ~150 µs on
    /// the H200 (staging and page faults), ~2.5% of a decode token; pinned, the DMA
    /// runs at full PCIe rate and one memcpy fills the Vec. Falls back to a plain
    /// copy where the host cannot pin memory.
    pub fn download_f32(&self, dev: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>, CudaError> {
        self.download_f32_at(dev, 0, n)
    }

    /// [`Gpu::download_f32`] of the `n` values from index `start` (a step's logits row).
    pub fn download_f32_at(
        &self,
        dev: &CudaSlice<f32>,
        start: usize,
        n: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let start = start.min(dev.len());
        let n = n.min(dev.len() - start);
        let mut guard = self.readback.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|p| p.len() < n) {
            // Flags 0: cached host memory (write-combined memory is slow to read).
            // SAFETY: the memory is only read after a copy into it completed.
            *guard = unsafe {
                self.ctx
                    .alloc_pinned_with_flags::<f32>(n.next_power_of_two(), 0)
            }
            .ok();
        }
        let Some(pinned) = guard.as_mut() else {
            drop(guard);
            let mut out = vec![0f32; n];
            self.stream
                .memcpy_dtoh(&dev.slice(start..start + n), &mut out)?;
            self.stream.synchronize()?;
            return Ok(out);
        };
        let host = pinned.as_mut_slice()?;
        let (src, _record) = dev.device_ptr(&self.stream);
        let src = src + (start * std::mem::size_of::<f32>()) as u64;
        // SAFETY: `host[..n]` is page-locked memory of n floats and `src` a device
        // buffer of at least n; the stream is synchronised before the host reads it.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut host[..n], src, self.stream.cu_stream())?
        };
        self.stream.synchronize()?;
        Ok(host[..n].to_vec())
    }

    /// The first `n` values of a device buffer.
    pub fn download_prefix<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        n: usize,
    ) -> Result<Vec<T>, CudaError> {
        let n = n.min(dev.len());
        let mut out = vec![T::default(); n];
        self.stream.memcpy_dtoh(&dev.slice(0..n), &mut out)?;
        self.stream.synchronize()?;
        Ok(out)
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
            Err(e) if cc.0 < 9 => tracing::warn!(
                "prebuilt kernels do not load on sm_{}{} ({e}); compiling with NVRTC",
                cc.0,
                cc.1
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
pub const SIDE_LANES: usize = 4;

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

    /// Makes side lane `waiter` wait for everything queued on side lane `on` so far
    /// (a branch that needs another branch's result; under capture, a graph edge).
    pub fn lane_wait(&self, waiter: usize, on: usize) -> Result<(), CudaError> {
        if !self.branches {
            return Ok(());
        }
        let (w, o) = (self.side_stream(waiter)?, self.side_stream(on)?);
        Ok(w.join(o)?)
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

    /// The launch lane of the work being enqueued (0: the main stream, and every lane
    /// when branches are off).
    pub(crate) fn current_lane(&self) -> usize {
        self.lane.load(std::sync::atomic::Ordering::Relaxed)
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
    fn the_kernel_source_is_embedded() {
        assert!(SOURCE.contains("matvec_q8_0") && SOURCE.contains("warp_sum"));
        if cfg!(ds4_fatbin) {
            assert!(!FATBIN.is_empty());
        }
    }
}
