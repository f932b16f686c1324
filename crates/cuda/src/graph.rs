//! Captured decode graphs: capture, programmatic (PDL) edges, node priorities.

use std::sync::Arc;

use cudarc::driver::{sys, CudaStream, LaunchArgs, LaunchConfig};

use crate::device::Gpu;
use crate::error::CudaError;
use crate::plan::{Launcher, Variant};

/// A captured sequence of launches (one decoded token), replayed with one call. With
/// programmatic dependencies (see [`Launcher::end_capture`]) it replays its own instance of
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

/// The current context's (least, greatest) stream priority, when the driver has what
/// node priorities need (capture info v3, kernel node attributes) and a range to use.
pub(crate) fn priority_range() -> Option<(i32, i32)> {
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

impl Launcher<'_> {
    /// Runs `f` promising that the `sel.ids` of its matvecs are written by no kernel of
    /// the graph (an uploaded constant such as the output projection's group ids), so
    /// the kernels that read them before the PDL wait (`matvec_q8_0_q8_early` and its
    /// several-rows forms) may serve them. Only under [`Variant::OutaEarly`].
    pub fn constant_ids<T>(
        &self,
        f: impl FnOnce() -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        use std::sync::atomic::Ordering;
        let on = self.on(Variant::OutaEarly);
        let prev = self.const_ids.swap(on, Ordering::Relaxed);
        let r = f();
        self.const_ids.store(prev, Ordering::Relaxed);
        r
    }

    /// Runs `launch` as [`Gpu::timed_prio`] does, with node priorities under
    /// [`Variant::Prio`].
    pub(crate) fn timed(
        &self,
        name: &'static str,
        launch: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        self.gpu().timed_prio(name, self.on(Variant::Prio), launch)
    }

    /// Launches the built call `b` of kernel `name` under [`Launcher::timed`].
    ///
    /// # Safety
    /// `b` holds exactly the parameters of kernel `name`, in order and with its types,
    /// over buffers as large as the kernel reads and writes with `cfg`.
    pub(crate) unsafe fn launch_timed(
        &self,
        name: &'static str,
        b: &mut LaunchArgs<'_>,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        self.timed(name, || {
            // SAFETY: the caller's contract above.
            unsafe { b.launch(cfg) }?;
            Ok(())
        })
    }

    /// Ends the recording ([`Gpu::begin_capture`]) and instantiates the graph, using
    /// node priorities under [`Variant::Prio`]; see [`Gpu::end_capture_prio`].
    pub fn end_capture(&self) -> Result<TokenGraph, CudaError> {
        self.gpu().end_capture_prio(self.on(Variant::Prio))
    }

    /// The launches `f` makes, recorded into a graph ([`Gpu::begin_capture`],
    /// [`Launcher::end_capture`]). The recording ends even when `f` fails, and then
    /// `f`'s error is the one returned.
    pub fn capture<E: From<CudaError>>(
        &self,
        f: impl FnOnce() -> Result<(), E>,
    ) -> Result<TokenGraph, E> {
        self.begin_capture()?;
        let enqueued = f();
        let graph = self.end_capture();
        enqueued?;
        Ok(graph?)
    }
}

impl Gpu {
    pub(crate) fn ids_constant(&self) -> bool {
        self.const_ids.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs `f` with its launches marked as background work: under `prio` their graph
    /// nodes get the lowest priority (throughput work beside a latency-bound chain).
    pub fn background<T>(&self, f: impl FnOnce() -> Result<T, CudaError>) -> Result<T, CudaError> {
        use std::sync::atomic::Ordering;
        let prev = self.background.swap(true, Ordering::Relaxed);
        let r = f();
        self.background.store(prev, Ordering::Relaxed);
        r
    }

    /// Sets the priority of the kernel node just captured on the launch stream (the
    /// stream's only dependency right after a launch).
    pub(crate) fn prioritise_last_node(&self) -> Result<(), CudaError> {
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

    /// Ends the recording and instantiates the graph (with node priorities when `prio`
    /// and the driver has them); unless `DS4_CUDA_PDL=0`, its kernel-to-kernel edges
    /// become programmatic dependencies (a second instance).
    pub(crate) fn end_capture_prio(&self, prio: bool) -> Result<TokenGraph, CudaError> {
        self.capturing
            .store(false, std::sync::atomic::Ordering::Relaxed);
        // Node priorities count only when the instance is told to use them.
        let flags = if prio && self.prio_range.is_some() {
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
