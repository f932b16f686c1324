//! Imatrix collection on the GPU (`crate::imatrix`): an un-graphed batched prefill
//! during which the FFN sublayer of every layer (`state/layers.rs`, `ffn`) downloads
//! its routed experts' inputs — the normed rows `s.n`, the selected experts `s.ids`
//! and the route-weighted SwiGLU rows `s.mid` — and hands them to the observer.
//!
//! The observer reaches `ffn` through a thread-local slot set only for the duration of
//! [`CudaBackend::observed_prefill`], so the layer code needs no new parameter and the
//! captured decode graphs never see it (the observed path never captures).

use std::cell::Cell;

use ds4_cuda::{CudaError, DeviceBuf, Gpu};

use super::CudaBackend;
use crate::error::Result;
use crate::imatrix::{MoeActivations, MoeObserver};

type Slot = Option<*mut (dyn MoeObserver + 'static)>;

thread_local! {
    static OBSERVER: Cell<Slot> = const { Cell::new(None) };
}

/// Clears the slot when the observed call ends, also on unwinding.
struct Clear(Slot);

impl Drop for Clear {
    fn drop(&mut self) {
        OBSERVER.with(|o| o.set(self.0));
    }
}

/// Runs `f` with `obs` as this thread's observer.
fn with_observer<R>(obs: &mut dyn MoeObserver, f: impl FnOnce() -> R) -> R {
    let p: *mut (dyn MoeObserver + '_) = obs;
    // SAFETY: only the lifetime bound of the trait object is erased. The pointer is
    // dereferenced solely by `observe`, on this thread, while `f` runs (the `Clear`
    // guard restores the previous slot before `obs`'s borrow ends, even on panic), and
    // `observe` never runs re-entrantly, so the `&mut` is unique while it is used.
    let p: *mut (dyn MoeObserver + 'static) = unsafe { std::mem::transmute(p) };
    let _clear = Clear(OBSERVER.with(|o| o.replace(Some(p))));
    f()
}

/// Called by `ffn` after the routed SwiGLU: when an observed prefill runs on this
/// thread, downloads the first `n` tokens' rows (synchronising the stream) and calls
/// the observer; otherwise does nothing.
pub(super) fn observe(
    g: &Gpu,
    layer: usize,
    n: usize,
    (x, ids, mid): (&DeviceBuf<f32>, &DeviceBuf<i32>, &DeviceBuf<f32>),
    (e, k, ff): (usize, usize, usize),
) -> std::result::Result<(), CudaError> {
    let Some(p) = OBSERVER.with(|o| o.get()) else {
        return Ok(());
    };
    let xs = g.download_prefix(x, n * e)?;
    let experts: Vec<u32> = g
        .download_prefix(ids, n * k)?
        .into_iter()
        .map(|v| u32::try_from(v).unwrap_or(u32::MAX))
        .collect();
    let mids = g.download_prefix(mid, n * k * ff)?;
    // SAFETY: see `with_observer`; the slot is only set while the observer is borrowed.
    let obs = unsafe { &mut *p };
    obs.observe(&MoeActivations {
        layer,
        n_tokens: n,
        x: &xs,
        experts: &experts,
        mid: &mids,
    });
    Ok(())
}

impl CudaBackend {
    /// `Backend::forward_observed`: the batched prefill chunk by chunk (also for one
    /// token, so no decode graph is captured or replayed), no logits.
    pub(super) fn observed_prefill(
        &mut self,
        tokens: &[u32],
        obs: &mut dyn MoeObserver,
    ) -> Result<()> {
        self.state.accept_rows();
        self.check_tokens(tokens)?;
        self.fresh()?;
        let chunk = self.state.chunk();
        with_observer(obs, || {
            for part in tokens.chunks(chunk) {
                self.state
                    .prefill(&self.weights, self.numerics, part, false, false)?;
            }
            Ok(())
        })
    }
}
