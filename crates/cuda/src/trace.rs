//! `DS4_CUDA_TRACE=FILE`: the start and end of every kernel on the GPU, graph replays
//! included, from CUPTI's concurrent-kernel activity records, written as CSV when the
//! trace is finished. It shows what overlaps and what waits inside a decode graph
//! (programmatic dependent launch, side lanes), which per-launch events
//! (`DS4_CUDA_PROFILE`, kernels serialised) and skip runs (`DS4_CUDA_SKIP`) only
//! approximate. Needs `libcupti.so.13` on the library path (the PyPI wheel
//! `nvidia-cuda-cupti==13.0.*` carries it); without it the trace is refused with a
//! message and nothing else changes. `bench/trace-summary.py` reads the CSV.

use std::alloc::{alloc, dealloc, Layout};
use std::ffi::CStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use cudarc::cupti::result::activity;
use cudarc::cupti::sys;

use crate::error::CudaError;

/// One kernel execution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelRecord {
    pub name: String,
    pub stream: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    /// 0 outside a graph.
    pub graph_node: u64,
    pub correlation: u32,
}

const BUFFER_BYTES: usize = 8 << 20;
const BUFFER_ALIGN: usize = 8;

/// Records delivered by CUPTI's buffer callbacks (its own thread) until `finish`.
static RECORDS: Mutex<Vec<KernelRecord>> = Mutex::new(Vec::new());

fn buffer_layout() -> Layout {
    Layout::from_size_align(BUFFER_BYTES, BUFFER_ALIGN).expect("constant layout")
}

extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // SAFETY: CUPTI passes valid out-pointers; the buffer is freed in buffer_completed,
    // which CUPTI calls for every buffer it was given.
    unsafe {
        *buffer = alloc(buffer_layout());
        *size = if (*buffer).is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0;
    }
}

extern "C" fn buffer_completed(
    _ctx: cudarc::driver::sys::CUcontext,
    _stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    if buffer.is_null() {
        return;
    }
    let mut out = Vec::new();
    let mut record: *mut sys::CUpti_Activity = std::ptr::null_mut();
    // SAFETY: CUPTI hands back a buffer of ours with `valid` bytes of records; each
    // record it returns starts with its kind, and concurrent-kernel records share the
    // CUpti_ActivityKernel10 prefix (kind … graphNodeId) in every later version.
    unsafe {
        while activity::get_next_record(buffer, valid, &mut record).is_ok() {
            if (*record).kind != sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL {
                continue;
            }
            let k = &*(record as *const sys::CUpti_ActivityKernel10);
            let name = if k.name.is_null() {
                String::from("?")
            } else {
                CStr::from_ptr(k.name).to_string_lossy().into_owned()
            };
            out.push(KernelRecord {
                name,
                stream: k.streamId,
                start_ns: k.start,
                end_ns: k.end,
                graph_node: k.graphNodeId,
                correlation: k.correlationId,
            });
        }
        dealloc(buffer, buffer_layout());
    }
    if let Ok(mut r) = RECORDS.lock() {
        r.extend(out);
    }
}

fn cupti_err(what: &str, e: impl std::fmt::Debug) -> CudaError {
    CudaError::Invalid(format!("DS4_CUDA_TRACE: {what}: {e:?}"))
}

/// A running kernel trace (one per process).
pub struct KernelTrace {
    path: PathBuf,
}

impl KernelTrace {
    /// Starts recording every kernel from now on. Call before any graph is captured.
    pub fn start(path: &Path) -> Result<KernelTrace, CudaError> {
        // SAFETY: only probes whether the library loads.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Invalid(
                "DS4_CUDA_TRACE needs libcupti.so.13 on the library path (pip install \
                 nvidia-cuda-cupti==13.0.*, then LD_LIBRARY_PATH=…/nvidia/cu13/lib)"
                    .into(),
            ));
        }
        RECORDS
            .lock()
            .map_err(|_| cupti_err("lock", "poisoned"))?
            .clear();
        activity::register_callbacks(Some(buffer_requested), Some(buffer_completed))
            .map_err(|e| cupti_err("register callbacks", e))?;
        activity::enable(sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
            .map_err(|e| cupti_err("enable kernel records", e))?;
        Ok(KernelTrace {
            path: path.to_path_buf(),
        })
    }

    /// Where the CSV goes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops recording, writes the CSV (`name,stream,start_ns,end_ns,graph_node,
    /// correlation`, by start time) and returns how many kernels it holds. Call after
    /// the device work is complete (a synchronised stream).
    pub fn finish(self) -> Result<usize, CudaError> {
        // CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: deliver incomplete buffers too.
        activity::flush_all(1).map_err(|e| cupti_err("flush", e))?;
        activity::disable(sys::CUpti_ActivityKind::CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
            .map_err(|e| cupti_err("disable", e))?;
        let mut records =
            std::mem::take(&mut *RECORDS.lock().map_err(|_| cupti_err("lock", "poisoned"))?);
        records.sort_by_key(|r| (r.start_ns, r.end_ns));
        write_csv(&self.path, &records)
            .map_err(|e| CudaError::Invalid(format!("{}: {e}", self.path.display())))?;
        Ok(records.len())
    }
}

/// The trace CSV (kernel names have no commas: they are C identifiers).
pub fn write_csv(path: &Path, records: &[KernelRecord]) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(f, "name,stream,start_ns,end_ns,graph_node,correlation")?;
    for r in records {
        writeln!(
            f,
            "{},{},{},{},{},{}",
            r.name.replace(',', ";"),
            r.stream,
            r.start_ns,
            r.end_ns,
            r.graph_node,
            r.correlation
        )?;
    }
    f.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_csv_has_one_row_per_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.csv");
        let r = |name: &str, start| KernelRecord {
            name: name.into(),
            stream: 7,
            start_ns: start,
            end_ns: start + 5,
            graph_node: 3,
            correlation: 1,
        };
        write_csv(&path, &[r("hc_pre", 10), r("a,b", 20)]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "name,stream,start_ns,end_ns,graph_node,correlation"
        );
        assert_eq!(lines[1], "hc_pre,7,10,15,3,1");
        assert_eq!(lines[2], "a;b,7,20,25,3,1");
    }
}
