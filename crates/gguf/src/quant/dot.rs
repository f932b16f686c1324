//! Dot products of one weight row with one activation row.
//!
//! Canonical evaluation orders (every SIMD path reproduces them bit for bit):
//! * quantised × Q8: the integer sum of each block is exact; blocks are combined in
//!   order with the float formula of each function;
//! * F16/F32 × f32: 16 interleaved lanes (`lane[i % 16] = fma(w[i], x[i], lane)`), then
//!   the lanes are summed as a fixed pairwise tree. This is the order a 16-wide (or
//!   2×8-wide) FMA loop produces naturally.

use super::blocks::{BlockQ8K, BlockQ8_0, QK8_0, QK_K};
use super::dequant::{ksigns, q4k_scale_min};
use super::iq2xxs_grid::IQ2XXS_GRID;
use super::{f16_to_f32, le_u16};

/// Number of interleaved accumulators of the dense dots.
pub const DENSE_LANES: usize = 16;

/// Reduces 16 lanes in the canonical pairwise order.
#[inline]
pub fn reduce_lanes(l: &[f32; DENSE_LANES]) -> f32 {
    let mut v = *l;
    let mut w = DENSE_LANES / 2;
    while w > 0 {
        for i in 0..w {
            v[i] += v[i + w];
        }
        w /= 2;
    }
    v[0]
}

/// Q8_0 weight row · Q8_0 activations: `Σ_b (f16(d_w)·d_x)·Σ q_w·q_x`.
pub fn dot_q8_0_q8_0(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 34);
    let mut acc = 0.0f32;
    for (wb, xb) in w.chunks_exact(34).zip(x) {
        let mut isum = 0i32;
        for i in 0..QK8_0 {
            isum += (wb[2 + i] as i8 as i32) * (xb.qs[i] as i32);
        }
        acc += (f16_to_f32(le_u16(wb, 0)) * xb.d) * isum as f32;
    }
    acc
}

/// Q2_K weight row · Q8_K activations (ggml scalar `vec_dot_q2_K_q8_K` order).
pub fn dot_q2_k_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 84);
    let mut acc = 0.0f32;
    for (wb, xb) in w.chunks_exact(84).zip(x) {
        let (isum, summs) = q2_k_block_sums(wb, xb);
        let dall = xb.d * f16_to_f32(le_u16(wb, 80));
        let dmin = xb.d * f16_to_f32(le_u16(wb, 82));
        acc += dall * isum as f32 - dmin * summs as f32;
    }
    acc
}

/// (Σ scale·Σq2·q8, Σ min·bsum) of one Q2_K block.
#[inline]
pub fn q2_k_block_sums(wb: &[u8], xb: &BlockQ8K) -> (i32, i32) {
    let scales = &wb[0..16];
    let qs = &wb[16..80];
    let summs: i32 = (0..16)
        .map(|j| xb.bsums[j] as i32 * (scales[j] >> 4) as i32)
        .sum();
    let mut isum = 0i32;
    for k in 0..2 {
        for j in 0..4 {
            for half in 0..2 {
                let is = 8 * k + 2 * j + half;
                let mut s = 0i32;
                for l in 16 * half..16 * half + 16 {
                    let q2 = ((qs[32 * k + l] >> (2 * j)) & 3) as i32;
                    s += q2 * xb.qs[128 * k + 32 * j + l] as i32;
                }
                isum += (scales[is] & 0xF) as i32 * s;
            }
        }
    }
    (isum, summs)
}

/// Q4_K weight row · Q8_K activations:
/// `Σ_b (d_x·f16(d))·Σ_j sc_j·Σq4·q8 − (d_x·f16(dmin))·Σ_j m_j·(bsum_2j + bsum_2j+1)`.
pub fn dot_q4_k_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 144);
    let mut acc = 0.0f32;
    for (wb, xb) in w.chunks_exact(144).zip(x) {
        let (isum, summs) = q4_k_block_sums(wb, xb);
        let d = xb.d * f16_to_f32(le_u16(wb, 0));
        let dmin = xb.d * f16_to_f32(le_u16(wb, 2));
        acc += d * isum as f32 - dmin * summs as f32;
    }
    acc
}

/// (Σ sc·Σq4·q8, Σ m·bsums) of one Q4_K block.
#[inline]
pub fn q4_k_block_sums(wb: &[u8], xb: &BlockQ8K) -> (i32, i32) {
    let scales = &wb[4..16];
    let qs = &wb[16..144];
    let mut isum = 0i32;
    let mut summs = 0i32;
    for c in 0..4 {
        let q = &qs[32 * c..32 * c + 32];
        let (sc1, m1) = q4k_scale_min(2 * c, scales);
        let (sc2, m2) = q4k_scale_min(2 * c + 1, scales);
        let mut s1 = 0i32;
        let mut s2 = 0i32;
        for l in 0..32 {
            s1 += (q[l] & 0xF) as i32 * xb.qs[64 * c + l] as i32;
            s2 += (q[l] >> 4) as i32 * xb.qs[64 * c + 32 + l] as i32;
        }
        isum += sc1 as i32 * s1 + sc2 as i32 * s2;
        summs += m1 as i32 * (xb.bsums[4 * c] as i32 + xb.bsums[4 * c + 1] as i32)
            + m2 as i32 * (xb.bsums[4 * c + 2] as i32 + xb.bsums[4 * c + 3] as i32);
    }
    (isum, summs)
}

/// IQ2_XXS weight row · Q8_K activations: `0.125·Σ_b (f16(d)·d_x)·Σ_g (2ls+1)·Σ grid·sign·q8`.
pub fn dot_iq2_xxs_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 66);
    let mut acc = 0.0f32;
    for (wb, xb) in w.chunks_exact(66).zip(x) {
        let bsum = iq2_xxs_block_sum(wb, xb);
        acc += (f16_to_f32(le_u16(wb, 0)) * xb.d) * bsum as f32;
    }
    0.125 * acc
}

/// Σ_g (2·ls_g+1)·Σ signed grid·q8 of one IQ2_XXS block.
#[inline]
pub fn iq2_xxs_block_sum(wb: &[u8], xb: &BlockQ8K) -> i32 {
    let mut bsum = 0i32;
    for g in 0..8 {
        let w = &wb[2 + 8 * g..10 + 8 * g];
        let a1 = u32::from_le_bytes([w[4], w[5], w[6], w[7]]);
        let ls = 2 * (a1 >> 28) as i32 + 1;
        let mut sumi = 0i32;
        for l in 0..4 {
            let grid = IQ2XXS_GRID[w[l] as usize].to_le_bytes();
            let signs = ksigns(((a1 >> (7 * l)) & 127) as usize);
            for j in 0..8 {
                let v = grid[j] as i32 * xb.qs[32 * g + 8 * l + j] as i32;
                sumi += if signs & (1 << j) != 0 { -v } else { v };
            }
        }
        bsum += sumi * ls;
    }
    bsum
}

/// F16 weight row · f32 activations in the canonical 16-lane FMA order.
pub fn dot_f16_f32(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 2);
    let mut lanes = [0.0f32; DENSE_LANES];
    for (i, (wb, &xv)) in w.chunks_exact(2).zip(x).enumerate() {
        let wv = f16_to_f32(u16::from_le_bytes([wb[0], wb[1]]));
        let l = &mut lanes[i % DENSE_LANES];
        *l = wv.mul_add(xv, *l);
    }
    reduce_lanes(&lanes)
}

/// F32 weight row · f32 activations in the canonical 16-lane FMA order.
pub fn dot_f32_f32(w: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 4);
    let mut lanes = [0.0f32; DENSE_LANES];
    for (i, (wb, &xv)) in w.chunks_exact(4).zip(x).enumerate() {
        let wv = f32::from_le_bytes([wb[0], wb[1], wb[2], wb[3]]);
        let l = &mut lanes[i % DENSE_LANES];
        *l = wv.mul_add(xv, *l);
    }
    reduce_lanes(&lanes)
}

/// f32 · f32 in the canonical 16-lane FMA order (attention scores, pooled sums).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0.0f32; DENSE_LANES];
    for (i, (&av, &bv)) in a.iter().zip(b).enumerate() {
        let l = &mut lanes[i % DENSE_LANES];
        *l = av.mul_add(bv, *l);
    }
    reduce_lanes(&lanes)
}

/// The blocks a Q8_K activation row needs for `n` inputs.
pub const fn q8_k_blocks(n: usize) -> usize {
    n / QK_K
}
