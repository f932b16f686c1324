//! aarch64 NEON kernels, bit-identical to the scalar ones.
//!
//! NEON multiplies i8×i8 into i16 exactly (`vmull_s8`), so unlike x86 no bias tricks
//! are needed: integer block sums are exact, and the per-block float formulas are the
//! scalar ones. Dense dots keep 16 lanes in four 4-wide fused accumulators.
//!
//! NEON is mandatory on aarch64 Linux/macOS targets, but the dispatcher still checks
//! `is_aarch64_feature_detected!("neon")` before handing these out.

use core::arch::aarch64::*;

use super::blocks::{BlockQ8K, BlockQ8_0, IQ2_XXS_BLOCK_BYTES, Q2_K_BLOCK_BYTES};
use super::blocks::{Q4_K_BLOCK_BYTES, Q8_0_BLOCK_BYTES};
use super::dequant::{q4k_scale_min, KSIGN_MASK};
use super::dot::{dense_finish, k_quant_row, multi_by_rows, DotKernels, SimdLevel};
use super::iq2xxs_grid::IQ2XXS_GRID;
use super::{f16_to_f32, le_u16, le_u32};

/// Σ a·b over 16 i8 pairs, exact.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dot16(a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    let hi = vmull_high_s8(a, b);
    vpadalq_s16(vpaddlq_s16(lo), hi)
}

#[target_feature(enable = "neon")]
unsafe fn dot_q8_0(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, xb) in w.chunks_exact(Q8_0_BLOCK_BYTES).zip(x) {
        let wq = wb.as_ptr().add(2) as *const i8;
        let xq = xb.qs.as_ptr();
        let s = vaddq_s32(
            dot16(vld1q_s8(wq), vld1q_s8(xq)),
            dot16(vld1q_s8(wq.add(16)), vld1q_s8(xq.add(16))),
        );
        let isum = vaddvq_s32(s);
        acc += (f16_to_f32(le_u16(wb, 0)) * xb.d) * isum as f32;
    }
    acc
}

#[target_feature(enable = "neon")]
unsafe fn q2_k_sums(wb: &[u8], xb: &BlockQ8K) -> (i32, i32) {
    let scales = &wb[0..16];
    let mut summs = 0i32;
    for j in 0..16 {
        summs += xb.bsums[j] as i32 * (scales[j] >> 4) as i32;
    }
    let m3 = vdupq_n_u8(3);
    let mut isum = 0i32;
    for k in 0..2 {
        for half in 0..2 {
            let q = vld1q_u8(wb.as_ptr().add(16 + 32 * k + 16 * half));
            for j in 0..4 {
                let q2 = vandq_u8(vshlq_u8(q, vdupq_n_s8(-2 * j as i8)), m3);
                let xq = vld1q_s8(xb.qs.as_ptr().add(128 * k + 32 * j + 16 * half));
                let s = vaddvq_s32(dot16(vreinterpretq_s8_u8(q2), xq));
                isum += (scales[8 * k + 2 * j + half] & 0xF) as i32 * s;
            }
        }
    }
    (isum, summs)
}

#[target_feature(enable = "neon")]
unsafe fn dot_q2_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    k_quant_row(w, x, Q2_K_BLOCK_BYTES, 80, |wb, xb| q2_k_sums(wb, xb))
}

#[target_feature(enable = "neon")]
unsafe fn q4_k_sums(wb: &[u8], xb: &BlockQ8K) -> (i32, i32) {
    let m4 = vdupq_n_u8(0xF);
    let mut isum = 0i32;
    let mut summs = 0i32;
    for c in 0..4 {
        let (sc1, m1) = q4k_scale_min(2 * c, &wb[4..16]);
        let (sc2, m2) = q4k_scale_min(2 * c + 1, &wb[4..16]);
        let mut s1 = vdupq_n_s32(0);
        let mut s2 = vdupq_n_s32(0);
        for h in 0..2 {
            let q = vld1q_u8(wb.as_ptr().add(16 + 32 * c + 16 * h));
            let lo = vreinterpretq_s8_u8(vandq_u8(q, m4));
            let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q));
            let x0 = vld1q_s8(xb.qs.as_ptr().add(64 * c + 16 * h));
            let x1 = vld1q_s8(xb.qs.as_ptr().add(64 * c + 32 + 16 * h));
            s1 = vaddq_s32(s1, dot16(lo, x0));
            s2 = vaddq_s32(s2, dot16(hi, x1));
        }
        isum += sc1 as i32 * vaddvq_s32(s1) + sc2 as i32 * vaddvq_s32(s2);
        summs += m1 as i32 * (xb.bsums[4 * c] as i32 + xb.bsums[4 * c + 1] as i32)
            + m2 as i32 * (xb.bsums[4 * c + 2] as i32 + xb.bsums[4 * c + 3] as i32);
    }
    (isum, summs)
}

#[target_feature(enable = "neon")]
unsafe fn dot_q4_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    k_quant_row(w, x, Q4_K_BLOCK_BYTES, 0, |wb, xb| q4_k_sums(wb, xb))
}

/// Signed grid values of the 8 groups (2 × 16 bytes each) and the `2·ls+1` factors.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn iq2_xxs_unpack(wb: &[u8]) -> ([int8x16_t; 16], [i32; 8]) {
    let mut sg = [vdupq_n_s8(0); 16];
    let mut ls = [0i32; 8];
    for g in 0..8 {
        let o = 2 + 8 * g;
        let a1 = le_u32(wb, o + 4);
        for h in 0..2 {
            let g0 = IQ2XXS_GRID[wb[o + 2 * h] as usize];
            let g1 = IQ2XXS_GRID[wb[o + 2 * h + 1] as usize];
            let m0 = KSIGN_MASK[((a1 >> (14 * h)) & 127) as usize];
            let m1 = KSIGN_MASK[((a1 >> (14 * h + 7)) & 127) as usize];
            let grid = vcombine_u64(vcreate_u64(g0), vcreate_u64(g1));
            let m = vcombine_u64(vcreate_u64(m0), vcreate_u64(m1));
            let grid = vreinterpretq_s8_u64(grid);
            let m = vreinterpretq_s8_u64(m);
            sg[2 * g + h] = vsubq_s8(veorq_s8(grid, m), m);
        }
        ls[g] = 2 * (a1 >> 28) as i32 + 1;
    }
    (sg, ls)
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn iq2_xxs_sum(sg: &[int8x16_t; 16], ls: &[i32; 8], xb: &BlockQ8K) -> i32 {
    let mut bsum = 0i32;
    for g in 0..8 {
        let xq = xb.qs.as_ptr().add(32 * g);
        let s = vaddq_s32(
            dot16(sg[2 * g], vld1q_s8(xq)),
            dot16(sg[2 * g + 1], vld1q_s8(xq.add(16))),
        );
        bsum += vaddvq_s32(s) * ls[g];
    }
    bsum
}

#[target_feature(enable = "neon")]
unsafe fn dot_iq2_xxs(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, xb) in w.chunks_exact(IQ2_XXS_BLOCK_BYTES).zip(x) {
        let (sg, ls) = iq2_xxs_unpack(wb);
        acc += (f16_to_f32(le_u16(wb, 0)) * xb.d) * iq2_xxs_sum(&sg, &ls, xb) as f32;
    }
    0.125 * acc
}

#[target_feature(enable = "neon")]
unsafe fn dot_iq2_xxs_multi(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    out.fill(0.0);
    for (b, wb) in w.chunks_exact(IQ2_XXS_BLOCK_BYTES).enumerate() {
        let (sg, ls) = iq2_xxs_unpack(wb);
        let d = f16_to_f32(le_u16(wb, 0));
        for (x, acc) in xs.iter().zip(out.iter_mut()) {
            *acc += (d * x[b].d) * iq2_xxs_sum(&sg, &ls, &x[b]) as f32;
        }
    }
    for o in out.iter_mut() {
        *o *= 0.125;
    }
}

/// Dense dot: 16 lanes as four fused 4-wide accumulators; `load(i, buf)` yields the
/// 16 weights at element i.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn dense(n: usize, x: &[f32], load: impl Fn(usize, &mut [f32; 16])) -> [f32; 16] {
    let mut a = [vdupq_n_f32(0.0); 4];
    let mut wbuf = [0.0f32; 16];
    let mut i = 0;
    while i + 16 <= n {
        load(i, &mut wbuf);
        for (k, ak) in a.iter_mut().enumerate() {
            let wv = vld1q_f32(wbuf.as_ptr().add(4 * k));
            let xv = vld1q_f32(x.as_ptr().add(i + 4 * k));
            *ak = vfmaq_f32(*ak, wv, xv);
        }
        i += 16;
    }
    let mut lanes = [0.0f32; 16];
    for (k, ak) in a.iter().enumerate() {
        vst1q_f32(lanes.as_mut_ptr().add(4 * k), *ak);
    }
    lanes
}

#[target_feature(enable = "neon")]
unsafe fn dot_f16_f32(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    let lanes = dense(n, x, |i, buf| {
        for (k, v) in buf.iter_mut().enumerate() {
            *v = f16_to_f32(le_u16(w, 2 * (i + k)));
        }
    });
    dense_finish(lanes, n, |i| (f16_to_f32(le_u16(w, 2 * i)), x[i]))
}

#[target_feature(enable = "neon")]
unsafe fn dot_f32_f32(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 4).min(x.len());
    let wf = |i: usize| f32::from_bits(le_u32(w, 4 * i));
    let lanes = dense(n, x, |i, buf| {
        for (k, v) in buf.iter_mut().enumerate() {
            *v = wf(i + k);
        }
    });
    dense_finish(lanes, n, |i| (wf(i), x[i]))
}

#[target_feature(enable = "neon")]
unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let lanes = dense(n, b, |i, buf| buf.copy_from_slice(&a[i..i + 16]));
    dense_finish(lanes, n, |i| (a[i], b[i]))
}

// SAFETY (every wrapper below): `DotKernels::get(SimdLevel::Neon)` hands this table
// out only after `is_aarch64_feature_detected!("neon")`; the kernels bound every memory
// access by the lengths of the slices they are given.
macro_rules! wrap {
    ($f:path, $($a:ident : $t:ty),*) => {
        |$($a: $t),*| unsafe { $f($($a),*) }
    };
}

pub(crate) static NEON: DotKernels = DotKernels {
    level: SimdLevel::Neon,
    q8_0: wrap!(dot_q8_0, w: &[u8], x: &[_]),
    q2_k: wrap!(dot_q2_k, w: &[u8], x: &[_]),
    q4_k: wrap!(dot_q4_k, w: &[u8], x: &[_]),
    iq2_xxs: wrap!(dot_iq2_xxs, w: &[u8], x: &[_]),
    f16_f32: wrap!(dot_f16_f32, w: &[u8], x: &[f32]),
    f32_f32: wrap!(dot_f32_f32, w: &[u8], x: &[f32]),
    f32: wrap!(dot_f32, a: &[f32], b: &[f32]),
    q8_0_multi: |w, xs, out| multi_by_rows(w, xs, out, wrap!(dot_q8_0, w: &[u8], x: &[_])),
    q2_k_multi: |w, xs, out| multi_by_rows(w, xs, out, wrap!(dot_q2_k, w: &[u8], x: &[_])),
    q4_k_multi: |w, xs, out| multi_by_rows(w, xs, out, wrap!(dot_q4_k, w: &[u8], x: &[_])),
    iq2_xxs_multi: wrap!(dot_iq2_xxs_multi, w: &[u8], xs: &[&[_]], o: &mut [f32]),
};
