//! Reference weight quantisers (for a quantize tool and for tests): Q8_0, Q2_K and
//! Q4_K follow llama.cpp's `quantize_row_*_ref` semantics (no importance matrix);
//! IQ2_XXS is ds4's own search (sign parity fix-up, per-group scale search over the
//! grid, then the 4-bit group scales against the rounded f16 block scale). It is not
//! llama.cpp's imatrix quantiser, only a sensible one.
//!
//! These favour clarity over speed; the IQ2_XXS grid search per 8 values is pruned
//! to the points near the rounded targets (`iq2_search.rs`, ~33 of 256).
//!
//! The `*_imatrix` variants take an importance vector (llama.cpp's imatrix: the mean
//! squared activation of each input column) that multiplies each value's error in
//! every scale, min and grid search, as llama.cpp's weighted quantisers do; with all
//! weights 1 they give the unweighted result.

use super::blocks::QK_K;
use super::dequant::ksigns;
use super::iq2_search::best_grid;
use super::iq2xxs_grid::IQ2XXS_GRID;
use super::{f16_to_f32, f32_to_f16};
use crate::error::QuantError;
use crate::types::GgmlType;

/// llama.cpp's `nearest_int`: round to nearest, ties to even.
#[inline]
fn nearest_int(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// The blocks of `x` paired with their bytes in `out` (whole blocks of `ty` both; a
/// mismatch is the caller's bug).
fn blocks<'a>(
    ty: GgmlType,
    x: &'a [f32],
    out: &'a mut [u8],
) -> impl Iterator<Item = (&'a [f32], &'a mut [u8])> {
    let be = ty.block_elems();
    assert_eq!(
        x.len() % be,
        0,
        "quantize {ty}: {} values is not whole blocks",
        x.len()
    );
    assert_eq!(
        out.len(),
        x.len() / be * ty.block_bytes(),
        "quantize {ty}: output buffer size"
    );
    x.chunks_exact(be)
        .zip(out.chunks_exact_mut(ty.block_bytes()))
}

/// The importance of block `b`'s values: `qw` covers whole rows' columns (its length
/// a multiple of the block), and block `b` of the flat input sits at column
/// `(b·block) mod len`.
fn block_weights(qw: Option<&[f32]>, b: usize, be: usize) -> Option<&[f32]> {
    qw.map(|w| {
        let at = (b * be) % w.len();
        &w[at..at + be]
    })
}

/// Checks an importance vector against the input (whole blocks, dividing the input).
fn check_importance(ty: GgmlType, x: &[f32], qw: &[f32]) {
    let be = ty.block_elems();
    assert!(
        !qw.is_empty() && qw.len() % be == 0 && x.len() % qw.len() == 0,
        "quantize {ty}: importance of {} values for rows of {} values",
        qw.len(),
        x.len()
    );
}

/// Q8_0 weights (llama.cpp `quantize_row_q8_0_ref`): `d = amax/127` stored as f16,
/// `q = roundf(x/d)` (half away from zero) using the unrounded `d`.
pub fn quantize_q8_0_weights(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in blocks(GgmlType::Q8_0, x, out) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        ob[0..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
        for (q, &v) in ob[2..].iter_mut().zip(xb) {
            *q = (v * id).round() as i8 as u8;
        }
    }
}

/// Weighted fit of `x ≈ scale·L + min` with `L ∈ 0..=nmax` and `min ≤ 0` (llama.cpp
/// `make_qkx2_quants`): a first guess from the range, then `nstep` perturbed inverse
/// scales, each followed by the closed-form least-squares scale and min. Returns
/// `(scale, -min)`; `l` receives the levels.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.iter_mut().for_each(|v| *v = 0);
        return (0.0, -min);
    }
    let err = |d: f32| if use_mad { d.abs() } else { d * d };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let li = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = li as u8;
        best_error += weights[i] * err(scale * li as f32 + min - x[i]);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let li = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = li as u8;
            let (w, lf) = (weights[i], li as f32);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let cur: f32 = (0..n)
                .map(|i| weights[i] * err(this_scale * laux[i] as f32 + this_min - x[i]))
                .sum();
            if cur < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Fits each of the `N` equal sub-blocks of one super-block `xb` with
/// `make_qkx2_quants` (`fit` = nmax, rmin, nstep, use_mad; rdelta is 0.1 for both
/// K-quants), its levels into `l`. Returns the scales, the mins and their maxima.
fn fit_sub_blocks<const N: usize>(
    xb: &[f32],
    l: &mut [u8; QK_K],
    fit: (i32, f32, i32, bool),
    weights: impl Fn(usize, &[f32]) -> Vec<f32>,
) -> ([f32; N], [f32; N], f32, f32) {
    let (nmax, rmin, nstep, use_mad) = fit;
    let len = QK_K / N;
    let mut scales = [0.0f32; N];
    let mut mins = [0.0f32; N];
    for j in 0..N {
        let xs = &xb[len * j..len * j + len];
        let w = weights(j, xs);
        (scales[j], mins[j]) = make_qkx2_quants(
            nmax,
            xs,
            &w,
            &mut l[len * j..len * j + len],
            rmin,
            0.1,
            nstep,
            use_mad,
        );
    }
    let max_scale = scales.iter().fold(0.0f32, |m, &v| m.max(v));
    let max_min = mins.iter().fold(0.0f32, |m, &v| m.max(v));
    (scales, mins, max_scale, max_min)
}

/// Q2_K weights (llama.cpp `quantize_row_q2_K_ref`): 16 sub-blocks of 16 with 4-bit
/// scale and min, fitted with absolute-error weights `|x|`.
pub fn quantize_q2_k(x: &[f32], out: &mut [u8]) {
    q2_k(x, out, None)
}

/// Q2_K with importance `qw` (per column of rows of `qw.len()` values): each value's
/// fit weight `|x|` is multiplied by its column's importance.
pub fn quantize_q2_k_imatrix(x: &[f32], out: &mut [u8], qw: &[f32]) {
    check_importance(GgmlType::Q2_K, x, qw);
    q2_k(x, out, Some(qw))
}

fn q2_k(x: &[f32], out: &mut [u8], qw: Option<&[f32]>) {
    for (b, (xb, ob)) in blocks(GgmlType::Q2_K, x, out).enumerate() {
        let wb = block_weights(qw, b, QK_K);
        let mut l = [0u8; QK_K];
        let (scales, mins, max_scale, max_min) =
            fit_sub_blocks::<16>(xb, &mut l, (3, -0.5, 15, true), |j, xs| {
                let w = wb.map(|w| &w[16 * j..16 * j + 16]);
                xs.iter()
                    .enumerate()
                    .map(|(i, v)| v.abs() * w.map_or(1.0, |w| w[i]))
                    .collect()
            });
        let mut sc = [0u8; 16];
        let mut d = 0u16;
        let mut dmin = 0u16;
        if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for j in 0..16 {
                sc[j] = nearest_int(iscale * scales[j]) as u8;
            }
            d = f32_to_f16(max_scale / 15.0);
        }
        if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for j in 0..16 {
                sc[j] |= (nearest_int(iscale * mins[j]) as u8) << 4;
            }
            dmin = f32_to_f16(max_min / 15.0);
        }
        // Re-pick the levels against the scales as stored.
        for j in 0..16 {
            let dj = f16_to_f32(d) * (sc[j] & 0xF) as f32;
            if dj == 0.0 {
                continue;
            }
            let mj = f16_to_f32(dmin) * (sc[j] >> 4) as f32;
            for i in 16 * j..16 * j + 16 {
                l[i] = nearest_int((xb[i] + mj) / dj).clamp(0, 3) as u8;
            }
        }
        ob[0..16].copy_from_slice(&sc);
        for k in 0..2 {
            for i in 0..32 {
                let b = 128 * k + i;
                ob[16 + 32 * k + i] = l[b] | (l[b + 32] << 2) | (l[b + 64] << 4) | (l[b + 96] << 6);
            }
        }
        ob[80..82].copy_from_slice(&d.to_le_bytes());
        ob[82..84].copy_from_slice(&dmin.to_le_bytes());
    }
}

/// Q4_K weights (llama.cpp `quantize_row_q4_K_ref`): 8 sub-blocks of 32 with 6-bit
/// scale and min, fitted with weights `rms + |x|`.
pub fn quantize_q4_k(x: &[f32], out: &mut [u8]) {
    q4_k(x, out, None)
}

/// Q4_K with importance `qw` (per column of rows of `qw.len()` values): each value's
/// fit weight `rms + |x|` is multiplied by its column's importance.
pub fn quantize_q4_k_imatrix(x: &[f32], out: &mut [u8], qw: &[f32]) {
    check_importance(GgmlType::Q4_K, x, qw);
    q4_k(x, out, Some(qw))
}

fn q4_k(x: &[f32], out: &mut [u8], qw: Option<&[f32]>) {
    for (b, (xb, ob)) in blocks(GgmlType::Q4_K, x, out).enumerate() {
        let wb = block_weights(qw, b, QK_K);
        let mut l = [0u8; QK_K];
        let (scales, mins, max_scale, max_min) =
            fit_sub_blocks::<8>(xb, &mut l, (15, -1.0, 20, false), |j, xs| {
                let w = wb.map(|w| &w[32 * j..32 * j + 32]);
                let av_x = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
                xs.iter()
                    .enumerate()
                    .map(|(i, v)| (av_x + v.abs()) * w.map_or(1.0, |w| w[i]))
                    .collect()
            });
        let inv_scale = if max_scale > 0.0 {
            63.0 / max_scale
        } else {
            0.0
        };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        let mut packed = [0u8; 12];
        for j in 0..8 {
            let ls = nearest_int(inv_scale * scales[j]).min(63) as u8;
            let lm = nearest_int(inv_min * mins[j]).min(63) as u8;
            if j < 4 {
                packed[j] = ls;
                packed[j + 4] = lm;
            } else {
                packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
                packed[j - 4] |= (ls >> 4) << 6;
                packed[j] |= (lm >> 4) << 6;
            }
        }
        let d = f32_to_f16(max_scale / 63.0);
        let dmin = f32_to_f16(max_min / 63.0);
        for j in 0..8 {
            let (sc, m) = super::dequant::q4k_scale_min(j, &packed);
            let dj = f16_to_f32(d) * sc as f32;
            if dj == 0.0 {
                continue;
            }
            let dm = f16_to_f32(dmin) * m as f32;
            for i in 32 * j..32 * j + 32 {
                l[i] = nearest_int((xb[i] + dm) / dj).clamp(0, 15) as u8;
            }
        }
        ob[0..2].copy_from_slice(&d.to_le_bytes());
        ob[2..4].copy_from_slice(&dmin.to_le_bytes());
        ob[4..16].copy_from_slice(&packed);
        for c in 0..4 {
            for i in 0..32 {
                ob[16 + 32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
            }
        }
    }
}

/// Grid indices and weighted squared error of one 32-value group at multiplier `m`.
fn fit_group(m: f32, t: &[[f32; 8]; 4], w: &[[f32; 8]; 4]) -> ([u8; 4], f32) {
    let mut idx = [0u8; 4];
    let mut err = 0.0;
    for s in 0..4 {
        let (i, e) = best_grid(m, &t[s], &w[s]);
        idx[s] = i;
        err += e;
    }
    (idx, err)
}

/// IQ2_XXS weights. Per 8-value sub-group the sign pattern must have even parity: when
/// the signs of `x` do not, the smallest `|x|` gets the wrong sign (cheapest error).
/// Each group's multiplier is searched over a range of candidates (a grid fit
/// for each, then a least-squares refinement); the block's f16 `d` makes the largest
/// group use `ls = 15`, and every group then tries all 16 `ls` against the rounded `d`.
pub fn quantize_iq2_xxs(x: &[f32], out: &mut [u8]) {
    iq2_xxs(x, out, None)
}

/// IQ2_XXS with importance `qw` (per column of rows of `qw.len()` values): every
/// squared error of the searches (the parity flip, the grid points, the multipliers,
/// the group scales) is weighted by the value's column importance.
pub fn quantize_iq2_xxs_imatrix(x: &[f32], out: &mut [u8], qw: &[f32]) {
    check_importance(GgmlType::IQ2_XXS, x, qw);
    iq2_xxs(x, out, Some(qw))
}

fn iq2_xxs(x: &[f32], out: &mut [u8], qw: Option<&[f32]>) {
    for (b, (xb, ob)) in blocks(GgmlType::IQ2_XXS, x, out).enumerate() {
        let wb = block_weights(qw, b, QK_K);
        ob.fill(0);
        // Targets t = x·sign (≥ 0 except a parity-flipped value) and sign indices.
        let mut t = [[[0.0f32; 8]; 4]; 8];
        let mut w = [[[1.0f32; 8]; 4]; 8];
        let mut sign_idx = [[0u32; 4]; 8];
        for g in 0..8 {
            for s in 0..4 {
                let at = 32 * g + 8 * s;
                let v = &xb[at..at + 8];
                if let Some(wb) = wb {
                    w[g][s].copy_from_slice(&wb[at..at + 8]);
                }
                let ws = w[g][s];
                let mut bits = 0u8;
                for (j, &xv) in v.iter().enumerate() {
                    if xv < 0.0 {
                        bits |= 1 << j;
                    }
                }
                if bits.count_ones() % 2 == 1 {
                    // The cheapest flip: least weighted |x| (ties: the first).
                    let jmin = (0..8)
                        .min_by(|&a, &b| (ws[a] * v[a].abs()).total_cmp(&(ws[b] * v[b].abs())))
                        .unwrap_or(0);
                    bits ^= 1 << jmin;
                }
                debug_assert_eq!(ksigns((bits & 127) as usize), bits);
                sign_idx[g][s] = (bits & 127) as u32;
                for j in 0..8 {
                    t[g][s][j] = if bits & (1 << j) != 0 { -v[j] } else { v[j] };
                }
            }
        }
        // Per-group multiplier search.
        let mut mult = [0.0f32; 8];
        for g in 0..8 {
            let tmax = t[g].iter().flatten().fold(0.0f32, |m, &v| m.max(v));
            if tmax <= 0.0 {
                continue;
            }
            let mut best = (f32::INFINITY, 0.0f32);
            // The largest target may sit on any grid magnitude (8, 25 or 43): for flat
            // groups the all-8 point is best, so candidates span tmax/50 .. tmax/8.
            for step in 0..16 {
                let m0 = tmax / (8.0 * 1.13f32.powi(step));
                let (idx, _) = fit_group(m0, &t[g], &w[g]);
                // Weighted least-squares multiplier for these grid points, refitted once.
                let (mut num, mut den) = (0.0f32, 0.0f32);
                for s in 0..4 {
                    let gb = IQ2XXS_GRID[idx[s] as usize].to_le_bytes();
                    for j in 0..8 {
                        num += w[g][s][j] * gb[j] as f32 * t[g][s][j];
                        den += w[g][s][j] * (gb[j] as f32) * (gb[j] as f32);
                    }
                }
                let m1 = if den > 0.0 && num > 0.0 {
                    num / den
                } else {
                    m0
                };
                let (_, e) = fit_group(m1, &t[g], &w[g]);
                if e < best.0 {
                    best = (e, m1);
                }
            }
            mult[g] = best.1;
        }
        let max_mult = mult.iter().fold(0.0f32, |m, &v| m.max(v));
        // value = d·(0.5+ls)·0.25·grid: the largest group takes ls = 15.
        let d = f32_to_f16(max_mult / (15.5 * 0.25));
        let df = f16_to_f32(d);
        if df == 0.0 || !df.is_finite() {
            continue; // all-zero block (d = 0 encodes zeros)
        }
        ob[0..2].copy_from_slice(&d.to_le_bytes());
        for g in 0..8 {
            let mut best = (f32::INFINITY, 0u32, [0u8; 4]);
            for ls in 0..16u32 {
                let m = df * (0.5 + ls as f32) * 0.25;
                let (idx, e) = fit_group(m, &t[g], &w[g]);
                if e < best.0 {
                    best = (e, ls, idx);
                }
            }
            let (_, ls, idx) = best;
            let a1 = sign_idx[g][0]
                | (sign_idx[g][1] << 7)
                | (sign_idx[g][2] << 14)
                | (sign_idx[g][3] << 21)
                | (ls << 28);
            let o = 2 + 8 * g;
            ob[o..o + 4].copy_from_slice(&idx);
            ob[o + 4..o + 8].copy_from_slice(&a1.to_le_bytes());
        }
    }
}

/// Quantises whole rows of `x` to routed-expert type `ty` (Q2_K, Q4_K, IQ2_XXS; other
/// types ignore the importance) with per-column importance `qw` (one row's length).
pub fn quantize_weights_imatrix(
    ty: GgmlType,
    x: &[f32],
    qw: &[f32],
) -> Result<Vec<u8>, QuantError> {
    let be = ty.block_elems();
    if x.len() % be != 0 {
        return Err(QuantError::PartialBlock {
            ty,
            elems: x.len(),
            block: be,
        });
    }
    let mut out = vec![0u8; x.len() / be * ty.block_bytes()];
    match ty {
        GgmlType::Q2_K => quantize_q2_k_imatrix(x, &mut out, qw),
        GgmlType::Q4_K => quantize_q4_k_imatrix(x, &mut out, qw),
        GgmlType::IQ2_XXS => quantize_iq2_xxs_imatrix(x, &mut out, qw),
        _ => return quantize_weights(ty, x),
    }
    Ok(out)
}

/// Quantises `x` (whole blocks) to weight type `ty`: Q8_0, Q2_K, Q4_K, IQ2_XXS, plus
/// the trivial F32/F16/BF16.
pub fn quantize_weights(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, QuantError> {
    let be = ty.block_elems();
    if x.len() % be != 0 {
        return Err(QuantError::PartialBlock {
            ty,
            elems: x.len(),
            block: be,
        });
    }
    let mut out = vec![0u8; x.len() / be * ty.block_bytes()];
    match ty {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f32_to_f16(*v).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&super::f32_to_bf16(*v).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => quantize_q8_0_weights(x, &mut out),
        GgmlType::Q2_K => quantize_q2_k(x, &mut out),
        GgmlType::Q4_K => quantize_q4_k(x, &mut out),
        GgmlType::IQ2_XXS => quantize_iq2_xxs(x, &mut out),
        other => return Err(QuantError::Unsupported(other)),
    }
    Ok(out)
}
