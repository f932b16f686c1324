//! Per-session device state (KV rows, compressor frontiers, scratch) and the decode
//! of one token.

use ds4_cuda::{CudaError, DeviceBuf, Gpu, MatSel, QuantAct, TokenGraph};
use ds4_gguf::GgmlType;

use super::weights::{CudaWeights, LayerDev};
use crate::config::Config;
use crate::error::Result;
use crate::kv::{Frontier, KvCache};
use crate::ops::linear::Numerics;

/// KV state of one layer on the device. Row counts derive from the position: the raw
/// ring holds position p at slot p % raw_cap; compressed row i summarises tokens
/// [i·r, (i+1)·r).
struct LayerState {
    ring: DeviceBuf<f32>,
    comp: Option<DeviceBuf<f32>>,
    skv: Option<DeviceBuf<f32>>,
    ssc: Option<DeviceBuf<f32>>,
    index: Option<DeviceBuf<f32>>,
    iskv: Option<DeviceBuf<f32>>,
    issc: Option<DeviceBuf<f32>>,
}

/// Quantised activations of the fast numerics (ds4's: Q8_0 per 32 values before Q8_0
/// weights, Q8_K per 256 before routed experts).
struct QuantBufs {
    /// Inputs of width n_embd (attn/ffn norm outputs, the head input).
    embd: QuantAct,
    qr: QuantAct,
    heads: QuantAct,
    low: QuantAct,
    shared_mid: QuantAct,
    /// Q8_K: the routed experts' input and their weighted `mid` rows.
    exp_in: QuantAct,
    exp_mid: QuantAct,
}

/// Scratch activations (one token).
struct Scratch {
    step: DeviceBuf<i32>,
    h: DeviceBuf<f32>,
    h2: DeviceBuf<f32>,
    mix: DeviceBuf<f32>,
    hcp: DeviceBuf<f32>,
    y: DeviceBuf<f32>,
    n: DeviceBuf<f32>,
    qa: DeviceBuf<f32>,
    qr: DeviceBuf<f32>,
    q: DeviceBuf<f32>,
    kv: DeviceBuf<f32>,
    heads: DeviceBuf<f32>,
    low: DeviceBuf<f32>,
    o: DeviceBuf<f32>,
    ckv: DeviceBuf<f32>,
    icv: DeviceBuf<f32>,
    qi: DeviceBuf<f32>,
    wt: DeviceBuf<f32>,
    iscores: DeviceBuf<f32>,
    allowed: DeviceBuf<u8>,
    att: DeviceBuf<f32>,
    att_stride: usize,
    rlog: DeviceBuf<f32>,
    ids: DeviceBuf<i32>,
    rw: DeviceBuf<f32>,
    g: DeviceBuf<f32>,
    u: DeviceBuf<f32>,
    mid: DeviceBuf<f32>,
    dn: DeviceBuf<f32>,
    sg: DeviceBuf<f32>,
    su: DeviceBuf<f32>,
    smid: DeviceBuf<f32>,
    sh: DeviceBuf<f32>,
    hx: DeviceBuf<f32>,
    tmp: DeviceBuf<f32>,
    logits: DeviceBuf<f32>,
}

pub(super) struct DeviceState {
    pub ctx: usize,
    pub n_tokens: usize,
    raw_cap: usize,
    layers: Vec<LayerState>,
    s: Scratch,
    q: QuantBufs,
    /// One captured token (without / with the output head), replayed per token; all
    /// position-dependent counts are read from the device step buffer.
    graphs: [Option<TokenGraph>; 2],
    graph_numerics: Option<Numerics>,
    use_graphs: bool,
}

fn comp_cap(ctx: usize, ratio: usize) -> usize {
    ctx / ratio + 2
}

impl DeviceState {
    pub fn new(w: &CudaWeights, ctx: usize) -> Result<DeviceState> {
        let g = &w.gpu;
        let c = &w.config;
        let raw_cap = c.window.min(ctx).max(1);
        let hd = c.head_dim;
        let mut layers = Vec::with_capacity(c.n_layer);
        let mut max_comp = 0;
        for (il, l) in w.layers.iter().enumerate() {
            let r = l.ratio;
            let lanes = Config::compressor_lanes(r);
            let zeros = |n: usize| g.zeros::<f32>(n);
            let neg = |n: usize| g.upload(&vec![crate::kv::NEG_INF; n]);
            let (comp, skv, ssc) = if r != 0 {
                max_comp = max_comp.max(comp_cap(ctx, r));
                let f = lanes * r * lanes * hd;
                (
                    Some(zeros(comp_cap(ctx, r) * hd)?),
                    Some(zeros(f)?),
                    Some(neg(f)?),
                )
            } else {
                (None, None, None)
            };
            let (index, iskv, issc) = if c.has_indexer(il) {
                let d = c.idx_head_dim;
                let f = lanes * r * lanes * d;
                (
                    Some(zeros(comp_cap(ctx, r) * d)?),
                    Some(zeros(f)?),
                    Some(neg(f)?),
                )
            } else {
                (None, None, None)
            };
            layers.push(LayerState {
                ring: zeros(raw_cap * hd)?,
                comp,
                skv,
                ssc,
                index,
                iskv,
                issc,
            });
        }
        let k = c.n_expert_used;
        let ff = c.n_ff_exp;
        let ffs = c.n_ff_exp * c.n_expert_shared;
        let e = c.n_embd;
        let att_stride = raw_cap + max_comp;
        let icap = comp_cap(ctx, 4);
        let z = |n: usize| g.zeros::<f32>(n.max(1));
        let s = Scratch {
            step: g.zeros::<i32>(2)?,
            h: z(c.n_hc * e)?,
            h2: z(c.n_hc * e)?,
            mix: z(c.hc_mix())?,
            hcp: z(c.n_hc + c.n_hc * c.n_hc)?,
            y: z(e)?,
            n: z(e)?,
            qa: z(c.q_lora_rank)?,
            qr: z(c.q_lora_rank)?,
            q: z(c.q_dim())?,
            kv: z(hd)?,
            heads: z(c.q_dim())?,
            low: z(c.o_groups * c.o_lora_rank)?,
            o: z(e)?,
            ckv: z(4 * hd)?,
            icv: z(4 * c.idx_head_dim)?,
            qi: z(c.idx_heads * c.idx_head_dim)?,
            wt: z(c.idx_heads)?,
            iscores: z(icap)?,
            allowed: g.zeros::<u8>(icap)?,
            att: z(c.n_head * att_stride)?,
            att_stride,
            rlog: z(c.n_expert)?,
            ids: g.zeros::<i32>(k)?,
            rw: z(k)?,
            g: z(k * ff)?,
            u: z(k * ff)?,
            mid: z(k * ff)?,
            dn: z(k * e)?,
            sg: z(ffs)?,
            su: z(ffs)?,
            smid: z(ffs)?,
            sh: z(e)?,
            hx: z(e)?,
            tmp: z(e)?,
            logits: z(c.vocab)?,
        };
        let q = QuantBufs {
            embd: g.alloc_quant_act(1, e)?,
            qr: g.alloc_quant_act(1, c.q_lora_rank)?,
            heads: g.alloc_quant_act(1, c.q_dim())?,
            low: g.alloc_quant_act(1, c.o_groups * c.o_lora_rank)?,
            shared_mid: g.alloc_quant_act(1, ffs)?,
            exp_in: g.alloc_quant_act(1, e)?,
            exp_mid: g.alloc_quant_act(k, ff)?,
        };
        Ok(DeviceState {
            ctx,
            n_tokens: 0,
            raw_cap,
            layers,
            s,
            q,
            graphs: [None, None],
            graph_numerics: None,
            use_graphs: !g.profiling()
                && std::env::var("DS4_CUDA_GRAPHS").map_or(true, |v| v != "0"),
        })
    }

    /// Runs one token at position `n_tokens`; with `head` the logits are computed.
    pub fn decode(
        &mut self,
        w: &CudaWeights,
        numerics: Numerics,
        token: u32,
        head: bool,
    ) -> Result<()> {
        let g = &*w.gpu;
        let pos = self.n_tokens as i32;
        g.write(&mut self.s.step, &[pos, token as i32])?;
        if self.use_graphs {
            if self.graph_numerics != Some(numerics) {
                self.graphs = [None, None];
                self.graph_numerics = Some(numerics);
            }
            let key = usize::from(head);
            if self.graphs[key].is_none() {
                g.begin_capture()?;
                let enqueued = self.enqueue_token(w, numerics, head);
                let graph = g.end_capture();
                enqueued?;
                self.graphs[key] = Some(graph?);
            }
            self.graphs[key]
                .as_ref()
                .expect("captured above")
                .launch()?;
        } else {
            self.enqueue_token(w, numerics, head)?;
        }
        self.n_tokens += 1;
        Ok(())
    }

    /// Enqueues every launch of one token (the step buffer already holds pos/token).
    fn enqueue_token(&mut self, w: &CudaWeights, numerics: Numerics, head: bool) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        let p = |b: &DeviceBuf<f32>| g.ptr(b);
        let step = g.ptr(&self.s.step);
        g.embed(
            step,
            g.ptr(&w.token_embd.buf),
            w.token_embd.ty,
            c.n_embd,
            c.n_hc,
            p(&self.s.h),
        )?;
        for il in 0..c.n_layer {
            self.attention(w, numerics, il)?;
            self.ffn(w, numerics, il)?;
        }
        if head {
            let s = &self.s;
            g.hc_mix(
                p(&s.h),
                c.n_hc * c.n_embd,
                g.ptr(&w.head_hc.fn_.buf),
                w.head_hc.fn_.ty,
                c.rms_eps,
                p(&s.mix),
                c.n_hc,
            )?;
            g.head_collapse(
                p(&s.h),
                p(&s.mix),
                p(&w.head_hc.scale),
                p(&w.head_hc.base),
                c.n_hc,
                c.n_embd,
                c.hc_eps,
                p(&w.output_norm),
                ds4_cuda::WT_F32,
                c.rms_eps,
                p(&s.tmp),
                p(&s.hx),
            )?;
            let fast = numerics == Numerics::Fast;
            mv(
                g,
                &w.output,
                p(&s.hx),
                &mut self.q.embd,
                false,
                p(&s.logits),
                1,
                MatSel::default(),
                fast,
            )?;
        }
        Ok(())
    }

    pub fn logits(&self, w: &CudaWeights) -> Result<Vec<f32>> {
        Ok(w.gpu.download(&self.s.logits)?)
    }
}

fn hc_pre(
    s: &Scratch,
    g: &Gpu,
    c: &Config,
    hc: &super::weights::HcDev,
    h: u64,
) -> Result<(), CudaError> {
    g.hc_mix(
        h,
        c.n_hc * c.n_embd,
        g.ptr(&hc.fn_.buf),
        hc.fn_.ty,
        c.rms_eps,
        g.ptr(&s.mix),
        c.hc_mix(),
    )?;
    g.hc_pre(
        h,
        g.ptr(&s.mix),
        g.ptr(&hc.scale),
        g.ptr(&hc.base),
        c.n_hc,
        c.n_embd,
        c.sinkhorn_iters,
        c.hc_eps,
        g.ptr(&s.y),
        g.ptr(&s.hcp),
    )
}

impl DeviceState {
    fn attention(&mut self, w: &CudaWeights, numerics: Numerics, il: usize) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        let l: &LayerDev = &w.layers[il];
        let st = &self.layers[il];
        let s = &self.s;
        let qb = &mut self.q;
        let p = |b: &DeviceBuf<f32>| g.ptr(b);
        let step = g.ptr(&s.step);
        let rope = w.rope(il);
        let fast = numerics == Numerics::Fast;
        let f32t = ds4_cuda::WT_F32;
        let hd = c.head_dim;
        let plain = MatSel::default();

        hc_pre(s, g, c, &l.hc_attn, p(&s.h))?;
        g.rmsnorm(
            p(&s.y),
            p(&l.attn_norm),
            f32t,
            c.n_embd,
            1,
            c.rms_eps,
            p(&s.n),
        )?;
        mv(
            g,
            &l.q_a,
            p(&s.n),
            &mut qb.embd,
            false,
            p(&s.qa),
            1,
            plain,
            fast,
        )?;
        g.rmsnorm(
            p(&s.qa),
            p(&l.q_a_norm),
            f32t,
            c.q_lora_rank,
            1,
            c.rms_eps,
            p(&s.qr),
        )?;
        mv(
            g,
            &l.q_b,
            p(&s.qr),
            &mut qb.qr,
            false,
            p(&s.q),
            1,
            plain,
            fast,
        )?;
        g.rmsnorm(p(&s.q), 0, f32t, hd, c.n_head, c.rms_eps, p(&s.q))?;
        g.rope_tail(step, p(&s.q), hd, c.n_head, 0, rope, false)?;
        // The same quantised `n` as attn_q_a.
        mv(
            g,
            &l.kv,
            p(&s.n),
            &mut qb.embd,
            l.q_a.ty == GgmlType::Q8_0,
            p(&s.kv),
            1,
            plain,
            fast,
        )?;
        g.kv_finish(
            step,
            p(&s.kv),
            p(&l.kv_norm),
            f32t,
            hd,
            c.rms_eps,
            rope,
            fast,
            p(&st.ring),
            self.raw_cap,
        )?;

        let mut use_mask = false;
        if let (Some(cw), Some(comp)) = (&l.compressor, &st.comp) {
            let width = cw.lanes * cw.dim;
            let ckv = p(&s.ckv);
            g.matvec(&cw.kv, p(&s.n), ckv, 1, plain)?;
            g.matvec(&cw.gate, p(&s.n), ckv + 4 * width as u64, 1, plain)?;
            g.compressor_step(
                step,
                ckv,
                p(&cw.ape),
                f32t,
                p(st.skv.as_ref().expect("compressed layer state")),
                p(st.ssc.as_ref().expect("compressed layer state")),
                cw.ratio,
                cw.lanes,
                cw.dim,
                p(&cw.norm),
                f32t,
                c.rms_eps,
                rope,
                false,
                fast,
                p(comp),
            )?;
            if let (Some(ix), Some(index)) = (&l.indexer, &st.index) {
                let icw = &ix.compressor;
                let iw = icw.lanes * icw.dim;
                let icv = p(&s.icv);
                g.matvec(&icw.kv, p(&s.n), icv, 1, plain)?;
                g.matvec(&icw.gate, p(&s.n), icv + 4 * iw as u64, 1, plain)?;
                g.compressor_step(
                    step,
                    icv,
                    p(&icw.ape),
                    f32t,
                    p(st.iskv.as_ref().expect("indexer state")),
                    p(st.issc.as_ref().expect("indexer state")),
                    icw.ratio,
                    icw.lanes,
                    icw.dim,
                    p(&icw.norm),
                    f32t,
                    c.rms_eps,
                    rope,
                    true,
                    fast,
                    p(index),
                )?;
                // The indexer runs every token so one captured graph serves every
                // position: below top_k rows the kernels themselves allow every row.
                let max_rows = comp_cap(self.ctx, cw.ratio);
                g.matvec(&ix.q_b, p(&s.qr), p(&s.qi), 1, plain)?;
                g.indexer_q(step, p(&s.qi), c.idx_heads, c.idx_head_dim, rope)?;
                g.matvec(&ix.proj, p(&s.n), p(&s.wt), 1, plain)?;
                let wscale =
                    ((c.idx_head_dim as f64).powf(-0.5) * (c.idx_heads as f64).powf(-0.5)) as f32;
                g.indexer_scores(
                    step,
                    p(index),
                    p(&s.qi),
                    p(&s.wt),
                    c.idx_heads,
                    c.idx_head_dim,
                    wscale,
                    cw.ratio,
                    c.idx_topk,
                    p(&s.iscores),
                    max_rows,
                )?;
                g.topk_mask(step, p(&s.iscores), cw.ratio, c.idx_topk, g.ptr(&s.allowed))?;
                use_mask = true;
            }
        }
        let scale = (hd as f64).powf(-0.5) as f32;
        g.attention(
            step,
            p(&s.q),
            p(&st.ring),
            self.raw_cap,
            st.comp.as_ref().map_or(0, p),
            l.ratio,
            g.ptr(&s.allowed),
            use_mask,
            p(&l.sinks),
            c.n_head,
            hd,
            scale,
            p(&s.att),
            s.att_stride,
            p(&s.heads),
        )?;
        g.rope_tail(step, p(&s.heads), hd, c.n_head, 0, rope, true)?;
        let groups = MatSel {
            ids: g.ptr(&w.group_ids),
            x_stride: (c.q_dim() / c.o_groups) as i64,
            y_stride: c.o_lora_rank as i64,
        };
        mv(
            g,
            &l.out_a,
            p(&s.heads),
            &mut qb.heads,
            false,
            p(&s.low),
            c.o_groups,
            groups,
            fast,
        )?;
        mv(
            g,
            &l.out_b,
            p(&s.low),
            &mut qb.low,
            false,
            p(&s.o),
            1,
            plain,
            fast,
        )?;
        g.hc_post(p(&s.h), p(&s.o), p(&s.hcp), c.n_hc, c.n_embd, p(&s.h2))?;
        Ok(())
    }

    fn ffn(&mut self, w: &CudaWeights, numerics: Numerics, il: usize) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        let l: &LayerDev = &w.layers[il];
        let step = g.ptr(&self.s.step);
        let plain = MatSel::default();
        let (k, ff, e) = (c.n_expert_used, c.n_ff_exp, c.n_embd);
        hc_pre(&self.s, g, c, &l.hc_ffn, g.ptr(&self.s.h2))?;
        let s = &self.s;
        let qb = &mut self.q;
        let fast = numerics == Numerics::Fast;
        let p = |b: &DeviceBuf<f32>| g.ptr(b);
        g.rmsnorm(
            p(&s.y),
            p(&l.ffn_norm),
            ds4_cuda::WT_F32,
            e,
            1,
            c.rms_eps,
            p(&s.n),
        )?;
        g.matvec(&l.gate_inp, p(&s.n), p(&s.rlog), 1, plain)?;
        g.router(
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
        let shared_in = MatSel {
            ids,
            x_stride: 0,
            y_stride: ff as i64,
        };
        let per_mid = MatSel {
            ids,
            x_stride: ff as i64,
            y_stride: e as i64,
        };
        let int8 = |m: &ds4_cuda::DeviceMatrix| {
            numerics == Numerics::Fast
                && matches!(m.ty, GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::Q4_K)
        };
        if int8(&l.gate_exps) && int8(&l.up_exps) {
            g.quantize_act_k(p(&s.n), &mut qb.exp_in)?;
            g.matvec_q8act(&l.gate_exps, &qb.exp_in, p(&s.g), k, shared_in)?;
            g.matvec_q8act(&l.up_exps, &qb.exp_in, p(&s.u), k, shared_in)?;
        } else {
            g.matvec(&l.gate_exps, p(&s.n), p(&s.g), k, shared_in)?;
            g.matvec(&l.up_exps, p(&s.n), p(&s.u), k, shared_in)?;
        }
        g.swiglu(
            p(&s.g),
            p(&s.u),
            p(&s.rw),
            ff,
            k,
            c.swiglu_clamp[il],
            p(&s.mid),
        )?;
        if int8(&l.down_exps) {
            g.quantize_act_k(p(&s.mid), &mut qb.exp_mid)?;
            g.matvec_q8act(&l.down_exps, &qb.exp_mid, p(&s.dn), k, per_mid)?;
        } else {
            g.matvec(&l.down_exps, p(&s.mid), p(&s.dn), k, per_mid)?;
        }
        let ffs = c.n_ff_exp * c.n_expert_shared;
        mv(
            g,
            &l.gate_sh,
            p(&s.n),
            &mut qb.embd,
            false,
            p(&s.sg),
            1,
            plain,
            fast,
        )?;
        mv(
            g,
            &l.up_sh,
            p(&s.n),
            &mut qb.embd,
            l.gate_sh.ty == GgmlType::Q8_0,
            p(&s.su),
            1,
            plain,
            fast,
        )?;
        g.swiglu(
            p(&s.sg),
            p(&s.su),
            0,
            ffs,
            1,
            c.swiglu_clamp_shexp[il],
            p(&s.smid),
        )?;
        mv(
            g,
            &l.down_sh,
            p(&s.smid),
            &mut qb.shared_mid,
            false,
            p(&s.sh),
            1,
            plain,
            fast,
        )?;
        g.sum_rows(p(&s.dn), k, e, p(&s.sh), p(&s.o))?;
        g.hc_post(p(&s.h2), p(&s.o), p(&s.hcp), c.n_hc, c.n_embd, p(&s.h))?;
        Ok(())
    }

    /// The state in host form (rows in logical order, frontiers as stored).
    pub fn export(&self, w: &CudaWeights) -> Result<KvCache> {
        let g = &*w.gpu;
        let c = &w.config;
        let mut kv = KvCache::new(c, self.ctx);
        kv.n_tokens = self.n_tokens;
        let hd = c.head_dim;
        for (il, (lc, st)) in kv.layers.iter_mut().zip(&self.layers).enumerate() {
            let ring = g.download(&st.ring)?;
            let n_raw = self.n_tokens.min(self.raw_cap);
            let first = self.n_tokens - n_raw;
            let rows: Vec<f32> = (first..self.n_tokens)
                .flat_map(|pos| {
                    ring[(pos % self.raw_cap) * hd..(pos % self.raw_cap + 1) * hd]
                        .iter()
                        .copied()
                })
                .collect();
            lc.set_raw(&rows);
            let r = c.compress_ratios[il];
            if let (Some(comp), Some(skv), Some(ssc)) = (&st.comp, &st.skv, &st.ssc) {
                let n = self.n_tokens / r;
                lc.comp = g.download(comp)?[..n * hd].to_vec();
                set_frontier(lc.comp_state.as_mut(), g.download(skv)?, g.download(ssc)?);
            }
            if let (Some(index), Some(iskv), Some(issc)) = (&st.index, &st.iskv, &st.issc) {
                let n = self.n_tokens / r;
                lc.index = g.download(index)?[..n * c.idx_head_dim].to_vec();
                set_frontier(
                    lc.index_state.as_mut(),
                    g.download(iskv)?,
                    g.download(issc)?,
                );
            }
        }
        Ok(kv)
    }

    /// Loads a host-form state.
    pub fn import(&mut self, w: &CudaWeights, kv: &KvCache) -> Result<()> {
        let g = &*w.gpu;
        let c = &w.config;
        if kv.ctx > self.ctx || kv.layers.len() != self.layers.len() {
            return Err(crate::error::EngineError::Invalid(format!(
                "state for ctx {} / {} layers does not fit this session (ctx {})",
                kv.ctx,
                kv.layers.len(),
                self.ctx
            )));
        }
        let hd = c.head_dim;
        for (lc, st) in kv.layers.iter().zip(self.layers.iter_mut()) {
            let n_raw = lc.n_raw();
            let mut ring = vec![0.0f32; self.raw_cap * hd];
            for i in 0..n_raw {
                let pos = kv.n_tokens - n_raw + i;
                let slot = pos % self.raw_cap;
                ring[slot * hd..(slot + 1) * hd].copy_from_slice(lc.raw_row(i));
            }
            g.write(&mut st.ring, &ring)?;
            if let (Some(comp), Some(skv), Some(ssc), Some(f)) =
                (&mut st.comp, &mut st.skv, &mut st.ssc, &lc.comp_state)
            {
                write_prefix(g, comp, &lc.comp)?;
                g.write(skv, &f.kv)?;
                g.write(ssc, &f.score)?;
            }
            if let (Some(index), Some(iskv), Some(issc), Some(f)) =
                (&mut st.index, &mut st.iskv, &mut st.issc, &lc.index_state)
            {
                write_prefix(g, index, &lc.index)?;
                g.write(iskv, &f.kv)?;
                g.write(issc, &f.score)?;
            }
        }
        self.n_tokens = kv.n_tokens;
        Ok(())
    }

    /// An independent copy (a snapshot of the session).
    pub fn duplicate(&self, w: &CudaWeights) -> Result<DeviceState> {
        let mut d = DeviceState::new(w, self.ctx)?;
        d.import(w, &self.export(w)?)?;
        Ok(d)
    }
}

/// One projection: in the fast numerics a Q8_0 weight gets its input quantised to
/// Q8_0 first (into `xq`, which `quantized` says already holds `x`), as on the CPU.
#[allow(clippy::too_many_arguments)]
fn mv(
    g: &Gpu,
    m: &ds4_cuda::DeviceMatrix,
    x: u64,
    xq: &mut QuantAct,
    quantized: bool,
    y: u64,
    n_sel: usize,
    sel: MatSel,
    fast: bool,
) -> Result<(), CudaError> {
    if fast && m.ty == GgmlType::Q8_0 {
        if !quantized {
            g.quantize_act(x, xq)?;
        }
        g.matvec_q8act(m, xq, y, n_sel, sel)
    } else {
        g.matvec(m, x, y, n_sel, sel)
    }
}

fn set_frontier(f: Option<&mut Frontier>, kv: Vec<f32>, score: Vec<f32>) {
    if let Some(f) = f {
        f.kv = kv;
        f.score = score;
    }
}

fn write_prefix(g: &Gpu, dst: &mut DeviceBuf<f32>, src: &[f32]) -> Result<(), CudaError> {
    if src.is_empty() {
        return Ok(());
    }
    let mut view = dst.slice_mut(0..src.len());
    Ok(g.stream().memcpy_htod(src, &mut view)?)
}
