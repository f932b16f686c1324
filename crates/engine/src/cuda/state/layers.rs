//! One layer's launches (attention and FFN sublayers) for a batch of tokens (the
//! projection helpers they share: `products.rs`).

use ds4_cuda::kvt;
use ds4_cuda::{
    ActRule, Batch, CudaError, DecodePlan, DeviceBuf, DeviceMatrix, Gpu, Launcher, MatSel,
    QuantAct, RoutePlan, Variant,
};
use ds4_gguf::GgmlType;

use super::products::{
    compressor_inputs, dense_f32, f32_gemm_format, gemm, hc_params, mv, plain, rows, Gemm,
    SMALL_BATCH,
};
use super::{att_splits, comp_cap, LayerState, QuantBufs, Scratch, Work, ATT_SPLITS_ROWS};
use crate::backend::MAX_ROWS;
use crate::config::Config;
use crate::cuda::weights::{CompressorDev, CudaWeights, HcDev, LayerDev};
use crate::error::Result;
use crate::ops::linear::Numerics;
use crate::steer::Component;

/// Most tokens of a multi-row step whose indexer runs as one `indexer_step` launch (a
/// token a grid row; variant `idx_step_rows`): an MTP verify of up to 4 drafts.
const IDX_STEP_ROWS: usize = 5;

/// The KV state as the layer launches see it.
pub(super) struct KvView<'a> {
    pub(super) layers: &'a [LayerState],
    pub(super) window: usize,
    pub(super) raw_cap: usize,
    pub(super) ctx: usize,
    /// The session's plan: the layers launch through `gpu.launcher(plan)`.
    pub(super) plan: DecodePlan,
    /// A multi-row step's journal: per layer, where its compressors' inputs go (main,
    /// indexer) instead of the scratch, so that a rollback can replay them
    /// ([`KvView::replay_compressors`]).
    pub(super) journal: Option<&'a [(u64, u64)]>,
    /// Directional steering (state/steer.rs; `None`: off, nothing launched).
    pub(super) steer: Option<&'a super::steer::SteerDev>,
    /// A batched step over several sessions (state/batch.rs): the device address of
    /// the per-layer KV tables (`[n_layer][MAX_ROWS][kvt::STRIDE]`), whose rows name
    /// each token's own session's buffers; `layers` then only says which buffers a
    /// layer has, and no launch reads their addresses. 0: one session.
    pub(super) kvt: u64,
    /// The device address of an `i32` that lowers `window` in the attention (the MTP
    /// block's ring count, state/mtp.rs); 0: `window` as given.
    pub(super) window_at: u64,
    /// Positions written once the pass's tokens are (a prefill chunk: n_tokens + n; else
    /// ctx): how many compressed rows a chunk's fp16 copies cover.
    pub(super) end: usize,
    /// A decode graph keyed on which compressors emit (`comp_defer`): a position of
    /// that key. `None`: every compressor may emit (their results joined before the
    /// attention).
    pub(super) emit_pos: Option<usize>,
}

/// A projection's input: f32 rows at `x`, their Q8_0 form in `xq` (already written
/// when the flag is set; else the projection writes it where it needs it).
type Src<'q> = (u64, &'q mut QuantAct, bool);

/// What the launches of one sublayer over a batch of `n` tokens share: the launcher,
/// the config, the scratch buffers, the tokens' step records, the layer's RoPE and the
/// numeric mode.
pub(super) struct Pass<'a> {
    g: Launcher<'a>,
    c: &'a Config,
    s: &'a Scratch,
    /// The layer index (its per-layer tables: SwiGLU clamps).
    il: usize,
    /// The layer's weights and KV state (`w.layers[il]` and its state, or the MTP block's).
    l: &'a LayerDev,
    st: &'a LayerState,
    /// Where the compressors' inputs go: the journal of a multi-row step, else the
    /// scratch (`ckv`, `icv`).
    kvs: (u64, u64),
    n: usize,
    step: u64,
    rope: ds4_cuda::RopeP,
    fast: bool,
    /// The layer's KV table of a batched step over several sessions ([`KvView::kvt`]
    /// at this layer), else 0.
    kvt: u64,
    /// The layer's compressors may emit a row at this pass's token (see
    /// [`KvView::emit_pos`]); when not, their work need not precede the attention.
    emits: bool,
    /// The next layer's attention HC when it runs right after this pass's FFN on the
    /// same scratch (the forward's layer loop), so that the FFN's end can form its mix
    /// and Gram shares (`hc_gram`).
    next_attn: Option<&'a HcDev>,
}

impl Pass<'_> {
    /// The address of a state buffer of this layer for the launches: 0 under a KV
    /// table (each row's own comes from the table), so that no launch of a batched
    /// step can touch one session's state through another's address.
    fn state(&self, b: &DeviceBuf<f32>) -> u64 {
        if self.kvt != 0 {
            0
        } else {
            self.g.ptr(b)
        }
    }

    /// The KV table at `field` (`kvt::SKV`, ...), or 0.
    fn kvt_at(&self, field: usize) -> u64 {
        if self.kvt != 0 {
            self.kvt + (field * 8) as u64
        } else {
            0
        }
    }

    /// A sublayer's start: its RMS-normed input (weights `norm_w`) from the streams `h`
    /// into `s.n` (`hc_pre` also leaves the unweighted input in `s.y`; under `hc_gram`
    /// `hc_start_gram` does not); in the fast numerics, when `first` (the sublayer's
    /// first projection) is Q8_0, also into `xq` (its Q8_0 input).
    /// Under `comb_lane`, hc_post's comb matrix is forked to side lane 3 as background
    /// work (joined before hc_post). Returns whether `xq` now holds `s.n`, and whether
    /// the comb matrix was forked (else the caller forms it on a lane of its choosing).
    fn sublayer_begin(
        &self,
        hc: &HcDev,
        h: u64,
        norm_w: u64,
        xq: &mut QuantAct,
        first: &DeviceMatrix,
    ) -> Result<(bool, bool), CudaError> {
        let (g, c, s, n_tok) = (&self.g, self.c, self.s, self.n);
        let quantize = self.fast && first.ty == GgmlType::Q8_0;
        if quantize && (xq.cols != c.n_embd || xq.rows < n_tok) {
            return Err(CudaError::Invalid(format!(
                "hc_pre: {n_tok}×{} into activations of {}×{}",
                c.n_embd, xq.rows, xq.cols
            )));
        }
        let norm = ds4_cuda::HcNorm {
            w: norm_w,
            w_type: ds4_cuda::WT_F32,
            eps: c.rms_eps,
            out: g.ptr(&s.n),
            q: if quantize { g.ptr(&xq.q) } else { 0 },
            d: if quantize { g.ptr(&xq.d) } else { 0 },
        };
        let (mix, y) = (g.ptr(&s.mix), g.ptr(&s.y));
        // `hc_gram`: the previous sublayer's end (`hc_post_gram`) formed this mix's
        // shares from these streams when its mark names the weights and the streams;
        // else they are formed here, so that every start has the same bits.
        let prepared = s.gram_for.take() == Some((hc.fn_.part_ptr(g, 0), h));
        if prepared || self.gram_fits(hc) {
            let sh = g.ptr(&s.gram);
            if !prepared {
                g.hc_gram_shares(n_tok, h, c.n_embd, &hc.fn_, sh)?;
            }
            g.hc_start_gram(n_tok, (h, sh), &self.hc(hc), c.rms_eps, mix, norm)?;
        } else {
            g.hc_mix_mat(n_tok, h, &hc.fn_, c.rms_eps, mix)?;
            g.hc_pre(n_tok, (h, mix), &self.hc(hc), y, Some(norm))?;
        }
        let comb_lane = g.on(Variant::CombLane);
        if comb_lane {
            g.branch(3, || g.background(|| self.hc_comb(hc)))?;
        }
        Ok((quantize, comb_lane))
    }

    /// Whether the sublayer start of `hc` takes the Gram form (`hc_gram`): it sums in
    /// another order than hc_mix / hc_pre, so fast numerics only, and only for the few
    /// tokens its per-token blocks suit (a decode token, a step).
    fn gram_fits(&self, hc: &HcDev) -> bool {
        let (g, c) = (&self.g, self.c);
        self.fast
            && self.n <= SMALL_BATCH
            && g.on(Variant::HcGram)
            && ds4_cuda::hc_gram_fits(c.n_hc, c.n_embd, &hc.fn_)
            && self.s.gram.len() >= ds4_cuda::hc_gram_floats(self.n, c.n_embd)
    }

    /// The launch parameters of the hyper-connection `hc`.
    fn hc(&self, hc: &HcDev) -> ds4_cuda::HcParams {
        hc_params(&self.g, self.c, hc)
    }

    /// post and comb (`s.hcp`, read by hc_post) from the mix of `sublayer_begin`: launched
    /// on a side lane, beside the sublayer.
    fn hc_comb(&self, hc: &HcDev) -> Result<(), CudaError> {
        let (g, s) = (&self.g, self.s);
        g.hc_comb(self.n, g.ptr(&s.mix), &self.hc(hc), g.ptr(&s.hcp))
    }

    /// A sublayer's end: hc_post of its output `out` plus the `k` rows at `parts` (the
    /// routed experts'; k = 0: none) from the streams `h` into `h_out`, once side lane
    /// 3's comb matrix is in (`comb_lane`, see `sublayer_begin`). With `next` (the
    /// hyper-connection of this pass's next sublayer) under `hc_gram` it also forms that
    /// sublayer's mix and Gram shares, which its `sublayer_begin` then starts from.
    fn sublayer_end(
        &self,
        comb_lane: bool,
        h: u64,
        out: u64,
        (parts, k): (u64, usize),
        h_out: u64,
        next: Option<&HcDev>,
    ) -> Result<(), CudaError> {
        let (g, c, s) = (&self.g, self.c, self.s);
        if comb_lane {
            g.join(3)?;
        }
        let hcp = g.ptr(&s.hcp);
        let n = self.n;
        let gram = next.filter(|hc| self.gram_fits(hc));
        s.gram_for
            .set(gram.map(|hc| (hc.fn_.part_ptr(g, 0), h_out)));
        match gram {
            Some(hc) => g.hc_post_gram(
                n,
                (h, out),
                (parts, k),
                hcp,
                c.n_embd,
                h_out,
                &hc.fn_,
                g.ptr(&s.gram),
            ),
            None => g.hc_post(n, h, out, parts, k, hcp, c.n_hc, c.n_embd, h_out),
        }
    }

    /// `mid = silu(gate)·up·w` (clamped) over `rows` rows of `width` (w = 0: none), also
    /// quantised into `xq` (Q8_K rule with `k_rule`, else Q8_0) when given.
    fn swiglu(
        &self,
        (gate, up, w): (u64, u64, u64),
        width: usize,
        rows: usize,
        clamp: f32,
        mid: u64,
        xq: Option<(&mut QuantAct, bool)>,
    ) -> Result<(), CudaError> {
        let g = &self.g;
        match xq {
            Some((xq, k_rule)) => g.swiglu_quant(gate, up, w, width, rows, clamp, mid, xq, k_rule),
            None => g.swiglu(gate, up, w, width, rows, clamp, mid),
        }
    }

    /// See [`mv`]: a projection of the batch's `n` rows (`src`: x, xq, quantized).
    fn mv(&self, m: &DeviceMatrix, src: Src, y: u64) -> Result<(), CudaError> {
        let (x, xq, quantized) = src;
        mv(&self.g, m, x, xq, quantized, y, self.n, self.fast)
    }

    /// A grouped projection (`n_sel` selections fixed before the token, inputs at
    /// sel.x_stride; `xq` already holds their Q8_0 form when `quantized`).
    fn mv_sel(
        &self,
        m: &DeviceMatrix,
        (x, xq, quantized): Src,
        y: u64,
        n_sel: usize,
        sel: MatSel,
    ) -> Result<(), CudaError> {
        let g = &self.g;
        if self.fast && m.ty == GgmlType::Q8_0 {
            if !quantized {
                let rows_q = (n_sel * sel.x_stride as usize).div_ceil(xq.cols);
                g.quantize_rows(x, xq, rows_q, ActRule::Q8_0)?;
            }
            g.matvec_q8act(m, xq, y, n_sel, sel)
        } else {
            g.matvec(m, x, y, n_sel, sel)
        }
    }

    /// The batch's RMS norms of `width` values (weights `w`) into `y`; with `quantize`
    /// also into `xq` (Q8_0) in the same launch. Returns whether `xq` now holds `y`.
    fn norm(
        &self,
        x: u64,
        w: u64,
        width: usize,
        y: u64,
        xq: &mut QuantAct,
        quantize: bool,
    ) -> Result<bool, CudaError> {
        let (g, eps, f32t) = (&self.g, self.c.rms_eps, ds4_cuda::WT_F32);
        if quantize {
            g.rmsnorm_q8(x, w, f32t, width, self.n, eps, y, xq)?;
        } else {
            g.rmsnorm(x, w, f32t, width, self.n, eps, y)?;
        }
        Ok(quantize)
    }

    /// Advances a compressor by the batch (one token: the graph-captured decode step)
    /// on the normed input `x`: its kv and gate projections into the scratch `kvs`
    /// ([`compressor_inputs`]), then the compressor kernels; `(skv, ssc)` is its state.
    fn compress(
        &self,
        (x, kvs): (u64, u64),
        cw: &CompressorDev,
        (skv, ssc): (Option<&DeviceBuf<f32>>, Option<&DeviceBuf<f32>>),
        indexer: bool,
        rows_out: u64,
    ) -> Result<(), CudaError> {
        compressor_inputs(&self.g, cw, x, kvs, self.n)?;
        self.compress_state(kvs, cw, (skv, ssc), indexer, rows_out, self.n)
    }

    /// The compressor kernels over `n` tokens whose kv and gate projections are at `kvs`
    /// (see `compress`).
    fn compress_state(
        &self,
        kvs: u64,
        cw: &CompressorDev,
        (skv, ssc): (Option<&DeviceBuf<f32>>, Option<&DeviceBuf<f32>>),
        indexer: bool,
        rows_out: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let g = &self.g;
        let f32t = ds4_cuda::WT_F32;
        let launch = ds4_cuda::Compressor {
            step: self.step,
            kvs,
            ape: g.ptr(&cw.ape),
            ape_type: f32t,
            skv: self.state(skv.expect("compressed layer state")),
            ssc: self.state(ssc.expect("compressed layer state")),
            ratio: cw.ratio,
            lanes: cw.lanes,
            d: cw.dim,
            norm_w: g.ptr(&cw.norm),
            norm_type: f32t,
            eps: self.c.rms_eps,
            rope: self.rope,
            indexer,
            f16_round: self.fast,
            rows: if self.kvt != 0 { 0 } else { rows_out },
            kvt: self.kvt_at(if indexer { kvt::ISKV } else { kvt::SKV }),
        };
        g.compressor(n, &launch)
    }
}

impl KvView<'_> {
    /// Embeds the `n_tok` tokens of `s.step` and runs every layer on them.
    pub(super) fn enqueue(
        &self,
        w: &CudaWeights,
        numerics: Numerics,
        b: &mut Work,
        n_tok: usize,
    ) -> Result<()> {
        let g = &w.gpu.launcher(self.plan);
        let c = &w.config;
        let s = &b.s;
        // A later stage of a split model starts from the previous GPU's streams, which
        // the caller put in `s.h` (cuda/split.rs).
        if w.range.start == 0 {
            g.embed(
                n_tok,
                g.ptr(&s.step),
                w.token_embd.buf.ptr(g),
                w.token_embd.ty,
                c.n_embd,
                c.n_hc,
                g.ptr(&s.h),
            )?;
        }
        for il in w.range.clone() {
            let layer = (il, w.layer(il), &self.layers[il], w.rope(il));
            let mut px = self.pass(w, numerics, layer, &b.s, n_tok);
            if il + 1 < w.range.end {
                px.next_attn = Some(&w.layer(il + 1).hc_attn);
            }
            self.layer(&px, &mut b.q8, b.plan.as_mut())?;
        }
        Ok(())
    }

    /// One layer (attention and FFN) of the pass `px` (over a batch's scratch, with its
    /// quantised activations `qb` and expert plan).
    pub(super) fn layer(
        &self,
        px: &Pass,
        qb: &mut QuantBufs,
        plan: Option<&mut RoutePlan>,
    ) -> Result<()> {
        self.attention(px, qb)?;
        self.ffn(px, qb, plan)
    }

    /// Advances every compressor by the first `n` tokens of a multi-row step from the
    /// inputs its journal kept (after the frontiers were restored): the frontiers and
    /// compressed rows are then those of a step that ran only those tokens.
    pub(super) fn replay_compressors(
        &self,
        w: &CudaWeights,
        numerics: Numerics,
        s: &Scratch,
        n: usize,
    ) -> Result<()> {
        for il in w.range.clone() {
            let (l, st) = (w.layer(il), &self.layers[il]);
            let px = self.pass(w, numerics, (il, l, st, w.rope(il)), s, n);
            let p = |b: &DeviceBuf<f32>| px.g.ptr(b);
            if let (Some(cw), Some(comp)) = (&l.compressor, &st.comp) {
                let state = (st.skv.as_ref(), st.ssc.as_ref());
                px.compress_state(px.kvs.0, cw, state, false, p(comp), n)?;
            }
            if let (Some(ix), Some(index)) = (&l.indexer, &st.index) {
                let state = (st.iskv.as_ref(), st.issc.as_ref());
                px.compress_state(px.kvs.1, &ix.compressor, state, true, p(index), n)?;
            }
        }
        Ok(())
    }

    /// The [`Pass`] of a layer `(il, weights, state, rope)` over the `n` tokens of `s`.
    pub(super) fn pass<'a>(
        &self,
        w: &'a CudaWeights,
        numerics: Numerics,
        (il, l, st, rope): (usize, &'a LayerDev, &'a LayerState, ds4_cuda::RopeP),
        s: &'a Scratch,
        n: usize,
    ) -> Pass<'a> {
        // A prefill chunk's products may run on fp16 tensor cores through its buffers.
        let g = w.gpu.launcher(self.plan).with_f16(s.f16.as_ref());
        let step = g.ptr(&s.step);
        let (c, fast) = (&w.config, numerics == Numerics::Fast);
        let kvs = match self.journal {
            Some(j) if il < j.len() => j[il],
            _ => (g.ptr(&s.ckv), g.ptr(&s.icv)),
        };
        let kvt = match self.kvt {
            0 => 0,
            base => base + (il * MAX_ROWS * kvt::STRIDE * 8) as u64,
        };
        let emits = match self.emit_pos {
            Some(pos) if l.ratio > 0 => (pos + 1).is_multiple_of(l.ratio),
            _ => true,
        };
        Pass {
            g,
            c,
            s,
            il,
            l,
            st,
            kvs,
            n,
            step,
            rope,
            fast,
            kvt,
            emits,
            next_attn: None,
        }
    }

    fn attention(&self, px: &Pass, qb: &mut QuantBufs) -> Result<()> {
        let (g, c, s, n) = (&px.g, px.c, px.s, px.n);
        let (step, rope, fast) = (px.step, px.rope, px.fast);
        let (l, st) = (px.l, px.st);
        let p = |b: &DeviceBuf<f32>| g.ptr(b);
        let f32t = ds4_cuda::WT_F32;
        let hd = c.head_dim;

        let (n_q8, comb_lane) =
            px.sublayer_begin(&l.hc_attn, p(&s.h), p(&l.attn_norm), &mut qb.embd, &l.q_a)?;
        // `comp_defer`: a decode token that ends no window of this layer's compressors
        // needs none of their results in its attention (the rows it reads were emitted
        // before), so their chains run on lane 4 beside the attention, joined at the
        // sublayer's end (the FFN's norm overwrites their input `n`).
        let defer = n == 1 && !px.emits && g.on(Variant::CompDefer);
        let main_compress = || -> Result<(), CudaError> {
            if let (Some(cw), Some(comp)) = (&l.compressor, &st.comp) {
                px.compress(
                    (p(&s.n), px.kvs.0),
                    cw,
                    (st.skv.as_ref(), st.ssc.as_ref()),
                    false,
                    p(comp),
                )?;
            }
            Ok(())
        };
        // Three branches from the normed input, joined before attention: side lane 1
        // forms hc_post's comb matrix and writes this token's raw row and compressed
        // rows, side lane 2 the indexer's compressed rows and then (once the main lane
        // has q_r) the top-k selection, and the main lane builds the queries. Each is a
        // chain of small kernels that cannot fill the GPU alone. A decode token moves
        // compressor chains to lane 4: the indexer's (`idx_lane`), or both when they
        // emit no row at this position (`comp_defer`).
        g.branch(1, || {
            if !comb_lane {
                px.hc_comb(&l.hc_attn)?;
            }
            // The same quantised `n` as attn_q_a (quantised by the norm when Q8_0).
            px.mv(
                &l.kv,
                (p(&s.n), &mut qb.embd, l.q_a.ty == GgmlType::Q8_0),
                p(&s.kv),
            )?;
            g.kv_finish(
                n,
                step,
                p(&s.kv),
                p(&l.kv_norm),
                f32t,
                hd,
                c.rms_eps,
                rope,
                fast,
                px.state(&st.ring),
                self.raw_cap,
                px.kvt,
            )?;
            if !defer {
                main_compress()?;
            }
            Ok(())
        })?;
        let indexer = match (&l.compressor, &l.indexer, &st.index) {
            (Some(cw), Some(ix), Some(index)) => Some((cw, ix, index)),
            _ => None,
        };
        // Under `idx_lane` a decode token's indexer compressor runs on lane 4, and lane
        // 2 waits for it only before the scores (which read its rows): the indexer's
        // query no longer queues behind the compressor's chain on lane 2.
        let idx_lane = n == 1 && g.on(Variant::IdxLane) && !defer;
        let idx_compress = || -> Result<(), CudaError> {
            if let Some((_, ix, index)) = indexer {
                px.compress(
                    (p(&s.n), px.kvs.1),
                    &ix.compressor,
                    (st.iskv.as_ref(), st.issc.as_ref()),
                    true,
                    p(index),
                )?;
            }
            Ok(())
        };
        if defer {
            g.branch(4, || {
                idx_compress()?;
                main_compress()
            })?;
        }
        if let Some((_, ix, _)) = indexer {
            if idx_lane {
                g.branch(4, idx_compress)?;
            }
            g.branch(2, || {
                if !idx_lane && !defer {
                    idx_compress()?;
                }
                dense_f32(g, &ix.proj, p(&s.n), p(&s.wt), plain(&ix.proj, n))
            })?;
        }
        // attn_q_a reads `n` as quantised by the norm: the kv branch only quantises
        // its own copy when q_a is not Q8_0 (then q_a does not read it).
        let q_a_xq_ready = n_q8;
        px.mv(&l.q_a, (p(&s.n), &mut qb.embd, q_a_xq_ready), p(&s.qa))?;
        let qr_q8 = px.norm(
            p(&s.qa),
            p(&l.q_a_norm),
            c.q_lora_rank,
            p(&s.qr),
            &mut qb.qr,
            fast && l.q_b.ty == GgmlType::Q8_0,
        )?;
        let mut sel = 0u64;
        if let Some((cw, ix, index)) = indexer {
            g.branch(2, || {
                // The indexer runs every token so one captured graph serves every
                // position: below top_k rows the kernels themselves select every row.
                let max_rows = comp_cap(self.ctx, cw.ratio);
                dense_f32(g, &ix.q_b, p(&s.qr), p(&s.qi), plain(&ix.q_b, n))?;
                let wscale =
                    ((c.idx_head_dim as f64).powf(-0.5) * (c.idx_heads as f64).powf(-0.5)) as f32;
                debug_assert!(max_rows <= s.iscores_stride);
                // A decode token: query, scores and top-k in one launch where it fits
                // (`idx_step`); a multi-row step of up to IDX_STEP_ROWS tokens too
                // (`idx_step_rows`), longer ones keep the chain (their batched scores
                // run on tensor cores). So does a batched step over sessions: the
                // kernel takes a KV table, but its 8-session timing is not measured yet.
                let rows_ok = n == 1 || (n <= IDX_STEP_ROWS && g.on(Variant::IdxStepRows));
                let fused = rows_ok
                    && px.kvt == 0
                    && g.indexer_step_fits(
                        c.idx_heads,
                        c.idx_head_dim,
                        rope.rope_dim as usize,
                        max_rows,
                    );
                if fused {
                    if idx_lane {
                        g.lane_wait(2, 4)?;
                    }
                    return g.indexer_step(
                        n,
                        step,
                        px.state(index),
                        p(&s.qi),
                        p(&s.wt),
                        rope,
                        wscale,
                        cw.ratio,
                        c.idx_topk,
                        p(&s.iscores),
                        (s.iscores_stride, max_rows),
                        g.ptr(&s.sel),
                        g.ptr(&s.idx_done),
                        px.kvt,
                    );
                }
                g.indexer_q(n, step, p(&s.qi), c.idx_heads, c.idx_head_dim, rope)?;
                if idx_lane {
                    g.lane_wait(2, 4)?;
                }
                g.indexer_scores(
                    n,
                    step,
                    px.state(index),
                    p(&s.qi),
                    p(&s.wt),
                    c.idx_heads,
                    c.idx_head_dim,
                    wscale,
                    cw.ratio,
                    c.idx_topk,
                    p(&s.iscores),
                    s.iscores_stride,
                    px.kvt,
                )?;
                g.topk_select(
                    n,
                    step,
                    p(&s.iscores),
                    s.iscores_stride,
                    cw.ratio,
                    c.idx_topk,
                    g.ptr(&s.sel),
                )
            })?;
            sel = g.ptr(&s.sel);
        }
        // Background work under `prio`: the indexer and compressor chains beside it
        // are latency-bound and the attention waits for them too.
        g.background(|| px.mv(&l.q_b, (p(&s.qr), &mut qb.qr, qr_q8), p(&s.q)))?;
        // A decode token's attention norms and rotates its own queries.
        let q_norm = (n == 1 && g.on(Variant::QNorm)).then_some(ds4_cuda::QNorm {
            eps: c.rms_eps,
            rope,
        });
        if q_norm.is_none() {
            g.head_norm_rope(n, step, p(&s.q), hd, c.n_head, c.rms_eps, rope)?;
        }
        g.join(1)?;
        if indexer.is_some() {
            g.join(2)?;
            if idx_lane {
                // Already waited for through lane 2; joined for the capture's rule.
                g.join(4)?;
            }
        }
        let scale = (hd as f64).powf(-0.5) as f32;
        let att = ds4_cuda::AttnInput {
            n_tok: n,
            step,
            q: p(&s.q),
            ring: px.state(&st.ring),
            raw_cap: self.raw_cap,
            window: self.window,
            comp: st.comp.as_ref().map_or(0, |b| px.state(b)),
            ratio: l.ratio,
            sel,
            top_k: c.idx_topk,
            sinks: p(&l.sinks),
            heads: c.n_head,
            hd,
            scale,
            q_norm,
            kvt: px.kvt,
            window_at: self.window_at,
        };
        // The output projection's input: the heads after the inverse RoPE of their tails
        // and, when out_a is Q8_0 in the fast numerics, their Q8_0 form (written by the
        // attention's last launch).
        let heads_q8 = fast && l.out_a.ty == GgmlType::Q8_0;
        let tail = ds4_cuda::AttnTail {
            rope,
            q: if heads_q8 { g.ptr(&qb.heads.q) } else { 0 },
            d: if heads_q8 { g.ptr(&qb.heads.d) } else { 0 },
        };
        if n > qb.heads.rows {
            return Err(CudaError::Invalid(format!(
                "{n} tokens of heads into activations of {}",
                qb.heads.rows
            ))
            .into());
        }
        let mma_shape = fast && gemm(Gemm::Attn) && Gpu::attention_mma_shape(c.n_head, hd);
        // The split kernels' chunks (the partial buffers are sized for them).
        let n_chunks = att_splits(s.att_stride);
        if n > SMALL_BATCH && mma_shape {
            // att_half: the ring's and the compressed rows' fp16 copies, once a layer.
            let n_comp = self.end.checked_div(l.ratio).unwrap_or(0);
            match (&s.ring16, &s.comp16) {
                (Some(r16), Some(c16))
                    if g.on(Variant::AttHalf)
                        && self.raw_cap * hd <= r16.len()
                        && n_comp * hd <= c16.len() =>
                {
                    g.rows_f16(att.ring, g.ptr(r16), self.raw_cap * hd)?;
                    if att.comp != 0 {
                        g.rows_f16(att.comp, g.ptr(c16), n_comp * hd)?;
                    }
                    g.attention_prefill_mma_h(&att, g.ptr(r16), g.ptr(c16), p(&s.heads))?;
                }
                _ => g.attention_prefill_mma(&att, p(&s.heads))?,
            }
            g.attention_tail(&att, &tail, p(&s.heads))?;
        } else if n > 1
            && mma_shape
            && n_chunks >= 2
            && q_norm.is_none()
            && g.on(Variant::AttMmaSplit)
        {
            // A multi-row step: each token's rows split over chunks on tensor cores (the
            // FMA kernel reads every row once per 8 heads; its cost grew with the rows),
            // fewer chunks than decode's: the tokens fill the GPU, and every chunk's
            // partials grow with them. (Fast numerics only: the FMA path below keeps
            // decode's chunks, so an Exact step's sums stay decode's.)
            g.attention_split_mma(
                &att,
                n_chunks.min(ATT_SPLITS_ROWS),
                p(&s.att_acc),
                p(&s.att_ml),
                p(&s.heads),
                Some(&tail),
            )?;
        } else {
            // Decode and multi-row steps split each token's rows into chunks (a few
            // tokens cannot fill the GPU); a prefill batch's tokens do.
            let (rows_per_chunk, n_chunks) = if n <= SMALL_BATCH {
                (0, n_chunks)
            } else {
                (s.att_stride, 1)
            };
            g.attention(
                &att,
                rows_per_chunk,
                n_chunks,
                p(&s.att_acc),
                p(&s.att_ml),
                p(&s.heads),
                Some(&tail),
            )?;
        }
        let groups = MatSel {
            ids: g.ptr(&s.group_ids),
            x_stride: (c.q_dim() / c.o_groups) as i64,
            y_stride: c.o_lora_rank as i64,
        };
        let og = c.o_groups;
        // (n_head, hence q_dim, is a multiple of o_groups: Config::validate.)
        let grouped = Batch::grouped(n, og, c.q_dim() / og, c.o_lora_rank);
        if n > SMALL_BATCH && gemm(Gemm::Group) && heads_q8 {
            g.matmul_q8act(&l.out_a, &qb.heads, p(&s.low), grouped)?;
        } else if n > 1 && heads_q8 && g.on(Variant::Tokens) {
            // A multi-row step: every token's groups in one pass over the weights (the
            // attention tail wrote the heads' Q8_0 form).
            g.matvec_q8act_groups(&l.out_a, &qb.heads, p(&s.low), grouped)?;
        } else if n > SMALL_BATCH && gemm(Gemm::Group) && !fast && f32_gemm_format(l.out_a.ty) {
            g.matmul_f32(&l.out_a, p(&s.heads), p(&s.low), grouped)?;
        } else {
            // group_ids is uploaded once, never written by the graph.
            g.constant_ids(|| {
                px.mv_sel(
                    &l.out_a,
                    (p(&s.heads), &mut qb.heads, heads_q8),
                    p(&s.low),
                    n * og,
                    groups,
                )
            })?;
        }
        px.mv(&l.out_b, (p(&s.low), &mut qb.low, false), p(&s.o))?;
        if let Some((dir, scale)) = self
            .steer
            .and_then(|st| st.at(g, px.il, Component::AttnOut))
        {
            g.steer_rows(n, p(&s.o), (0, 0), dir, scale, c.n_embd)?;
        }
        px.sublayer_end(
            comb_lane,
            p(&s.h),
            p(&s.o),
            (0, 0),
            p(&s.h2),
            Some(&l.hc_ffn),
        )?;
        if defer {
            g.join(4)?;
        }
        Ok(())
    }

    fn ffn(&self, px: &Pass, qb: &mut QuantBufs, route_plan: Option<&mut RoutePlan>) -> Result<()> {
        let (g, c, s, il, n) = (&px.g, px.c, px.s, px.il, px.n);
        let (step, fast) = (px.step, px.fast);
        let l = px.l;
        let (k, ff, e) = (c.n_expert_used, c.n_ff_exp, c.n_embd);
        let p = |b: &DeviceBuf<f32>| g.ptr(b);
        let (n_q8, comb_lane) = px.sublayer_begin(
            &l.hc_ffn,
            p(&s.h2),
            p(&l.ffn_norm),
            &mut qb.embd,
            &l.gate_sh,
        )?;
        // The shared expert needs only the normed input: it runs on side lane 1 (after
        // hc_post's comb matrix) while the router and the routed experts run on the
        // main lane.
        // Background work under `prio`: the routed chain gets the SMs first. With
        // `shexp_late` a decode token forks it only after the router's matvec, which
        // otherwise shares the memory bandwidth with the shared expert's 27 MB.
        let shared_expert = || {
            g.background(|| {
                if !comb_lane {
                    px.hc_comb(&l.hc_ffn)?;
                }
                let ffs = c.n_ff_exp * c.n_expert_shared;
                // n_q8: Q8_0 gate and up in the fast numerics, their input quantised by the norm.
                // A step of 3 or more rows: one launch of both (`tokens_pair`). At 2 rows
                // the pair measured ~1.5% slower than two launches (session 39), and from
                // 8 rows the two run on tensor cores.
                let pair_rows =
                    n == 1 || ((3..=SMALL_BATCH).contains(&n) && g.on(Variant::TokensPair));
                if pair_rows && n_q8 && g.on(Variant::SharedPair) {
                    let (gate, up) = ((&l.gate_sh, p(&s.sg)), (&l.up_sh, p(&s.su)));
                    g.matvec_q8act_pair(gate, up, &qb.embd, n, rows(&l.gate_sh))?;
                } else {
                    // up's input is quantised once gate's (Q8_0) is.
                    let gate_q8 = l.gate_sh.ty == GgmlType::Q8_0;
                    px.mv(&l.gate_sh, (p(&s.n), &mut qb.embd, n_q8), p(&s.sg))?;
                    px.mv(&l.up_sh, (p(&s.n), &mut qb.embd, gate_q8), p(&s.su))?;
                }
                let mid_q8 = fast && l.down_sh.ty == GgmlType::Q8_0;
                let (gate_up, clamp) = ((p(&s.sg), p(&s.su), 0), c.swiglu_clamp_shexp[il]);
                let xq = mid_q8.then_some((&mut qb.shared_mid, false));
                px.swiglu(gate_up, ffs, n, clamp, p(&s.smid), xq)?;
                px.mv(
                    &l.down_sh,
                    (p(&s.smid), &mut qb.shared_mid, mid_q8),
                    p(&s.sh),
                )
            })
        };
        let mut shared_expert = Some(shared_expert);
        let mut fork_shared = || match shared_expert.take() {
            Some(f) => g.branch(1, f),
            None => Ok(()),
        };
        let int8 = |m: &DeviceMatrix| {
            fast && matches!(m.ty, GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K)
        };
        let expert_gemm = n > SMALL_BATCH
            && route_plan.is_some()
            && int8(&l.gate_exps)
            && int8(&l.up_exps)
            && int8(&l.down_exps);
        // A decode token, or a multi-row or batched step (up to SMALL_BATCH rows): the
        // shared expert is forked after the router's matvec; a prefill chunk forks it first.
        let late = n <= SMALL_BATCH && g.on(Variant::ShexpLate);
        if !late {
            fork_shared()?;
        }
        let int8_in = int8(&l.gate_exps) && int8(&l.up_exps);
        // The int8 expert input of a decode token, or of a multi-row or batched step (a
        // row per (token, expert) pair: each token's row quantised once and written to
        // its k pair rows), is quantised on side lane 2 while gate_inp and the router run
        // on the main lane: it does not depend on the routing. (A step quantised it after
        // the router, on the routed chain: H200, R = 2, ~2.5 µs an FFN.)
        let early_q8k = int8_in && !expert_gemm;
        if early_q8k {
            g.branch(2, || {
                if n == 1 {
                    g.quantize_rows(p(&s.n), &mut qb.exp_in, 1, ActRule::Q8K)
                } else {
                    g.quantize_rows_rep(p(&s.n), &mut qb.exp_in, n, k)
                }
            })?;
        }
        dense_f32(g, &l.gate_inp, p(&s.n), p(&s.rlog), plain(&l.gate_inp, n))?;
        fork_shared()?;
        g.router(
            n,
            step,
            p(&s.rlog),
            c.n_expert,
            k,
            l.exp_probs_b.as_ref().map_or(0, p),
            l.tid2eid.as_ref().map_or(0, |t| g.ptr(t)),
            c.expert_weights_scale,
            g.ptr(&s.ids),
            p(&s.rw),
        )?;
        let ids = g.ptr(&s.ids);
        // The matvecs' input: one shared row for a single token, otherwise one row per
        // (token, expert) pair — for int8 experts quantised once a token and written to
        // its k pair rows (quantize_rows_rep, above), else its f32 row copied k times.
        let (x_in, in_stride) = if n == 1 || expert_gemm {
            (p(&s.n), 0)
        } else if int8_in {
            (p(&s.n), e as i64)
        } else {
            g.repeat_rows(p(&s.n), n, e, k, p(s.rep()))?;
            (p(s.rep()), e as i64)
        };
        let gate_up = MatSel {
            ids,
            x_stride: in_stride,
            y_stride: ff as i64,
        };
        let per_mid = MatSel {
            ids,
            x_stride: ff as i64,
            y_stride: e as i64,
        };
        let pairs = n * k;
        // Batches with int8 experts: grouped expert GEMMs over per-expert pair lists
        // (gate/up read each token's Q8_K row once for its k pairs); otherwise matvecs
        // over the (token, expert) pairs.
        let plan = match route_plan.filter(|_| expert_gemm) {
            Some(plan) => {
                g.route_plan(ids, pairs, c.n_expert, plan)?;
                g.quantize_rows(p(&s.n), &mut qb.exp_in, n, ActRule::Q8K)?;
                let (gate, up) = ((&l.gate_exps, p(&s.g)), (&l.up_exps, p(&s.u)));
                g.matmul_experts_gate_up(gate, up, &qb.exp_in, plan, k)?;
                Some(&*plan)
            }
            None if int8_in => {
                // Quantised on lane 2 (early_q8k: int8_in and no expert GEMM).
                g.join(2)?;
                let (gate, up) = ((&l.gate_exps, p(&s.g)), (&l.up_exps, p(&s.u)));
                g.matvec_q8act_pair(gate, up, &qb.exp_in, pairs, gate_up)?;
                None
            }
            None => {
                g.matvec(&l.gate_exps, x_in, p(&s.g), pairs, gate_up)?;
                g.matvec(&l.up_exps, x_in, p(&s.u), pairs, gate_up)?;
                None
            }
        };
        let (gate_up_w, mid) = ((p(&s.g), p(&s.u), p(&s.rw)), p(&s.mid));
        let (clamp, down_q8) = (c.swiglu_clamp[il], int8(&l.down_exps));
        let xq = down_q8.then_some((&mut qb.exp_mid, true));
        px.swiglu(gate_up_w, ff, pairs, clamp, mid, xq)?;
        // Imatrix collection (`cuda/imatrix.rs`): a no-op unless an observed prefill runs.
        let routed_in = (&s.n, &s.ids, &s.mid);
        crate::cuda::imatrix::observe(g, il, n, routed_in, (e, k, ff))?;
        if down_q8 {
            match plan {
                Some(plan) => g.matmul_experts_q8act(
                    &l.down_exps,
                    &qb.exp_mid,
                    plan,
                    k,
                    false,
                    p(s.dn()),
                    None,
                )?,
                None => g.matvec_q8act(&l.down_exps, &qb.exp_mid, p(s.dn()), pairs, per_mid)?,
            }
        } else {
            g.matvec(&l.down_exps, mid, p(s.dn()), pairs, per_mid)?;
        }
        g.join(1)?;
        // The routed experts' rows summed plus the shared expert, inside hc_post.
        let mut parts = (p(s.dn()), k);
        if let Some((dir, scale)) = self.steer.and_then(|st| st.at(g, il, Component::FfnOut)) {
            // Steering edits the whole FFN output: steer_rows forms that sum in s.sh
            // (hc_post's order), steers it, and hc_post adds no parts.
            g.steer_rows(n, p(&s.sh), parts, dir, scale, e)?;
            parts = (0, 0);
        }
        px.sublayer_end(comb_lane, p(&s.h2), p(&s.sh), parts, p(&s.h), px.next_attn)?;
        Ok(())
    }
}
