//! The CPU forward pass (model-spec.md §5), layer-major over a chunk of tokens.
//!
//! Projections run over the whole chunk (each weight row is read once and reused for
//! every token; routed experts are grouped by expert), while everything that reads
//! or writes the cache — RoPE, QAT, raw push, compressors, indexer, attention — runs
//! token by token in order. Every output value is computed by the same dot on the
//! same inputs as in one-token decode, so a chunk gives bit-identical results.

use ds4_gguf::quant::f16_round;
use rayon::prelude::*;

use crate::backend::{check_tokens, LogitRows};
use crate::config::Config;
use crate::error::Result;
use crate::imatrix::{MoeActivations, MoeObserver};
use crate::kv::{Frontier, KvCache, LayerCache};
use crate::model::ModelInner;
use crate::ops::attention::attend_head;
use crate::ops::compressor;
use crate::ops::hc::{self, HcMix};
use crate::ops::indexer;
use crate::ops::linear::{matmul, matmul_f32, matmul_rows, Numerics, Prepared};
use crate::ops::moe::{route, Route};
use crate::ops::norm::{rms_scale, rmsnorm_inplace, rmsnorm_rows_inplace, sigmoid, silu};
use crate::ops::qat::{fp4_e2m1_inplace, fp8_e4m3_inplace, hadamard_inplace};
use crate::ops::rope::{self, Rope, RopeAngles};
use crate::steer::{Component, Steering};
use crate::weights::{CompressorWeights, HcWeights, LayerWeights, Mat};

use super::rows::LayerJournal;

/// FP8 simulation block of KV nope dims.
const FP8_BLOCK: usize = 64;
/// FP4 simulation block of indexer vectors.
const FP4_BLOCK: usize = 32;
/// Attention work (rows × query dims) above which heads run in parallel.
const ATTN_PAR_MIN: usize = 1 << 18;

/// What a forward pass records besides the logits.
#[derive(Default)]
pub(crate) struct Taps<'a> {
    /// The final hyper-connection state of the last token (`[n_hc][n_embd]`, before the
    /// head collapses the streams): the input the MTP draft block needs
    /// (architecture.md, "MTP draft block").
    pub last_hc: Option<&'a mut Vec<f32>>,
    /// The final hyper-connection state of every token (`[n][n_hc·n_embd]`): a
    /// multi-row step keeps it so that the MTP draft after `commit_rows(a)` can start
    /// from row `a − 1` without running the forward pass again.
    pub rows_hc: Option<&'a mut Vec<f32>>,
    /// Per layer, what a multi-row step needs to replay a prefix of the chunk
    /// (`super::rows`): the raw rows pushed and the compressor inputs.
    pub journal: Option<&'a mut Vec<LayerJournal>>,
    /// Receives each layer's routed-expert inputs (imatrix collection, `imatrix.rs`).
    pub moe: Option<&'a mut dyn MoeObserver>,
    /// Directional steering of the sublayer outputs (`crate::steer`); `None` or zero
    /// scales: none (the forward pass is then the unsteered one, bit for bit).
    pub steer: Option<&'a Steering>,
    /// Records one sublayer output of every layer (after steering), layer-major:
    /// `[n_layer][n][n_embd]` (`ds4-tool steer build`, steering tests).
    pub act: Option<(Component, &'a mut Vec<f32>)>,
}

/// Runs `tokens` at positions `cache.n_tokens..` and returns the requested logits,
/// recording what `taps` asks for. Fails before touching the cache (bad token, context
/// full), never half-way.
pub(crate) fn forward(
    m: &ModelInner,
    numerics: Numerics,
    cache: &mut KvCache,
    tokens: &[u32],
    rows: LogitRows,
    taps: Taps,
) -> Result<Vec<f32>> {
    let cfg = &m.config;
    check_tokens(tokens, cfg.vocab, cache.n_tokens, cache.ctx)?;
    let n = tokens.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let e = cfg.n_embd;
    let nhc = cfg.n_hc;
    // HC state: [token][stream][n_embd], every stream starting as the embedding.
    let mut h = vec![0.0f32; n * nhc * e];
    let emb = m.weights.token_embd.view();
    let mut row = vec![0.0f32; e];
    for (t, &tok) in tokens.iter().enumerate() {
        emb.dequant_row(tok as usize, &mut row);
        for s in 0..nhc {
            h[(t * nhc + s) * e..(t * nhc + s + 1) * e].copy_from_slice(&row);
        }
    }
    let pos0 = cache.n_tokens;
    let Taps {
        last_hc,
        rows_hc,
        mut journal,
        mut moe,
        steer,
        act,
    } = taps;
    let (act_c, act_out) = match act {
        Some((c, out)) => (Some(c), Some(out)),
        None => (None, None),
    };
    let rec = std::cell::RefCell::new(Vec::new());
    for (il, lw) in m.weights.layers.iter().enumerate() {
        let ctx = LayerCtx {
            cfg,
            lw,
            rope: &m.ropes[il],
            numerics,
            pos0,
            tokens,
            steer: steer.filter(|s| s.active()),
            act: act_c.map(|c| (c, &rec)),
        };
        ctx.attention(
            &mut h,
            &mut cache.layers[il],
            journal.as_deref_mut().map(|j| {
                j.push(LayerJournal::default());
                j.last_mut().expect("just pushed")
            }),
        );
        let obs: Option<&mut dyn MoeObserver> = match moe {
            Some(ref mut o) => Some(&mut **o),
            None => None,
        };
        ctx.ffn(&mut h, obs);
    }
    if let Some(out) = act_out {
        *out = rec.into_inner();
    }
    cache.n_tokens += n;
    if let Some(out) = last_hc {
        out.clear();
        out.extend_from_slice(&h[(n - 1) * nhc * e..]);
    }
    if let Some(out) = rows_hc {
        out.clear();
        out.extend_from_slice(&h);
    }
    let sel: Vec<usize> = match rows {
        LogitRows::None => return Ok(Vec::new()),
        LogitRows::Last => vec![n - 1],
        LogitRows::All => (0..n).collect(),
    };
    let w = &m.weights;
    Ok(head(
        cfg,
        numerics,
        &w.head_hc,
        &w.output_norm,
        &w.output,
        &h,
        &sel,
    ))
}

/// One layer (attention then FFN sublayer) over the HC states `h` (`[n][n_hc][n_embd]`)
/// of `tokens` at positions `pos0..`, with `cache` its state. The main model's layers
/// and the MTP block both run through here.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_forward(
    cfg: &Config,
    lw: &LayerWeights,
    rope: &Rope,
    numerics: Numerics,
    pos0: usize,
    tokens: &[u32],
    h: &mut [f32],
    cache: &mut LayerCache,
    journal: Option<&mut LayerJournal>,
) {
    let ctx = LayerCtx {
        cfg,
        lw,
        rope,
        numerics,
        pos0,
        tokens,
        steer: None,
        act: None,
    };
    ctx.attention(h, cache, journal);
    ctx.ffn(h, None);
}

/// The output head for the selected tokens: sigmoid-weighted stream collapse (`hc`),
/// `norm`, vocabulary projection (`output`). The MTP block passes its own `hc`/`norm`.
pub(crate) fn head(
    cfg: &Config,
    numerics: Numerics,
    hc: &HcWeights,
    norm: &[f32],
    output: &Mat,
    h: &[f32],
    sel: &[usize],
) -> Vec<f32> {
    let (e, nhc) = (cfg.n_embd, cfg.n_hc);
    let hs: Vec<f32> = sel
        .iter()
        .flat_map(|&t| h[t * nhc * e..(t + 1) * nhc * e].iter().copied())
        .collect();
    let mut mixes = vec![0.0f32; sel.len() * nhc];
    matmul_f32(hc.fn_.view(), &hs, numerics, &mut mixes);
    let mut x = vec![0.0f32; sel.len() * e];
    for (i, hrow) in hs.chunks_exact(nhc * e).enumerate() {
        let rs = rms_scale(hrow, cfg.rms_eps);
        let pre: Vec<f32> = (0..nhc)
            .map(|s| sigmoid(mixes[i * nhc + s] * rs * hc.scale[0] + hc.base[s]) + cfg.hc_eps)
            .collect();
        let xi = &mut x[i * e..(i + 1) * e];
        hc::weighted_sum(hrow, &pre, xi);
        rmsnorm_inplace(xi, norm, cfg.rms_eps);
    }
    let mut logits = vec![0.0f32; sel.len() * cfg.vocab];
    matmul_f32(output.view(), &x, numerics, &mut logits);
    logits
}

struct LayerCtx<'a> {
    cfg: &'a Config,
    lw: &'a LayerWeights,
    rope: &'a Rope,
    numerics: Numerics,
    pos0: usize,
    tokens: &'a [u32],
    /// Steering (only when a scale is nonzero) and the activation tap (see [`Taps`]).
    steer: Option<&'a Steering>,
    act: Option<(Component, &'a std::cell::RefCell<Vec<f32>>)>,
}

impl LayerCtx<'_> {
    fn n(&self) -> usize {
        self.tokens.len()
    }

    /// A sublayer's output `out` (`[n][n_embd]`) before hc_post: steering, then the tap.
    fn sublayer_out(&self, c: Component, out: &mut [f32]) {
        if let Some(s) = self.steer {
            s.apply(c, self.lw.il, out);
        }
        if let Some((want, rec)) = self.act {
            if want == c {
                rec.borrow_mut().extend_from_slice(out);
            }
        }
    }

    /// Rounding applied to every stored cache row: none in exact mode, f16 in ds4's.
    fn store(&self, row: &mut [f32]) {
        if self.numerics == Numerics::Fast {
            for v in row.iter_mut() {
                *v = f16_round(*v);
            }
        }
    }

    /// HC pre for every token: the sublayer inputs `[n][n_embd]` and the mixes.
    fn hc_pre(&self, hcw: &HcWeights, h: &[f32]) -> (Vec<f32>, Vec<HcMix>) {
        let cfg = self.cfg;
        let (e, nhc) = (cfg.n_embd, cfg.n_hc);
        let nmix = cfg.hc_mix();
        let n = self.n();
        let mut mixes = vec![0.0f32; n * nmix];
        // The official order: project the raw streams, then scale by the RMS factor.
        matmul_f32(hcw.fn_.view(), h, self.numerics, &mut mixes);
        let mut y = vec![0.0f32; n * e];
        let mut out = Vec::with_capacity(n);
        for t in 0..n {
            let ht = &h[t * nhc * e..(t + 1) * nhc * e];
            let rs = rms_scale(ht, cfg.rms_eps);
            let mix: Vec<f32> = mixes[t * nmix..(t + 1) * nmix]
                .iter()
                .map(|v| v * rs)
                .collect();
            let hm = hc::split_sinkhorn(
                &mix,
                &hcw.scale,
                &hcw.base,
                nhc,
                cfg.sinkhorn_iters,
                cfg.hc_eps,
            );
            hc::weighted_sum(ht, &hm.pre, &mut y[t * e..(t + 1) * e]);
            out.push(hm);
        }
        (y, out)
    }

    fn hc_post(&self, h: &mut [f32], out: &[f32], mixes: &[HcMix]) {
        let (e, nhc) = (self.cfg.n_embd, self.cfg.n_hc);
        let mut hn = vec![0.0f32; nhc * e];
        for (t, mix) in mixes.iter().enumerate() {
            let ht = &mut h[t * nhc * e..(t + 1) * nhc * e];
            hc::post(&out[t * e..(t + 1) * e], ht, mix, &mut hn);
            ht.copy_from_slice(&hn);
        }
    }

    fn attention(
        &self,
        h: &mut [f32],
        cache: &mut LayerCache,
        mut journal: Option<&mut LayerJournal>,
    ) {
        let cfg = self.cfg;
        let lw = self.lw;
        let n = self.n();
        let (hd, rd) = (cfg.head_dim, cfg.rope_dim);
        let nh = cfg.n_head;
        let qdim = nh * hd;
        let eps = cfg.rms_eps;

        let (mut x, mixes) = self.hc_pre(&lw.hc_attn, h);
        rmsnorm_rows_inplace(&mut x, &lw.attn_norm, eps);

        // Q: low rank, normalised q-LoRA vector, then per-head RMS without weight.
        let mut qr = vec![0.0f32; n * cfg.q_lora_rank];
        let mut kv = vec![0.0f32; n * hd];
        {
            // q_a and kv read the same input; prepare it once per weight type.
            let pa = Prepared::for_mat(&x, &lw.q_a.view(), self.numerics);
            matmul(lw.q_a.view(), &pa, &mut qr);
            if lw.kv.ty == lw.q_a.ty {
                matmul(lw.kv.view(), &pa, &mut kv);
            } else {
                matmul_f32(lw.kv.view(), &x, self.numerics, &mut kv);
            }
        }
        rmsnorm_rows_inplace(&mut qr, &lw.q_a_norm, eps);
        rmsnorm_rows_inplace(&mut kv, &lw.kv_norm, eps);
        let mut q = vec![0.0f32; n * qdim];
        matmul_f32(lw.q_b.view(), &qr, self.numerics, &mut q);
        for head in q.chunks_exact_mut(hd) {
            let s = rms_scale(head, eps);
            for v in head.iter_mut() {
                *v *= s;
            }
        }

        // Compressor and indexer projections depend only on x / qr: batch them.
        let project = |c: &CompressorWeights| {
            let w = c.lanes * c.dim;
            let mut k = vec![0.0f32; n * w];
            let mut g = vec![0.0f32; n * w];
            matmul_f32(c.kv.view(), &x, self.numerics, &mut k);
            matmul_f32(c.gate.view(), &x, self.numerics, &mut g);
            (k, g)
        };
        let comp_proj = lw.compressor.as_ref().map(project);
        let idx_proj = lw.indexer.as_ref().map(|ix| {
            let c = &ix.compressor;
            let (k, g) = project(c);
            // Queries and head weights only for tokens that will see more index rows
            // than top-k (before that every compressed row is used).
            let need: Vec<usize> = (0..n)
                .filter(|&t| (self.pos0 + t + 1) / c.ratio > cfg.idx_topk)
                .collect();
            let iq_dim = cfg.idx_heads * cfg.idx_head_dim;
            let mut iq = vec![0.0f32; need.len() * iq_dim];
            let mut iw = vec![0.0f32; need.len() * cfg.idx_heads];
            if !need.is_empty() {
                let pq = Prepared::for_mat(&qr, &ix.q_b.view(), self.numerics);
                matmul_rows(ix.q_b.view(), &pq, Some(&need), &mut iq);
                let px = Prepared::for_mat(&x, &ix.proj.view(), self.numerics);
                matmul_rows(ix.proj.view(), &px, Some(&need), &mut iw);
            }
            let mut slot = vec![usize::MAX; n];
            for (i, &t) in need.iter().enumerate() {
                slot[t] = i;
            }
            (k, g, iq, iw, slot)
        });
        if let Some(j) = journal.as_deref_mut() {
            j.comp = comp_proj.clone();
            j.index = idx_proj.as_ref().map(|(k, g, ..)| (k.clone(), g.clone()));
        }

        let scale = (hd as f64).powf(-0.5) as f32;
        let idx_scale =
            ((cfg.idx_head_dim as f64).powf(-0.5) * (cfg.idx_heads as f64).powf(-0.5)) as f32;
        let mut heads = vec![0.0f32; n * qdim];
        for t in 0..n {
            let pos = self.pos0 + t;
            let ang = self.rope.angles(pos);
            let qt = &mut q[t * qdim..(t + 1) * qdim];
            rope::apply_heads(qt, hd, &ang, false);
            let kvt = &mut kv[t * hd..(t + 1) * hd];
            rope::apply(&mut kvt[hd - rd..], &ang, false);
            fp8_e4m3_inplace(&mut kvt[..hd - rd], FP8_BLOCK);
            self.store(kvt);
            cache.push_raw(kvt);
            if let Some(j) = journal.as_deref_mut() {
                j.raw.extend_from_slice(kvt);
            }

            if let (Some(c), Some((k, g))) = (&lw.compressor, &comp_proj) {
                let st = cache
                    .comp_state
                    .as_mut()
                    .expect("compressed layer has state");
                self.compress_step(c, st, (k, g), t, false, &mut cache.comp);
            }
            let mut allowed = None;
            if let (Some(ix), Some((k, g, iq, iw, slot))) = (&lw.indexer, &idx_proj) {
                let st = cache.index_state.as_mut().expect("indexer layer has state");
                self.compress_step(&ix.compressor, st, (k, g), t, true, &mut cache.index);
                if cache.n_index() > cfg.idx_topk {
                    let i = slot[t];
                    let d = cfg.idx_head_dim;
                    let iq_dim = cfg.idx_heads * d;
                    let mut qi = iq[i * iq_dim..(i + 1) * iq_dim].to_vec();
                    for qh in qi.chunks_exact_mut(d) {
                        rope::apply(&mut qh[d - rd..], &ang, false);
                        hadamard_inplace(qh);
                        fp4_e2m1_inplace(qh, FP4_BLOCK);
                    }
                    let wts: Vec<f32> = iw[i * cfg.idx_heads..(i + 1) * cfg.idx_heads]
                        .iter()
                        .map(|v| v * idx_scale)
                        .collect();
                    let s = indexer::scores(&cache.index, d, &qi, &wts);
                    allowed = Some(indexer::top_k_mask(&s, cfg.idx_topk));
                }
            }

            // Visible rows: the raw window (oldest first), then compressed rows.
            let mut rows: Vec<&[f32]> = (0..cache.n_raw()).map(|i| cache.raw_row(i)).collect();
            for c in 0..cache.n_comp() {
                if allowed.as_ref().is_none_or(|a| a[c]) {
                    rows.push(cache.comp_row(c));
                }
            }
            let qt = &q[t * qdim..(t + 1) * qdim];
            let ot = &mut heads[t * qdim..(t + 1) * qdim];
            let one_head = |(hh, (oh, qh)): (usize, (&mut [f32], &[f32]))| {
                let mut sc = Vec::with_capacity(rows.len());
                attend_head(qh, &rows, lw.sinks[hh], scale, &mut sc, oh);
            };
            // Heads are independent: split them over threads when the rows are many.
            if rows.len() * qdim >= ATTN_PAR_MIN {
                ot.par_chunks_mut(hd)
                    .zip(qt.par_chunks(hd))
                    .enumerate()
                    .for_each(one_head);
            } else {
                ot.chunks_mut(hd)
                    .zip(qt.chunks(hd))
                    .enumerate()
                    .for_each(one_head);
            }
            rope::apply_heads(ot, hd, &ang, true);
        }

        // Grouped low-rank output: group g maps its heads' dims to o_lora_rank.
        let groups = cfg.o_groups;
        let gin = qdim / groups;
        let olr = cfg.o_lora_rank;
        let mut low = vec![0.0f32; n * groups * olr];
        let mut gx = vec![0.0f32; n * gin];
        let mut gy = vec![0.0f32; n * olr];
        for g in 0..groups {
            for t in 0..n {
                gx[t * gin..(t + 1) * gin]
                    .copy_from_slice(&heads[t * qdim + g * gin..t * qdim + (g + 1) * gin]);
            }
            let wa = lw.out_a.view().rows(g * olr, olr);
            matmul_f32(wa, &gx, self.numerics, &mut gy);
            for t in 0..n {
                low[t * groups * olr + g * olr..t * groups * olr + (g + 1) * olr]
                    .copy_from_slice(&gy[t * olr..(t + 1) * olr]);
            }
        }
        let mut o = vec![0.0f32; n * cfg.n_embd];
        matmul_f32(lw.out_b.view(), &low, self.numerics, &mut o);
        self.sublayer_out(Component::AttnOut, &mut o);
        self.hc_post(h, &o, &mixes);
    }

    /// Norm, RoPE at the window's first position, and QAT of a freshly pooled row.
    /// Feeds token `t` of the compressor projections `(kv, score)` (all tokens' rows) to
    /// its frontier `st`; a row the step completes is finished (as an index row when
    /// `index`) and appended to `out`.
    fn compress_step(
        &self,
        c: &CompressorWeights,
        st: &mut Frontier,
        (kv, score): (&[f32], &[f32]),
        t: usize,
        index: bool,
        out: &mut Vec<f32>,
    ) {
        let pos = self.pos0 + t;
        let w = c.lanes * c.dim;
        let kv = &kv[t * w..(t + 1) * w];
        if let Some(mut row) = compressor::step(st, c.pool(), kv, &score[t * w..(t + 1) * w], pos) {
            self.finish_row(&mut row, &c.norm, pos, index);
            out.extend_from_slice(&row);
        }
    }

    fn finish_row(&self, row: &mut [f32], norm: &[f32], pos: usize, index: bool) {
        let rd = self.cfg.rope_dim;
        let d = row.len();
        let ratio = self.lw.ratio;
        rmsnorm_inplace(row, norm, self.cfg.rms_eps);
        let ang: RopeAngles = self.rope.angles(pos + 1 - ratio);
        rope::apply(&mut row[d - rd..], &ang, false);
        if index {
            hadamard_inplace(row);
            fp4_e2m1_inplace(row, FP4_BLOCK);
        } else {
            fp8_e4m3_inplace(&mut row[..d - rd], FP8_BLOCK);
        }
        self.store(row);
    }

    fn ffn(&self, h: &mut [f32], moe: Option<&mut dyn MoeObserver>) {
        let cfg = self.cfg;
        let lw = self.lw;
        let n = self.n();
        let e = cfg.n_embd;
        let (mut x, mixes) = self.hc_pre(&lw.hc_ffn, h);
        rmsnorm_rows_inplace(&mut x, &lw.ffn_norm, cfg.rms_eps);

        let mut rl = vec![0.0f32; n * cfg.n_expert];
        matmul_f32(lw.gate_inp.view(), &x, self.numerics, &mut rl);
        let k = cfg.n_expert_used;
        let routes: Vec<Route> = (0..n)
            .map(|t| {
                let hash = lw.tid2eid.as_ref().map(|tab| {
                    &tab[self.tokens[t] as usize * k..(self.tokens[t] as usize + 1) * k]
                });
                route(
                    &rl[t * cfg.n_expert..(t + 1) * cfg.n_expert],
                    lw.exp_probs_b.as_deref(),
                    hash,
                    k,
                    cfg.expert_weights_scale,
                    cfg.expert_weights_norm,
                )
            })
            .collect();
        let mut out = self.routed(&x, &routes, moe);
        let sh = self.shared(&x);
        for (o, s) in out.iter_mut().zip(&sh) {
            *o += s;
        }
        debug_assert_eq!(out.len(), n * e);
        self.sublayer_out(Component::FfnOut, &mut out);
        self.hc_post(h, &out, &mixes);
    }

    /// Routed experts, grouped by expert so each expert's rows are read once per chunk.
    fn routed(&self, x: &[f32], routes: &[Route], moe: Option<&mut dyn MoeObserver>) -> Vec<f32> {
        let cfg = self.cfg;
        let lw = self.lw;
        let n = self.n();
        let (e, ff) = (cfg.n_embd, cfg.n_ff_exp);
        let k = cfg.n_expert_used;
        let clamp = cfg.swiglu_clamp[lw.il];
        // (token, k) slots of each expert.
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); cfg.n_expert];
        for (t, r) in routes.iter().enumerate() {
            for (j, &ex) in r.experts.iter().enumerate() {
                by_expert[ex].push((t, j));
            }
        }
        let px = Prepared::for_mat(x, &lw.gate_exps.view(), self.numerics);
        let mut mid = vec![0.0f32; n * k * ff];
        for (ex, slots) in by_expert.iter().enumerate() {
            if slots.is_empty() {
                continue;
            }
            let toks: Vec<usize> = slots.iter().map(|&(t, _)| t).collect();
            let mut g = vec![0.0f32; toks.len() * ff];
            let mut u = vec![0.0f32; toks.len() * ff];
            matmul_rows(lw.gate_exps.expert(ex), &px, Some(&toks), &mut g);
            matmul_rows(lw.up_exps.expert(ex), &px, Some(&toks), &mut u);
            for (i, &(t, j)) in slots.iter().enumerate() {
                let w = routes[t].weights[j];
                let dst = &mut mid[(t * k + j) * ff..(t * k + j + 1) * ff];
                swiglu(
                    &g[i * ff..(i + 1) * ff],
                    &u[i * ff..(i + 1) * ff],
                    clamp,
                    Some(w),
                    dst,
                );
            }
        }
        if let Some(obs) = moe {
            let experts: Vec<u32> = routes
                .iter()
                .flat_map(|r| r.experts.iter().map(|&x| x as u32))
                .collect();
            obs.observe(&MoeActivations {
                layer: lw.il,
                n_tokens: n,
                x,
                experts: &experts,
                mid: &mid,
            });
        }
        let pm = Prepared::for_mat(&mid, &lw.down_exps.view(), self.numerics);
        let mut down = vec![0.0f32; n * k * e];
        for (ex, slots) in by_expert.iter().enumerate() {
            if slots.is_empty() {
                continue;
            }
            let ids: Vec<usize> = slots.iter().map(|&(t, j)| t * k + j).collect();
            let mut d = vec![0.0f32; ids.len() * e];
            matmul_rows(lw.down_exps.expert(ex), &pm, Some(&ids), &mut d);
            for (i, &id) in ids.iter().enumerate() {
                down[id * e..(id + 1) * e].copy_from_slice(&d[i * e..(i + 1) * e]);
            }
        }
        // Sum in selection order, as one-token decode does.
        let mut out = vec![0.0f32; n * e];
        for t in 0..n {
            let o = &mut out[t * e..(t + 1) * e];
            for j in 0..k {
                for (ov, dv) in o
                    .iter_mut()
                    .zip(&down[(t * k + j) * e..(t * k + j + 1) * e])
                {
                    *ov += dv;
                }
            }
        }
        out
    }

    fn shared(&self, x: &[f32]) -> Vec<f32> {
        let cfg = self.cfg;
        let lw = self.lw;
        let n = self.n();
        let ff = lw.gate_sh.n_out;
        let mut g = vec![0.0f32; n * ff];
        let mut u = vec![0.0f32; n * ff];
        let px = Prepared::for_mat(x, &lw.gate_sh.view(), self.numerics);
        matmul(lw.gate_sh.view(), &px, &mut g);
        if lw.up_sh.ty == lw.gate_sh.ty {
            matmul(lw.up_sh.view(), &px, &mut u);
        } else {
            matmul_f32(lw.up_sh.view(), x, self.numerics, &mut u);
        }
        let mut mid = vec![0.0f32; n * ff];
        swiglu(&g, &u, cfg.swiglu_clamp_shexp[lw.il], None, &mut mid);
        let mut out = vec![0.0f32; n * cfg.n_embd];
        matmul_f32(lw.down_sh.view(), &mid, self.numerics, &mut out);
        out
    }
}

/// `silu(min(g, c))·clamp(u, ±c)` (·w), the clamp applying when `c > 0`.
fn swiglu(g: &[f32], u: &[f32], c: f32, w: Option<f32>, out: &mut [f32]) {
    for ((o, &gv), &uv) in out.iter_mut().zip(g).zip(u) {
        let (gv, uv) = if c > 0.0 {
            (gv.min(c), uv.clamp(-c, c))
        } else {
            (gv, uv)
        };
        let v = silu(gv) * uv;
        *o = match w {
            Some(w) => v * w,
            None => v,
        };
    }
}
