//! Kernel variants that must give the same bits as the kernels they replace, run
//! through the same launchers with their fusion off and on: the hyper-connection
//! kernels with every load issued first (`hc_pre_pl`, `hc_mix_pl`, `hc_post_pl`,
//! fusion `hc_preload`) at the Flash shape (4 streams of 4,096), the router reading
//! four keys per load (`router_wide`, fusion `router4`) and the F16 matvec with its
//! first weight loads before the PDL wait (`matvec_f16_early`, fusion `f16_early`),
//! and the indexer scores staged without bank conflicts (`indexer_scores_sp`, fusion
//! `idx_banks`), which is also checked against an f64 reference, and the top-k select
//! with its keys in registers (`topk_select_rg`, fusion `topk_reg`), also checked
//! against a sort, and the fused norm + Q8_0 with its weights fetched first
//! (`rmsnorm_q8_pl`, fusion `norm_pl`), and the indexer query with one warp per head
//! (`indexer_q_warp`, fusion `idxq_warp`). The HC boundary's Gram form
//! (`hc_post_gram`, `hc_gram_shares`, `hc_start_gram`, fusion `hc_gram`) sums in
//! another order: its streams must keep hc_post_pl's bits, its mix, norm and Q8_0 stay
//! within the matvec bound of hc_mix + hc_pre.

use anyhow::Result;
use ds4_gguf::quant::qat::fp4_e2m1_inplace;
use ds4_gguf::quant::random::Rng;
use ds4_gguf::GgmlType;

use super::common::{
    bit_identical, bit_same, both, dequant_q8, normal, random_matrix, random_vec, rel_err,
    rope_freqs, same_bits, same_both, upload_rope, Check, BOUND_MATVEC,
};
use crate::{DeviceMatrix, HcNorm, HcParams, Launcher, MatSel, Variant, WT_F16, WT_F32};

const N_HC: usize = 4;
const N_EMBD: usize = 4096;

/// The indexer query (64 heads of 128, RoPE on the last 64 dims) of three tokens at
/// different positions, through the launcher with `idxq_warp` off and on.
pub(super) fn check_indexer_q_warp(gpu: &Launcher, seed: u64) -> Result<Check> {
    let mut rng = Rng::stream(seed, 0x1a, 0);
    let (heads, dim) = (64usize, 128usize);
    let positions = [0i32, 2100, 65_537];
    let n_tok = positions.len();
    let q = normal(&mut rng, n_tok * heads * dim, 1.0);
    let (_freqs, rope) = upload_rope(gpu, &rope_freqs(64))?;
    let steps: Vec<i32> = positions.iter().flat_map(|&p| [p, 0]).collect();
    let steps = gpu.upload(&steps)?;
    let name = format!("indexer_q_warp = indexer_q {heads}x{dim}, {n_tok} tokens");
    same_both(gpu, Variant::IdxqWarp, name, |gpu| {
        let d_q = gpu.upload(&q)?;
        gpu.indexer_q(n_tok, gpu.ptr(&steps), gpu.ptr(&d_q), heads, dim, rope)?;
        Ok(gpu.download(&d_q)?)
    })
}

/// rmsnorm_q8 rows at the model's widths (512 and 1024: the kv and q_a norms; 4096 at
/// four values a thread; 8192 past the register path), weighted and not, two rows.
pub(super) fn check_norm_pl(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x40, 0);
    let mut checks = Vec::new();
    let rows = 2;
    for n in [512usize, 1024, 4096, 8192] {
        let x = gpu.upload(&normal(&mut rng, rows * n, 1.0))?;
        let w = gpu.upload(&normal(&mut rng, n, 0.5))?;
        for weighted in [true, false] {
            let kind = if weighted { "weighted" } else { "unweighted" };
            let name = format!("rmsnorm_q8_pl = rmsnorm_q8 {rows}x{n} {kind}");
            checks.push(same_both(gpu, Variant::NormPl, name, |gpu| {
                let y = gpu.upload(&vec![f32::NAN; rows * n])?;
                let mut qa = gpu.alloc_quant_act(rows, n)?;
                let wp = if weighted { gpu.ptr(&w) } else { 0 };
                gpu.rmsnorm_q8(gpu.ptr(&x), wp, WT_F32, n, rows, 1e-6, gpu.ptr(&y), &mut qa)?;
                let mut all = gpu.download(&y)?;
                all.extend(gpu.download(&qa.q)?.iter().map(|&v| v as f32));
                all.extend(gpu.download(&qa.d)?);
                Ok(all)
            })?);
        }
    }
    Ok(checks)
}

/// The indices of the k largest scores in ascending order, ties at the k-th value to
/// the lowest indices (what topk_select writes).
fn topk_reference(scores: &[f32], k: usize) -> Vec<i32> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut top: Vec<i32> = idx[..k].iter().map(|&i| i as i32).collect();
    top.sort_unstable();
    top
}

/// The batched indexer scores on tensor cores (`idx_mma`) for nine tokens (two token
/// groups, one token with no more rows than top-k) over FP4-simulated rows and queries,
/// as the model makes them: against the f64 reference, and against the FMA kernel bit
/// for bit (exact products; the dot products agree wherever their partial sums are
/// exact in f32, which FP4 blocks of similar scale make the rule).
pub(super) fn check_indexer_mma(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let (heads, dim) = (64usize, 128usize);
    let mut rng = Rng::stream(seed, 0x1e, 0);
    let mut rows = normal(&mut rng, IDX_MAX_ROWS * dim, 1.0);
    fp4_e2m1_inplace(&mut rows, 32);
    let positions = [2100usize, 2047, 4099, 3000, 2600, 4000, 2101, 3500, 2999];
    let n_tok = positions.len();
    let mut q = normal(&mut rng, n_tok * heads * dim, 1.0);
    fp4_e2m1_inplace(&mut q, 32);
    let wt = normal(&mut rng, n_tok * heads, 1.0);
    let batch = IndexerBatch {
        positions: &positions,
        rows: &rows,
        q: &q,
        wt: &wt,
        heads,
        dim,
    };
    let d_rows = gpu.upload(&rows)?;
    let (plain, mma) = batch.run_both(gpu, gpu.ptr(&d_rows), Variant::IdxMma)?;
    let shape = format!("{heads}x{dim} FP4, {n_tok} tokens");
    Ok(vec![
        batch.reference_check(
            &mma,
            format!("indexer_scores_mma {shape} (untouched rows kept)"),
            1e-6,
        ),
        bit_identical(
            format!("indexer_scores_mma = indexer_scores {shape}"),
            same_bits(&mma, &plain),
        ),
    ])
}

/// Top-512 selections for tokens with 525 to 6,000 rows (the register path up to 4,096,
/// the memory path past it, one token with no more rows than k: untouched), with many
/// exact ties and both signs, against a sort; `topk_select_rg` against the plain kernel.
pub(super) fn check_topk(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    const K: usize = 512;
    const RATIO: usize = 4;
    const STRIDE: usize = 6000;
    let mut rng = Rng::stream(seed, 0x70, 0);
    let positions = [2100usize, 2047, 4099, 16383, 16387, 23999];
    let n_tok = positions.len();
    let mut scores = Vec::with_capacity(n_tok * STRIDE);
    for _ in 0..n_tok {
        // Coarse values: every score has dozens of exact ties.
        scores.extend((0..STRIDE).map(|_| (rng.normal() * 8.0).round() / 4.0));
    }
    let steps: Vec<i32> = positions.iter().flat_map(|&p| [p as i32, 0]).collect();
    let (d_steps, d_scores) = (gpu.upload(&steps)?, gpu.upload(&scores)?);
    let (a, b) = both(gpu, Variant::TopkReg, |gpu| {
        let sel = gpu.upload(&vec![-1i32; n_tok * K])?;
        gpu.topk_select(
            n_tok,
            gpu.ptr(&d_steps),
            gpu.ptr(&d_scores),
            STRIDE,
            RATIO,
            K,
            gpu.ptr(&sel),
        )?;
        Ok(gpu.download(&sel)?)
    })?;
    let mut mismatched = 0usize;
    for (t, &pos) in positions.iter().enumerate() {
        let n = (pos + 1) / RATIO;
        let got = &a[t * K..(t + 1) * K];
        let want = if n <= K {
            vec![-1; K]
        } else {
            topk_reference(&scores[t * STRIDE..t * STRIDE + n], K)
        };
        mismatched += got.iter().zip(&want).filter(|(g, w)| g != w).count();
    }
    let as_f32 = |v: &[i32]| v.iter().map(|&i| i as f32).collect::<Vec<_>>();
    Ok(vec![
        Check {
            name: format!("topk_select top {K} of up to 6000, ties (exact; {mismatched} wrong)"),
            rel_err: mismatched as f64,
            bound: 0.0,
        },
        bit_identical(
            format!("topk_select_rg = topk_select top {K}, {n_tok} tokens"),
            same_bits(&as_f32(&a), &as_f32(&b)),
        ),
    ])
}

/// f64 reference of the indexer scores of `n` rows: Σ_h relu(row · q_h) · wt_h · wscale.
fn indexer_reference(
    rows: &[f32],
    q: &[f32],
    wt: &[f32],
    dim: usize,
    n: usize,
    wscale: f32,
) -> Vec<f64> {
    (0..n)
        .map(|c| {
            let row = &rows[c * dim..(c + 1) * dim];
            q.chunks(dim)
                .zip(wt)
                .map(|(qh, &w)| {
                    let dot: f64 = row.iter().zip(qh).map(|(&a, &b)| a as f64 * b as f64).sum();
                    dot.max(0.0) * w as f64 * wscale as f64
                })
                .sum()
        })
        .collect()
}

/// The indexer checks' layer: ratio-4 rows, top-512, score rows of 1,100.
const IDX_RATIO: usize = 4;
const IDX_TOP_K: usize = 512;
const IDX_MAX_ROWS: usize = 1100;

/// One batch of indexer inputs (rows shared by every token; per token `heads` query
/// heads of `dim` and `heads` weights), on the host for the reference.
struct IndexerBatch<'a> {
    positions: &'a [usize],
    rows: &'a [f32],
    q: &'a [f32],
    wt: &'a [f32],
    heads: usize,
    dim: usize,
}

impl IndexerBatch<'_> {
    fn wscale(&self) -> f32 {
        (self.dim as f32).powf(-0.5) / (self.heads as f32).sqrt()
    }

    /// The scores (rows of IDX_MAX_ROWS, NaN where untouched) with `fusion` off, then on.
    fn run_both(
        &self,
        gpu: &Launcher,
        d_rows: u64,
        fusion: Variant,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let n_tok = self.positions.len();
        let steps: Vec<i32> = self.positions.iter().flat_map(|&p| [p as i32, 0]).collect();
        let (d_steps, d_q, d_wt) = (
            gpu.upload(&steps)?,
            gpu.upload(self.q)?,
            gpu.upload(self.wt)?,
        );
        both(gpu, fusion, |gpu| {
            let scores = gpu.upload(&vec![f32::NAN; n_tok * IDX_MAX_ROWS])?;
            gpu.indexer_scores(
                n_tok,
                gpu.ptr(&d_steps),
                d_rows,
                gpu.ptr(&d_q),
                gpu.ptr(&d_wt),
                self.heads,
                self.dim,
                self.wscale(),
                IDX_RATIO,
                IDX_TOP_K,
                gpu.ptr(&scores),
                IDX_MAX_ROWS,
                0,
            )?;
            Ok(gpu.download(&scores)?)
        })
    }

    /// `out`'s live rows against the f64 reference, failing outright where a row past
    /// a token's count (or any row of a token with no more than top-k) was written.
    fn reference_check(&self, out: &[f32], name: String, bound: f64) -> Check {
        let (heads, dim) = (self.heads, self.dim);
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let mut untouched = true;
        for (t, &pos) in self.positions.iter().enumerate() {
            let n = (pos + 1) / IDX_RATIO;
            let o = &out[t * IDX_MAX_ROWS..(t + 1) * IDX_MAX_ROWS];
            if n <= IDX_TOP_K {
                untouched &= o.iter().all(|v| v.is_nan());
                continue;
            }
            untouched &= o[n..].iter().all(|v| v.is_nan());
            got.extend_from_slice(&o[..n]);
            let qt = &self.q[t * heads * dim..(t + 1) * heads * dim];
            let wtt = &self.wt[t * heads..(t + 1) * heads];
            want.extend(indexer_reference(self.rows, qt, wtt, dim, n, self.wscale()));
        }
        Check {
            name,
            rel_err: if untouched {
                rel_err(&got, &want)
            } else {
                f64::INFINITY
            },
            bound,
        }
    }
}

/// The indexer's scores at the Flash shape (64 heads of 128) and a ragged one (48 heads
/// of 96: rows past the heads, k-quads past the dimension), for a decode token and a
/// batch of three (one with no more rows than top-k: left untouched), against the f64
/// reference, and the conflict-free staging (`idx_banks`) against the plain one, on
/// the FMA kernels.
pub(super) fn check_indexer_scores(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x1d, 0);
    let mut checks = Vec::new();
    for (heads, dim) in [(64usize, 128usize), (48, 96)] {
        let rows = normal(&mut rng, IDX_MAX_ROWS * dim, 1.0);
        let d_rows = gpu.upload(&rows)?;
        for positions in [&[2100usize][..], &[2100, 2047, 4099]] {
            let n_tok = positions.len();
            let q = normal(&mut rng, n_tok * heads * dim, 1.0);
            let wt = normal(&mut rng, n_tok * heads, 1.0);
            let batch = IndexerBatch {
                positions,
                rows: &rows,
                q: &q,
                wt: &wt,
                heads,
                dim,
            };
            // Unrounded operands: the FMA kernels (a batch at the Flash shape would go
            // to tensor cores, exact only for the FP4 values the model feeds it:
            // check_indexer_mma).
            let (a, b) = batch.run_both(
                &gpu.with(Variant::IdxMma, false),
                gpu.ptr(&d_rows),
                Variant::IdxBanks,
            )?;
            let shape = format!("{heads}x{dim}, {n_tok} token(s)");
            // Live rows against the reference; a token with n ≤ top-k stays untouched.
            checks.push(batch.reference_check(
                &a,
                format!("indexer_scores {shape} (rows past the live count untouched)"),
                1e-5,
            ));
            let name = format!("indexer_scores_sp = indexer_scores {shape}");
            checks.push(bit_same(name, &a, &b));
        }
    }
    Ok(checks)
}

/// `matvec_q8_0_q8_r4` (`q8_rows`) and `_r2` (`q8_rows2`) against
/// `matvec_q8_0_q8_early` at one warp a row:
/// the q_b shape, a ragged row count (a warp's last rows past the end), rows shorter
/// than a warp step (16 blocks) and rows of two steps.
pub(super) fn check_q8_rows(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x48, 0);
    let mut checks = Vec::new();
    for (rows, cols) in [
        (32768usize, 1024usize),
        (4100, 1024),
        (4096, 512),
        (4104, 2048),
    ] {
        let w = random_matrix(GgmlType::Q8_0, rows, cols, 1, &mut rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, 1)?;
        let x = gpu.upload(&random_vec(cols, &mut rng))?;
        let mut qa = gpu.alloc_quant_act(1, cols)?;
        gpu.quantize_act(gpu.ptr(&x), &mut qa)?;
        let run = |kernel: &'static str| -> Result<Vec<f32>> {
            let y = gpu.upload(&vec![f32::NAN; rows])?;
            gpu.matvec_q8act_kernel(&m, &qa, gpu.ptr(&y), (1, MatSel::default()), kernel)?;
            Ok(gpu.download(&y)?)
        };
        let early = run("matvec_q8_0_q8_early")?;
        let same = same_bits(&run("matvec_q8_0_q8_r4")?, &early)
            .merge(same_bits(&run("matvec_q8_0_q8_r2")?, &early));
        checks.push(bit_identical(
            format!("matvec_q8_0_q8_r4, _r2 = matvec_q8_0_q8_early {rows}x{cols}"),
            same,
        ));
    }
    // The grouped output projection's shape (`outa_early`): 8 selections of a stack by
    // constant ids, each with its own input.
    let (groups, rows, cols) = (8usize, 1024usize, 4096usize);
    let w = random_matrix(GgmlType::Q8_0, rows, cols, groups, &mut rng);
    let m = DeviceMatrix::upload(gpu, GgmlType::Q8_0, &w, rows, cols, groups)?;
    let x = gpu.upload(&random_vec(groups * cols, &mut rng))?;
    let mut qa = gpu.alloc_quant_act(groups, cols)?;
    gpu.quantize_act(gpu.ptr(&x), &mut qa)?;
    let ids = gpu.upload(&(0..groups as i32).collect::<Vec<_>>())?;
    let sel = MatSel {
        ids: gpu.ptr(&ids),
        x_stride: cols as i64,
        y_stride: rows as i64,
    };
    let run = |kernel: &'static str| -> Result<Vec<f32>> {
        let y = gpu.upload(&vec![f32::NAN; groups * rows])?;
        gpu.matvec_q8act_kernel(&m, &qa, gpu.ptr(&y), (groups, sel), kernel)?;
        Ok(gpu.download(&y)?)
    };
    let plain = run("matvec_q8_0_q8")?;
    let same = same_bits(&run("matvec_q8_0_q8_early")?, &plain)
        .merge(same_bits(&run("matvec_q8_0_q8_r2")?, &plain));
    checks.push(bit_identical(
        format!("matvec_q8_0_q8_early, _r2 = matvec_q8_0_q8 {groups}x({rows}x{cols}), ids"),
        same,
    ));
    Ok(checks)
}

/// Plain products with F16 matrices of the selftest's shapes, and one with eight
/// 16-byte steps per lane at split 8 (the early loads and the loop after them).
pub(super) fn check_f16_early(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0xf16, 0);
    let mut checks = Vec::new();
    for (rows, cols) in [(37usize, 512usize), (256, 4096), (129, 2048), (16, 16384)] {
        let w = random_matrix(GgmlType::F16, rows, cols, 1, &mut rng);
        let m = DeviceMatrix::upload(gpu, GgmlType::F16, &w, rows, cols, 1)?;
        let x = gpu.upload(&random_vec(cols, &mut rng))?;
        let name = format!("matvec_f16_early = matvec_f16 {rows}x{cols}");
        checks.push(same_both(gpu, Variant::F16Early, name, |gpu| {
            let y = gpu.upload(&vec![f32::NAN; rows])?;
            gpu.matvec(&m, gpu.ptr(&x), gpu.ptr(&y), 1, MatSel::default())?;
            Ok(gpu.download(&y)?)
        })?);
    }
    Ok(checks)
}

/// Top-6 of 256 experts for 5 tokens, with tied keys (ties go to the lower index),
/// through `router_wide` (`router4`, against `router`, with `router_split` held off:
/// it takes precedence) and `router_split` (against `router_wide`, also at 260 experts
/// — a partial last tile — and 250, its scalar fallback).
pub(super) fn check_router_wide(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x7e, 0);
    let mut checks = Vec::new();
    // (fusion toggled, fusions held off, experts, with a bias, with the hash table)
    let cases: [(Variant, &[Variant], usize, bool, bool); 6] = [
        (Variant::Router4, &[Variant::RouterSplit], 256, false, false),
        (Variant::RouterSplit, &[], 256, false, false),
        (Variant::RouterSplit, &[], 260, false, false),
        (Variant::RouterSplit, &[], 250, false, false),
        (Variant::RouterSplit, &[], 256, true, false),
        (Variant::RouterSplit, &[], 256, false, true),
    ];
    for (fusion, held_off, n_expert, with_bias, hashed) in cases {
        let (n_tok, k) = (5usize, 6usize);
        let mut logits = normal(&mut rng, n_tok * n_expert, 2.0);
        for t in 0..n_tok {
            // a few exact ties among the likely picks, inside a warp's tile and across
            let row = &mut logits[t * n_expert..(t + 1) * n_expert];
            let top = row.iter().cloned().fold(f32::MIN, f32::max);
            row[7] = top;
            row[200] = top;
            row[31] = row[30];
            row[n_expert - 1] = row[33];
        }
        // A bias breaks the ties between keys: zero unless the case asks for one.
        let bias: Vec<f32> = if with_bias {
            normal(&mut rng, n_expert, 0.1)
        } else {
            vec![0f32; n_expert]
        };
        let bias = gpu.upload(&bias)?;
        // Tokens 3t + 1; the hash table maps each of 16 tokens to k distinct experts.
        let steps: Vec<i32> = (0..n_tok as i32).flat_map(|p| [p, 3 * p + 1]).collect();
        let table: Vec<i32> = (0..16 * k as i32)
            .map(|i| (i * 37 + 11) % n_expert as i32)
            .collect();
        let table = gpu.upload(&table)?;
        let (steps, logits) = (gpu.upload(&steps)?, gpu.upload(&logits)?);
        let run = |gpu: &Launcher| {
            both(gpu, fusion, |gpu| {
                let ids = gpu.zeros::<i32>(n_tok * k)?;
                let w = gpu.upload(&vec![f32::NAN; n_tok * k])?;
                gpu.router(
                    n_tok,
                    gpu.ptr(&steps),
                    gpu.ptr(&logits),
                    n_expert,
                    k,
                    gpu.ptr(&bias),
                    if hashed { gpu.ptr(&table) } else { 0 },
                    1.5,
                    gpu.ptr(&ids),
                    gpu.ptr(&w),
                )?;
                let mut all: Vec<f32> = gpu.download(&ids)?.iter().map(|&i| i as f32).collect();
                all.extend(gpu.download(&w)?);
                Ok(all)
            })
        };
        let held = held_off.iter().fold(*gpu, |g, &x| g.with(x, false));
        let (a, b) = run(&held)?;
        let (variant, plain) = match fusion {
            Variant::Router4 => ("router_wide", "router"),
            _ => ("router_split", "router_wide"),
        };
        let extra = match (with_bias, hashed) {
            (true, _) => ", bias",
            (_, true) => ", hashed",
            _ => ", ties",
        };
        let name = format!("{variant} = {plain} {n_expert} experts, top {k}{extra}");
        checks.push(bit_same(name, &a, &b));
    }
    Ok(checks)
}

pub(super) fn check_hc_preload(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x4c, 0);
    let mut checks = Vec::new();
    let h = gpu.upload(&normal(&mut rng, N_HC * N_EMBD, 1.0))?;

    // hc_mix: 24 outputs over the 16,384 values of H, F16 and F32 weights.
    let n = N_HC * N_EMBD;
    let f32w = normal(&mut rng, 24 * n, 0.02);
    let f16w: Vec<u16> = f32w
        .iter()
        .map(|&v| ds4_gguf::quant::f32_to_f16(v))
        .collect();
    let (w32, w16) = (gpu.upload(&f32w)?, gpu.upload(&f16w)?);
    for (ty, w, name) in [
        (WT_F32, gpu.ptr(&w32), "F32"),
        (WT_F16, gpu.ptr(&w16), "F16"),
    ] {
        let name = format!("hc_mix_pl = hc_mix {name} 24x{n}");
        checks.push(same_both(gpu, Variant::HcPreload, name, |gpu| {
            let mix = gpu.upload(&[f32::NAN; 24])?;
            gpu.hc_mix(1, gpu.ptr(&h), n, w, ty, 1e-6, gpu.ptr(&mix), 24)?;
            Ok(gpu.download(&mix)?)
        })?);
    }

    // hc_pre with the sublayer norm and its Q8_0 form.
    let mix = gpu.upload(&normal(&mut rng, (2 + N_HC) * N_HC, 1.0))?;
    let scale = gpu.upload(&normal(&mut rng, 3, 0.5))?;
    let base = gpu.upload(&normal(&mut rng, (2 + N_HC) * N_HC, 0.5))?;
    let norm_w = gpu.upload(&normal(&mut rng, N_EMBD, 1.0))?;
    let name = format!("hc_pre_pl = hc_pre {N_HC}x{N_EMBD} (y, norm, Q8_0)");
    checks.push(same_both(gpu, Variant::HcPreload, name, |gpu| {
        let y = gpu.upload(&vec![f32::NAN; N_EMBD])?;
        let out = gpu.upload(&vec![f32::NAN; N_EMBD])?;
        let q = gpu.zeros::<i8>(N_EMBD)?;
        let d = gpu.upload(&vec![f32::NAN; N_EMBD / 32])?;
        let norm = HcNorm {
            w: gpu.ptr(&norm_w),
            w_type: WT_F32,
            eps: 1e-6,
            out: gpu.ptr(&out),
            q: gpu.ptr(&q),
            d: gpu.ptr(&d),
        };
        let hp = HcParams {
            scale: gpu.ptr(&scale),
            base: gpu.ptr(&base),
            n_hc: N_HC,
            n_embd: N_EMBD,
            eps: 1e-6,
            iters: 0,
        };
        gpu.hc_pre(
            1,
            (gpu.ptr(&h), gpu.ptr(&mix)),
            &hp,
            gpu.ptr(&y),
            Some(norm),
        )?;
        let q: Vec<f32> = gpu.download(&q)?.iter().map(|&v| v as f32).collect();
        let mut all = gpu.download(&y)?;
        all.extend(gpu.download(&out)?);
        all.extend(q);
        all.extend(gpu.download(&d)?);
        Ok(all)
    })?);

    // hc_post without parts (attention) and with the 6 + 1 expert rows (FFN).
    let out = gpu.upload(&normal(&mut rng, N_EMBD, 1.0))?;
    let parts = gpu.upload(&normal(&mut rng, 7 * N_EMBD, 1.0))?;
    let hcp = gpu.upload(&normal(&mut rng, N_HC + N_HC * N_HC, 0.5))?;
    for (parts_p, n_parts) in [(0u64, 0usize), (gpu.ptr(&parts), 7)] {
        let name = format!("hc_post_pl = hc_post {N_HC}x{N_EMBD}, {n_parts} parts");
        checks.push(same_both(gpu, Variant::HcPreload, name, |gpu| {
            let h_out = gpu.upload(&vec![f32::NAN; N_HC * N_EMBD])?;
            gpu.hc_post(
                1,
                gpu.ptr(&h),
                gpu.ptr(&out),
                parts_p,
                n_parts,
                gpu.ptr(&hcp),
                N_HC,
                N_EMBD,
                gpu.ptr(&h_out),
            )?;
            Ok(gpu.download(&h_out)?)
        })?);
    }
    Ok(checks)
}

/// `hc_gram` (an HC boundary as hc_post_gram + hc_start_gram) against the kernels it
/// replaces (hc_post_pl, hc_mix_pl, hc_pre_pl) at the Flash shape, one token and a
/// two-row step, with and without the FFN's 7 parts, F16 and F32 mix weights: the
/// streams H' bit for bit, the mix, the normed input and its Q8_0 form (dequantised)
/// within the fast tier's matvec bound (the Gram form sums in another order).
pub(super) fn check_hc_gram(gpu: &Launcher, seed: u64) -> Result<Vec<Check>> {
    let mut rng = Rng::stream(seed, 0x4d, 0);
    let mut checks = Vec::new();
    let n_mix = (2 + N_HC) * N_HC;
    let n = N_HC * N_EMBD;
    let f32w = normal(&mut rng, n_mix * n, 0.02);
    let f16w: Vec<u16> = f32w
        .iter()
        .map(|&v| ds4_gguf::quant::f32_to_f16(v))
        .collect();
    let b32: Vec<u8> = f32w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let b16: Vec<u8> = f16w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let w32 = DeviceMatrix::upload(gpu, GgmlType::F32, &b32, n_mix, n, 1)?;
    let w16 = DeviceMatrix::upload(gpu, GgmlType::F16, &b16, n_mix, n, 1)?;
    let scale = gpu.upload(&normal(&mut rng, 3, 0.5))?;
    let base = gpu.upload(&normal(&mut rng, n_mix, 0.5))?;
    let norm_w = gpu.upload(&normal(&mut rng, N_EMBD, 1.0))?;
    let hp = HcParams {
        scale: gpu.ptr(&scale),
        base: gpu.ptr(&base),
        n_hc: N_HC,
        n_embd: N_EMBD,
        eps: 1e-6,
        iters: 0,
    };
    for n_tok in [1usize, 2] {
        let h = gpu.upload(&normal(&mut rng, n_tok * n, 1.0))?;
        let out = gpu.upload(&normal(&mut rng, n_tok * N_EMBD, 1.0))?;
        let parts = gpu.upload(&normal(&mut rng, n_tok * 7 * N_EMBD, 0.3))?;
        let hcp = gpu.upload(&normal(&mut rng, n_tok * (N_HC + N_HC * N_HC), 0.5))?;
        for (fn_, ty) in [(&w16, "F16"), (&w32, "F32")] {
            for (parts_p, n_parts) in [(0u64, 0usize), (gpu.ptr(&parts), 7)] {
                // [H', mix, norm, dequantised Q8_0] of both forms.
                // 0: hc_post, hc_mix, hc_pre; 1: hc_post_gram, hc_start_gram; 2: hc_post,
                // hc_gram_shares, hc_start_gram (a start that no hc_post_gram prepared).
                let run = |form: u8| -> Result<[Vec<f32>; 4]> {
                    let g = gpu.with(Variant::HcPreload, true);
                    let h_out = g.upload(&vec![f32::NAN; n_tok * n])?;
                    let mix = g.upload(&vec![f32::NAN; n_tok * n_mix])?;
                    let y = g.upload(&vec![f32::NAN; n_tok * N_EMBD])?;
                    let nout = g.upload(&vec![f32::NAN; n_tok * N_EMBD])?;
                    let q = g.zeros::<i8>(n_tok * N_EMBD)?;
                    let d = g.upload(&vec![f32::NAN; n_tok * N_EMBD / 32])?;
                    let shares = g.upload(&vec![f32::NAN; crate::hc_gram_floats(n_tok, N_EMBD)])?;
                    let norm = HcNorm {
                        w: g.ptr(&norm_w),
                        w_type: WT_F32,
                        eps: 1e-6,
                        out: g.ptr(&nout),
                        q: g.ptr(&q),
                        d: g.ptr(&d),
                    };
                    let (hp_, op, ho) = (g.ptr(&h), g.ptr(&out), g.ptr(&h_out));
                    let sh = g.ptr(&shares);
                    if form == 1 {
                        g.hc_post_gram(
                            n_tok,
                            (hp_, op),
                            (parts_p, n_parts),
                            g.ptr(&hcp),
                            N_EMBD,
                            ho,
                            fn_,
                            sh,
                        )?;
                        g.hc_start_gram(n_tok, (ho, sh), &hp, 1e-6, g.ptr(&mix), norm)?;
                    } else {
                        g.hc_post(
                            n_tok,
                            hp_,
                            op,
                            parts_p,
                            n_parts,
                            g.ptr(&hcp),
                            N_HC,
                            N_EMBD,
                            ho,
                        )?;
                        if form == 0 {
                            g.hc_mix_mat(n_tok, ho, fn_, 1e-6, g.ptr(&mix))?;
                            g.hc_pre(n_tok, (ho, g.ptr(&mix)), &hp, g.ptr(&y), Some(norm))?;
                        } else {
                            g.hc_gram_shares(n_tok, ho, N_EMBD, fn_, sh)?;
                            g.hc_start_gram(n_tok, (ho, sh), &hp, 1e-6, g.ptr(&mix), norm)?;
                        }
                    }
                    Ok([
                        g.download(&h_out)?,
                        g.download(&mix)?,
                        g.download(&nout)?,
                        dequant_q8(&g.download(&q)?, &g.download(&d)?),
                    ])
                };
                let (plain, gram, start) = (run(0)?, run(1)?, run(2)?);
                let name = format!("hc_gram {ty} n{n_tok}, {n_parts} parts");
                checks.push(bit_same(
                    format!("{name}: H' = hc_post_pl"),
                    &plain[0],
                    &gram[0],
                ));
                for (i, what) in [(1, "mix"), (2, "norm"), (3, "Q8_0")] {
                    let want: Vec<f64> = plain[i].iter().map(|&v| v as f64).collect();
                    checks.push(Check {
                        name: format!("{name}: {what} ~ hc_mix + hc_pre"),
                        rel_err: rel_err(&gram[i], &want),
                        // Q8_0: a value near a rounding boundary may step by one.
                        bound: if i == 3 { 2e-3 } else { BOUND_MATVEC },
                    });
                }
                let all = |r: &[Vec<f32>; 4]| r[1..].concat();
                checks.push(bit_same(
                    format!("{name}: hc_gram_shares start = hc_post_gram's"),
                    &all(&gram),
                    &all(&start),
                ));
            }
        }
    }
    Ok(checks)
}
