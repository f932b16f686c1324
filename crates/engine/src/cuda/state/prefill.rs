//! A prefill chunk on the GPU: the chunk's buffers, one set per GPU and shared by its
//! sessions ([`PrefillWork`]), and a session's chunk through them.

use ds4_cuda::CudaError;

use super::{work_bytes_per_token, DeviceState, Work};
use crate::cuda::weights::CudaWeights;
use crate::error::{EngineError, Result};
use crate::ops::linear::Numerics;

/// The prefill chunk's buffers of one GPU ([`CudaWeights::prefill_work`]): every session
/// of an upload prefills through them, one chunk at a time on the GPU's one stream, so a
/// chunk's ~1 MB a token of scratch is paid once per GPU, not once per session (a pool
/// of sessions at 8,192-token chunks would otherwise hold ~8 GB each).
pub(crate) struct PrefillWork {
    pub(super) work: Work,
    /// The context and attention stride the buffers were sized for (the indexer scores
    /// and split-attention partials depend on them): a session of another context
    /// allocates them again.
    ctx: usize,
    att_stride: usize,
}

/// The shared prefill buffers (`slot`) sized for a session of `ctx` tokens with chunks of
/// `chunk`: kept when they fit, else dropped and allocated again.
pub(super) fn prefill_work<'a>(
    slot: &'a mut Option<PrefillWork>,
    w: &CudaWeights,
    ctx: usize,
    chunk: usize,
    att_stride: usize,
) -> Result<&'a mut Work> {
    let fits = slot
        .as_ref()
        .is_some_and(|p| p.ctx == ctx && p.att_stride == att_stride && p.work.s.cap >= chunk);
    if !fits {
        // The old buffers go before the new ones are allocated (one fits where two may not).
        *slot = None;
        let g = &*w.gpu;
        let before = g.mem_info().map_or(0, |(free, _)| free);
        let work = Work::new(g, &w.config, ctx, chunk, att_stride)?;
        let after = g.mem_info().map_or(0, |(free, _)| free);
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        tracing::debug!(
            "prefill buffers for {chunk} tokens: {:.3} GiB ({:.3} GiB free after; estimate {:.3})",
            gib(before.saturating_sub(after)),
            gib(after),
            gib(chunk * work_bytes_per_token(&w.config, ctx))
        );
        *slot = Some(PrefillWork {
            work,
            ctx,
            att_stride,
        });
    }
    Ok(&mut slot.as_mut().expect("allocated above").work)
}

impl DeviceState {
    /// Runs `tokens` (at most `chunk()`) at positions `n_tokens..` as one batch; with
    /// `all_rows` the logits of every token are returned, otherwise (with `head`) the
    /// last token's.
    pub fn prefill(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        tokens: &[u32],
        head: bool,
        all_rows: bool,
    ) -> Result<Vec<f32>> {
        let n = tokens.len();
        if n == 0 || n > self.chunk {
            return Err(EngineError::Invalid(format!(
                "prefill batch of {n} tokens (chunk {})",
                self.chunk
            )));
        }
        let g = &*w.gpu;
        let mut slot = w.prefill_work();
        let b = prefill_work(&mut slot, w, self.ctx, self.chunk, self.att_stride)?;
        debug_assert!(n <= b.s.cap);
        b.s.write_steps(g, self.n_tokens, tokens)?;
        self.enqueue_layers(w, numerics, b, n)?;
        let c = &w.config;
        let row = c.n_hc * c.n_embd;
        // The MTP draft's `HcSource::Last`: the batch's last row, into this session's
        // decode scratch (the shared buffers are the next session's to overwrite).
        {
            let src = b.s.h.slice((n - 1) * row..n * row);
            let mut dst = self.s.s.h.slice_mut(0..row);
            g.stream()
                .memcpy_dtod(&src, &mut dst)
                .map_err(CudaError::from)?;
        }
        self.last_hc = Some(g.ptr(&self.s.s.h));
        let bytes = (row * 4) as u64;
        let mut out = Vec::new();
        if all_rows {
            for t in 0..n {
                self.head(w, numerics, g.ptr(&b.s.h) + t as u64 * bytes)?;
                out.extend(g.download_f32(&self.s.s.logits, usize::MAX)?);
            }
        } else if head {
            self.head(w, numerics, g.ptr(&b.s.h) + (n as u64 - 1) * bytes)?;
            out = g.download_f32(&self.s.s.logits, usize::MAX)?;
        }
        self.n_tokens += n;
        Ok(out)
    }

    /// A later stage of a split model (`cuda/split.rs`): the previous GPU's streams of
    /// the next `prefill` (`batched`) or `decode`'s tokens, `[n][n_hc·n_embd]`, into
    /// the scratch that pass starts from (it embeds nothing: `w.range` starts past 0).
    pub fn set_input(&mut self, w: &CudaWeights, rows: &[f32], batched: bool) -> Result<()> {
        let g = &*w.gpu;
        if !batched {
            return self.s.s.set_streams(g, rows);
        }
        let mut slot = w.prefill_work();
        let work = prefill_work(&mut slot, w, self.ctx, self.chunk, self.att_stride)?;
        work.s.set_streams(g, rows)
    }

    /// The streams of the last pass's `n` tokens (after a `prefill` when `batched`,
    /// else a `decode`), `[n][n_hc·n_embd]`: what the next stage of a split starts from.
    pub fn hidden(&self, w: &CudaWeights, n: usize, batched: bool) -> Result<Vec<f32>> {
        let c = &w.config;
        if !batched {
            return self.s.s.streams(&w.gpu, c, n);
        }
        // The split's stages run a chunk and hand its streams on in one call, so no other
        // session's chunk comes between.
        let slot = w.prefill_work();
        let work = slot
            .as_ref()
            .filter(|p| p.ctx == self.ctx && p.work.s.cap >= n)
            .ok_or_else(|| EngineError::Invalid("no batch ran yet".into()))?;
        work.work.s.streams(&w.gpu, c, n)
    }
}
