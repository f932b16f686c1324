//! x86_64 AVX2 (+FMA, F16C) and AVX-512 kernels, bit-identical to the scalar ones.
//!
//! How exactness is kept:
//! * integer block sums use only exact operations: `maddubs` with one operand ≤ 43 in
//!   magnitude (no i16 saturation), `madd`, i32 adds. Products of two arbitrary i8
//!   (Q8_0) are widened to i16 first, because the usual `sign_epi8` trick gets
//!   `-(-128)` wrong. IQ2_XXS signs go onto the grid values, never onto the activations,
//!   for the same reason;
//! * per-block float formulas are evaluated lane-wise with the same operations in the
//!   same order as the scalar code, then blocks are added to the accumulator one by one;
//! * dense dots keep 16 lanes (two 8-wide or one 16-wide FMA accumulator) and reduce
//!   them in the canonical pairwise order.
//!
//! Every `unsafe fn` here requires the CPU features of its `target_feature` attribute;
//! the dispatcher in `dot.rs` only hands them out after runtime detection. Pointer
//! arguments must be valid for the documented number of bytes.

use core::arch::x86_64::*;

use super::blocks::{BlockQ8K, BlockQ8_0, IQ2_XXS_BLOCK_BYTES, Q2_K_BLOCK_BYTES, QK8_0};
use super::blocks::{Q4_K_BLOCK_BYTES, Q8_0_BLOCK_BYTES};
use super::dequant::{q4k_scale_min, KSIGN_MASK};
use super::dot::dense_finish;
use super::iq2xxs_grid::IQ2XXS_GRID;
use super::{f16_to_f32, le_u16, le_u32};

// ---------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------

/// How far ahead of the current block weights are prefetched. The quantised kernels
/// keep the out-of-order window busy with decode work and a serial float chain, so the
/// hardware prefetcher alone leaves DRAM bandwidth unused; rows are usually contiguous
/// in a tensor, so running past the end of the row fetches the next one.
const PREFETCH_BYTES: usize = 2048;

#[inline(always)]
fn prefetch(p: *const u8) {
    // SAFETY: prefetching is a hint that never faults, whatever the address; the
    // pointer is formed with wrapping arithmetic and never dereferenced.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8) }
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Eight vectors of partial sums → one vector of their eight totals.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn reduce8(p: &[__m256i; 8]) -> __m256i {
    let a = _mm256_hadd_epi32(p[0], p[1]);
    let b = _mm256_hadd_epi32(p[2], p[3]);
    let c = _mm256_hadd_epi32(p[4], p[5]);
    let d = _mm256_hadd_epi32(p[6], p[7]);
    let ab = _mm256_hadd_epi32(a, b);
    let cd = _mm256_hadd_epi32(c, d);
    let lo = _mm256_permute2x128_si256::<0x20>(ab, cd);
    let hi = _mm256_permute2x128_si256::<0x31>(ab, cd);
    _mm256_add_epi32(lo, hi)
}

/// Two f16 values at `p[at..at + 4]` → f32, exactly (F16C handles subnormals).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_pair(p: &[u8], at: usize) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(le_u32(p, at) as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_one(p: &[u8], at: usize) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(le_u16(p, at) as i32)))
}

// ---------------------------------------------------------------------------------
// Q8_0 × Q8_0
// ---------------------------------------------------------------------------------

/// Partial sums (8 × i32) of one Q8_0 block: `wq` points at 32 weight i8, `xq` at 32
/// activation i8.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q8_0_partial(wq: *const u8, xq: *const i8) -> __m256i {
    let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wq as *const __m128i));
    let w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wq.add(16) as *const __m128i));
    let x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(xq as *const __m128i));
    let x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(xq.add(16) as *const __m128i));
    _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1))
}

/// f16 weight scales of blocks `b0..b0+8` as f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn q8_0_scales8(w: &[u8], b0: usize) -> __m256 {
    let at = |k: usize| le_u16(w, (b0 + k) * Q8_0_BLOCK_BYTES) as i16;
    _mm256_cvtph_ps(_mm_setr_epi16(
        at(0),
        at(1),
        at(2),
        at(3),
        at(4),
        at(5),
        at(6),
        at(7),
    ))
}

/// Adds `(dw·dx)·isum` of eight blocks to `acc` one block at a time.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q8_0_combine8(acc: &mut f32, dw: __m256, x: &[BlockQ8_0], b0: usize, isum: __m256i) {
    let dx = _mm256_setr_ps(
        x[b0].d,
        x[b0 + 1].d,
        x[b0 + 2].d,
        x[b0 + 3].d,
        x[b0 + 4].d,
        x[b0 + 5].d,
        x[b0 + 6].d,
        x[b0 + 7].d,
    );
    let p = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum));
    let mut t = [0.0f32; 8];
    _mm256_storeu_ps(t.as_mut_ptr(), p);
    for v in t {
        *acc += v;
    }
}

/// A Q8_0 row in groups of eight blocks with `partial` as the block kernel (the AVX2
/// and VNNI ones give the same exact i32 sums), then the rest one block at a time.
/// Always inlined, so `partial` runs with the caller's features.
#[inline(always)]
unsafe fn dot_q8_0_groups(
    w: &[u8],
    x: &[BlockQ8_0],
    partial: impl Fn(*const u8, *const i8) -> __m256i,
) -> f32 {
    let nb = (w.len() / Q8_0_BLOCK_BYTES).min(x.len());
    let wp = w.as_ptr();
    let mut acc = 0.0f32;
    let mut b = 0;
    while b + 8 <= nb {
        let mut p = [_mm256_setzero_si256(); 8];
        for (k, pk) in p.iter_mut().enumerate() {
            let wb = wp.add((b + k) * Q8_0_BLOCK_BYTES + 2);
            if k % 2 == 0 {
                prefetch(wb);
            }
            *pk = partial(wb, x[b + k].qs.as_ptr());
        }
        let dw = q8_0_scales8(w, b);
        q8_0_combine8(&mut acc, dw, x, b, reduce8(&p));
        b += 8;
    }
    dot_q8_0_tail_avx2(acc, w, x, b, nb)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0_avx2(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    dot_q8_0_groups(w, x, |wq, xq| q8_0_partial(wq, xq))
}

/// Blocks `b0..nb` one at a time (the part of a row short of a full group).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_tail_avx2(mut acc: f32, w: &[u8], x: &[BlockQ8_0], b0: usize, nb: usize) -> f32 {
    let wp = w.as_ptr();
    for b in b0..nb {
        let isum = hsum_i32(q8_0_partial(
            wp.add(b * Q8_0_BLOCK_BYTES + 2),
            x[b].qs.as_ptr(),
        ));
        acc += (f16_one(w, b * Q8_0_BLOCK_BYTES) * x[b].d) * isum as f32;
    }
    acc
}

/// One Q8_0 weight row against several activation rows: each group of eight weight
/// blocks is widened to i16 once and reused for every row.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0_multi_avx2(w: &[u8], xs: &[&[BlockQ8_0]], out: &mut [f32]) {
    let nb = w.len() / Q8_0_BLOCK_BYTES;
    let wp = w.as_ptr();
    out.fill(0.0);
    let mut b = 0;
    while b + 8 <= nb {
        let mut wv = [_mm256_setzero_si256(); 16];
        for k in 0..8 {
            let q = wp.add((b + k) * Q8_0_BLOCK_BYTES + 2);
            if k % 2 == 0 {
                prefetch(q);
            }
            wv[2 * k] = _mm256_cvtepi8_epi16(_mm_loadu_si128(q as *const __m128i));
            wv[2 * k + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(16) as *const __m128i));
        }
        let dw = q8_0_scales8(w, b);
        for (x, acc) in xs.iter().zip(out.iter_mut()) {
            let mut p = [_mm256_setzero_si256(); 8];
            for (k, pk) in p.iter_mut().enumerate() {
                let xq = x[b + k].qs.as_ptr();
                let x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(xq as *const __m128i));
                let x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(xq.add(16) as *const __m128i));
                *pk = _mm256_add_epi32(
                    _mm256_madd_epi16(wv[2 * k], x0),
                    _mm256_madd_epi16(wv[2 * k + 1], x1),
                );
            }
            q8_0_combine8(acc, dw, x, b, reduce8(&p));
        }
        b += 8;
    }
    while b < nb {
        let d = f16_one(w, b * Q8_0_BLOCK_BYTES);
        for (x, acc) in xs.iter().zip(out.iter_mut()) {
            let isum = hsum_i32(q8_0_partial(
                wp.add(b * Q8_0_BLOCK_BYTES + 2),
                x[b].qs.as_ptr(),
            ));
            *acc += (d * x[b].d) * isum as f32;
        }
        b += 1;
    }
}

// ---------------------------------------------------------------------------------
// Q2_K × Q8_K
// ---------------------------------------------------------------------------------

/// The single- and multi-activation K-quant dots over `$unpack` (one weight block),
/// `$sums` (its integer sums against one Q8_K block) and `$combine` (the scaled f32
/// update): the multi form unpacks each weight block once for every activation.
macro_rules! k_quant_dots {
    ($dot:ident, $dot_multi:ident, $block_bytes:expr, $unpack:ident, $sums:ident, $combine:path) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn $dot(w: &[u8], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for (wb, xb) in w.chunks_exact($block_bytes).zip(x) {
                prefetch(wb.as_ptr());
                let u = $unpack(wb);
                let (isum, summs) = $sums(&u, xb);
                $combine(&mut acc, wb, xb, isum, summs);
            }
            acc
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn $dot_multi(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
            out.fill(0.0);
            for (b, wb) in w.chunks_exact($block_bytes).enumerate() {
                let u = $unpack(wb);
                prefetch(wb.as_ptr());
                for (x, acc) in xs.iter().zip(out.iter_mut()) {
                    let (isum, summs) = $sums(&u, &x[b]);
                    $combine(acc, wb, &x[b], isum, summs);
                }
            }
        }
    };
}

/// The 2-bit values of one Q2_K block as 8 vectors of 32 bytes (vector `4k + j` holds
/// elements `128k + 32j ..`), and the low-nibble scales broadcast to both lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q2_k_unpack(wb: &[u8]) -> ([__m256i; 8], __m256i, __m128i) {
    let wb = wb.as_ptr();
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0xF);
    let sc_bytes = _mm_loadu_si128(wb as *const __m128i);
    let sc = _mm256_broadcastsi128_si256(_mm_and_si128(sc_bytes, m4));
    let mins = _mm_and_si128(_mm_srli_epi16::<4>(sc_bytes), m4);
    let mut q = [_mm256_setzero_si256(); 8];
    for k in 0..2 {
        let v = _mm256_loadu_si256(wb.add(16 + 32 * k) as *const __m256i);
        q[4 * k] = _mm256_and_si256(v, m3);
        q[4 * k + 1] = _mm256_and_si256(_mm256_srli_epi16::<2>(v), m3);
        q[4 * k + 2] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m3);
        q[4 * k + 3] = _mm256_and_si256(_mm256_srli_epi16::<6>(v), m3);
    }
    (q, sc, mins)
}

/// (isum, summs) of an unpacked Q2_K block against one Q8_K block.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q2_k_sums(u: &([__m256i; 8], __m256i, __m128i), xb: &BlockQ8K) -> (i32, i32) {
    let (q, sc, mins) = (&u.0, u.1, u.2);
    let bsums = _mm256_loadu_si256(xb.bsums.as_ptr() as *const __m256i);
    let summs = _mm256_madd_epi16(bsums, _mm256_cvtepu8_epi16(mins));
    let xq = xb.qs.as_ptr();
    let mut acc = _mm256_setzero_si256();
    for (p, qp) in q.iter().enumerate() {
        let x = _mm256_loadu_si256(xq.add(32 * p) as *const __m256i);
        let prod = _mm256_maddubs_epi16(*qp, x);
        // Sub-block scales 2p (first 16 elements, low lane) and 2p+1 (high lane), as i16.
        let lo = (0x8000u16 | (2 * p) as u16) as i16;
        let hi = (0x8000u16 | (2 * p + 1) as u16) as i16;
        let s = _mm256_shuffle_epi8(
            sc,
            _mm256_setr_m128i(_mm_set1_epi16(lo), _mm_set1_epi16(hi)),
        );
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, s));
    }
    (hsum_i32(acc), hsum_i32(summs))
}

/// `acc += d·isum − dmin·summs` of a K-quant block whose f16 `d` and `dmin` sit at
/// byte `D_AT` (Q2_K: 80, Q4_K: 0), both scaled by the activations' `d`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn k_combine<const D_AT: usize>(
    acc: &mut f32,
    wb: &[u8],
    xb: &BlockQ8K,
    isum: i32,
    summs: i32,
) {
    let (d, dmin) = f16_pair(wb, D_AT);
    let d = xb.d * d;
    let dmin = xb.d * dmin;
    *acc += d * isum as f32 - dmin * summs as f32;
}

k_quant_dots! {
    dot_q2_k_avx2, dot_q2_k_multi_avx2, Q2_K_BLOCK_BYTES, q2_k_unpack, q2_k_sums, k_combine::<80>
}

// ---------------------------------------------------------------------------------
// Q4_K × Q8_K
// ---------------------------------------------------------------------------------

/// Nibbles of one Q4_K block (vector `2c` = low nibbles of chunk c, `2c+1` = high),
/// the eight 6-bit scales and mins.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4_k_unpack(wb: &[u8]) -> ([__m256i; 8], [u8; 8], [u8; 8]) {
    let m4 = _mm256_set1_epi8(0xF);
    let mut q = [_mm256_setzero_si256(); 8];
    let p = wb.as_ptr();
    for c in 0..4 {
        let v = _mm256_loadu_si256(p.add(16 + 32 * c) as *const __m256i);
        q[2 * c] = _mm256_and_si256(v, m4);
        q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
    }
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        (sc[j], mn[j]) = q4k_scale_min(j, &wb[4..16]);
    }
    (q, sc, mn)
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4_k_sums(u: &([__m256i; 8], [u8; 8], [u8; 8]), xb: &BlockQ8K) -> (i32, i32) {
    let (q, sc, mn) = u;
    let xq = xb.qs.as_ptr();
    let mut acc = _mm256_setzero_si256();
    for (j, qj) in q.iter().enumerate() {
        let x = _mm256_loadu_si256(xq.add(32 * j) as *const __m256i);
        let prod = _mm256_maddubs_epi16(*qj, x);
        acc = _mm256_add_epi32(
            acc,
            _mm256_madd_epi16(prod, _mm256_set1_epi16(sc[j] as i16)),
        );
    }
    let mut summs = 0i32;
    for j in 0..8 {
        summs += mn[j] as i32 * (xb.bsums[2 * j] as i32 + xb.bsums[2 * j + 1] as i32);
    }
    (hsum_i32(acc), summs)
}

k_quant_dots! {
    dot_q4_k_avx2, dot_q4_k_multi_avx2, Q4_K_BLOCK_BYTES, q4_k_unpack, q4_k_sums, k_combine::<0>
}

// ---------------------------------------------------------------------------------
// IQ2_XXS × Q8_K
// ---------------------------------------------------------------------------------

/// `IQ2XXS_SIGNED[128·g + s]`: grid point `g` with sign pattern `ksigns(s)` applied, as
/// 8 i8. 256 KiB: one load per 8 weights replaces a grid load, a sign-mask load and the
/// negation, which made the decode (not memory) the bottleneck of this kernel.
static IQ2XXS_SIGNED: [u64; 256 * 128] = {
    let mut t = [0u64; 256 * 128];
    let mut g = 0;
    while g < 256 {
        let grid = IQ2XXS_GRID[g];
        let mut s = 0;
        while s < 128 {
            let mask = KSIGN_MASK[s];
            let mut v = 0u64;
            let mut j = 0;
            while j < 8 {
                let b = ((grid >> (8 * j)) & 0xFF) as u8;
                let neg = (mask >> (8 * j)) & 0xFF != 0;
                let b = if neg {
                    (b as i8).wrapping_neg() as u8
                } else {
                    b
                };
                v |= (b as u64) << (8 * j);
                j += 1;
            }
            t[128 * g + s] = v;
            s += 1;
        }
        g += 1;
    }
    t
};

/// Signed grid values (i8, |v| ≤ 43) of the 8 groups of one IQ2_XXS block and the
/// group multipliers `2·ls + 1`. Table indices are computed in vector registers and
/// fetched with one 4-element gather per group: 1.5× faster than scalar index
/// arithmetic and inserts.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq2_xxs_unpack_gather(wb: &[u8]) -> ([__m256i; 8], [i16; 8]) {
    let mut sg = [_mm256_setzero_si256(); 8];
    let mut ls = [0i16; 8];
    let wb: &[u8; IQ2_XXS_BLOCK_BYTES] = wb.try_into().expect("IQ2_XXS block");
    let p = wb.as_ptr();
    let shifts = _mm_setr_epi32(0, 7, 14, 21);
    let m127 = _mm_set1_epi32(127);
    let table = IQ2XXS_SIGNED.as_ptr() as *const i64;
    for g in 0..8 {
        let o = 2 + 8 * g;
        let a1 = le_u32(wb, o + 4);
        let grid = _mm_slli_epi32::<7>(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(
            (p.add(o) as *const i32).read_unaligned(),
        )));
        let signs = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(a1 as i32), shifts), m127);
        sg[g] = _mm256_i32gather_epi64::<8>(table, _mm_add_epi32(grid, signs));
        ls[g] = 2 * (a1 >> 28) as i16 + 1;
    }
    (sg, ls)
}

/// Σ_g ls_g·Σ sg·q8. `maddubs` needs an unsigned operand: with `u = q8 ^ 0x80 = q8+128`,
/// Σ u·sg − Σ 128·sg = Σ q8·sg exactly (all pair sums stay within i16).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq2_xxs_sum(sg: &[__m256i; 8], ls: &[i16; 8], xb: &BlockQ8K) -> i32 {
    let bias = _mm256_set1_epi8(-128);
    let xq = xb.qs.as_ptr();
    let mut acc = _mm256_setzero_si256();
    for g in 0..8 {
        let x = _mm256_loadu_si256(xq.add(32 * g) as *const __m256i);
        let u = _mm256_xor_si256(x, bias);
        let t = _mm256_sub_epi16(
            _mm256_maddubs_epi16(u, sg[g]),
            _mm256_maddubs_epi16(bias, sg[g]),
        );
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(t, _mm256_set1_epi16(ls[g])));
    }
    hsum_i32(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq2_xxs_avx2(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (wb, xb) in w.chunks_exact(IQ2_XXS_BLOCK_BYTES).zip(x) {
        prefetch(wb.as_ptr());
        let (sg, ls) = iq2_xxs_unpack_gather(wb);
        let bsum = iq2_xxs_sum(&sg, &ls, xb);
        acc += (f16_one(wb, 0) * xb.d) * bsum as f32;
    }
    0.125 * acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq2_xxs_multi_avx2(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    out.fill(0.0);
    for (b, wb) in w.chunks_exact(IQ2_XXS_BLOCK_BYTES).enumerate() {
        let (sg, ls) = iq2_xxs_unpack_gather(wb);
        let d = f16_one(wb, 0);
        prefetch(wb.as_ptr());
        for (x, acc) in xs.iter().zip(out.iter_mut()) {
            let bsum = iq2_xxs_sum(&sg, &ls, &x[b]);
            *acc += (d * x[b].d) * bsum as f32;
        }
    }
    for o in out.iter_mut() {
        *o *= 0.125;
    }
}

// ---------------------------------------------------------------------------------
// Dense
// ---------------------------------------------------------------------------------

/// Dense dot of `n` elements where `load(i)` gives 8 weights at element i.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dense_avx2(n: usize, x: *const f32, load: impl Fn(usize) -> __m256) -> [f32; 16] {
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        a0 = _mm256_fmadd_ps(load(i), _mm256_loadu_ps(x.add(i)), a0);
        a1 = _mm256_fmadd_ps(load(i + 8), _mm256_loadu_ps(x.add(i + 8)), a1);
        i += 16;
    }
    let mut lanes = [0.0f32; 16];
    _mm256_storeu_ps(lanes.as_mut_ptr(), a0);
    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a1);
    lanes
}

/// 8 f16 at `p` → f32, exactly.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load8_f16(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// The three dense dots of one ISA level. Levels differ only in the vector kernel
/// `$dense` (which fixes the lane assignment) and the loads; the prefetch cadence,
/// the scalar tail ([`dense_finish`]) and the reduction are the same.
macro_rules! dense_dots {
    ($features:literal, $dense:ident, $load_f16:ident, $load_f32:ident,
     $dot_f16_f32:ident, $dot_f32_f32:ident, $dot_f32:ident) => {
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $dot_f16_f32(w: &[u8], x: &[f32]) -> f32 {
            let n = (w.len() / 2).min(x.len());
            let wp = w.as_ptr();
            let lanes = $dense(n, x.as_ptr(), |i| {
                if i % 32 == 0 {
                    prefetch(wp.wrapping_add(2 * i));
                }
                $load_f16(wp.add(2 * i))
            });
            dense_finish(lanes, n, |i| (f16_to_f32(le_u16(w, 2 * i)), x[i]))
        }

        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $dot_f32_f32(w: &[u8], x: &[f32]) -> f32 {
            let n = (w.len() / 4).min(x.len());
            let wp = w.as_ptr() as *const f32;
            let lanes = $dense(n, x.as_ptr(), |i| {
                if i % 16 == 0 {
                    prefetch(wp.wrapping_add(i) as *const u8);
                }
                $load_f32(wp.add(i))
            });
            dense_finish(lanes, n, |i| (f32::from_bits(le_u32(w, 4 * i)), x[i]))
        }

        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $dot_f32(a: &[f32], b: &[f32]) -> f32 {
            let n = a.len().min(b.len());
            let ap = a.as_ptr();
            let lanes = $dense(n, b.as_ptr(), |i| $load_f32(ap.add(i)));
            dense_finish(lanes, n, |i| (a[i], b[i]))
        }
    };
}

dense_dots!(
    "avx2,fma,f16c",
    dense_avx2,
    load8_f16,
    _mm256_loadu_ps,
    dot_f16_f32_avx2,
    dot_f32_f32_avx2,
    dot_f32_avx2
);

// ---------------------------------------------------------------------------------
// AVX-512 (F + BW + VL, VNNI where noted)
// ---------------------------------------------------------------------------------

/// Q8_0 with VNNI on 256-bit registers: `dpbusd` wants an unsigned operand, so the
/// weights are biased by 128 (`w ^ 0x80`) and `128·Σx` (another `dpbusd`) is taken off:
/// exact in i32, and no i8→i16 widening shuffles, which bound the AVX2 kernel in cache.
#[inline]
#[target_feature(enable = "avx512vl,avx512vnni,avx2")]
unsafe fn q8_0_partial_vnni(wq: *const u8, xq: *const i8) -> __m256i {
    let bias = _mm256_set1_epi8(-128);
    let w = _mm256_xor_si256(_mm256_loadu_si256(wq as *const __m256i), bias);
    let x = _mm256_loadu_si256(xq as *const __m256i);
    let z = _mm256_setzero_si256();
    _mm256_sub_epi32(
        _mm256_dpbusd_epi32(z, w, x),
        _mm256_dpbusd_epi32(z, bias, x),
    )
}

#[target_feature(enable = "avx512f,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_q8_0_vnni(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    dot_q8_0_groups(w, x, |wq, xq| q8_0_partial_vnni(wq, xq))
}

/// One IQ2_XXS block decoded for 512-bit kernels: signed grid values of groups
/// (2h, 2h+1) in `sg[h]`, their `Σ 128·sg` pair sums (the bias term of the unsigned
/// `maddubs` trick, which does not depend on the activations) and `2·ls+1` per half.
struct Iq2Zmm {
    sg: [__m512i; 4],
    bias_term: [__m512i; 4],
    ls: [__m512i; 4],
}

/// Groups 2h and 2h+1 of an IQ2_XXS block: their signed grid values (64 i8, one
/// 8-index gather) and the `2·ls+1` multiplier of each group on its half of 32 i16
/// lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn iq2_xxs_pair512(wb: &[u8; IQ2_XXS_BLOCK_BYTES], h: usize) -> (__m512i, __m512i) {
    let shifts = _mm256_setr_epi32(0, 7, 14, 21, 0, 7, 14, 21);
    let m127 = _mm256_set1_epi32(127);
    let table = IQ2XXS_SIGNED.as_ptr() as *const i64;
    let p = wb.as_ptr();
    // Grid bytes at 2+16h and 10+16h, sign words after them.
    let o = 2 + 16 * h;
    let a = le_u32(wb, o + 4);
    let b = le_u32(wb, o + 12);
    let gi = _mm_setr_epi32(
        (p.add(o) as *const i32).read_unaligned(),
        (p.add(o + 8) as *const i32).read_unaligned(),
        0,
        0,
    );
    let grid = _mm256_slli_epi32::<7>(_mm256_cvtepu8_epi32(gi));
    let words = _mm256_setr_m128i(_mm_set1_epi32(a as i32), _mm_set1_epi32(b as i32));
    let signs = _mm256_and_si256(_mm256_srlv_epi32(words, shifts), m127);
    let sg = _mm512_i32gather_epi64::<8>(_mm256_add_epi32(grid, signs), table);
    let ls = _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi16(2 * (a >> 28) as i16 + 1)),
        _mm256_set1_epi16(2 * (b >> 28) as i16 + 1),
    );
    (sg, ls)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn iq2_xxs_unpack512(wb: &[u8; IQ2_XXS_BLOCK_BYTES]) -> Iq2Zmm {
    let bias = _mm512_set1_epi8(-128);
    let z = _mm512_setzero_si512();
    let mut out = Iq2Zmm {
        sg: [z; 4],
        bias_term: [z; 4],
        ls: [z; 4],
    };
    for h in 0..4 {
        let (sg, ls) = iq2_xxs_pair512(wb, h);
        out.sg[h] = sg;
        out.bias_term[h] = _mm512_maddubs_epi16(bias, sg);
        out.ls[h] = ls;
    }
    out
}

/// Σ_g ls_g·Σ sg·q8 of a decoded block (see [`iq2_xxs_sum`] for the bias trick).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn iq2_xxs_sum512(d: &Iq2Zmm, xb: &BlockQ8K) -> i32 {
    let bias = _mm512_set1_epi8(-128);
    let xq = xb.qs.as_ptr();
    let mut tot = _mm512_setzero_si512();
    for h in 0..4 {
        let xv = _mm512_loadu_si512(xq.add(64 * h) as *const _);
        let t = _mm512_sub_epi16(
            _mm512_maddubs_epi16(_mm512_xor_si512(xv, bias), d.sg[h]),
            d.bias_term[h],
        );
        tot = _mm512_add_epi32(tot, _mm512_madd_epi16(t, d.ls[h]));
    }
    _mm512_reduce_add_epi32(tot)
}

/// IQ2_XXS with 512-bit registers: one 8-index gather and one multiply chain per two
/// groups (64 weights). Kept fused rather than built on [`iq2_xxs_unpack512`]: letting
/// each gather overlap the previous pair's arithmetic is ~15% faster for one row.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq2_xxs_avx512(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let bias = _mm512_set1_epi8(-128);
    let mut acc = 0.0f32;
    for (wb, xb) in w.chunks_exact(IQ2_XXS_BLOCK_BYTES).zip(x) {
        prefetch(wb.as_ptr());
        let wb: &[u8; IQ2_XXS_BLOCK_BYTES] = wb.try_into().expect("IQ2_XXS block");
        let xq = xb.qs.as_ptr();
        let mut tot = _mm512_setzero_si512();
        for h in 0..4 {
            let (sg, lsv) = iq2_xxs_pair512(wb, h);
            let xv = _mm512_loadu_si512(xq.add(64 * h) as *const _);
            let t = _mm512_sub_epi16(
                _mm512_maddubs_epi16(_mm512_xor_si512(xv, bias), sg),
                _mm512_maddubs_epi16(bias, sg),
            );
            tot = _mm512_add_epi32(tot, _mm512_madd_epi16(t, lsv));
        }
        let bsum = _mm512_reduce_add_epi32(tot);
        acc += (f16_one(wb, 0) * xb.d) * bsum as f32;
    }
    0.125 * acc
}

/// Multi-row IQ2_XXS: each block is gathered and its bias term computed once.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(crate) unsafe fn dot_iq2_xxs_multi_avx512(w: &[u8], xs: &[&[BlockQ8K]], out: &mut [f32]) {
    out.fill(0.0);
    for (b, wb) in w.chunks_exact(IQ2_XXS_BLOCK_BYTES).enumerate() {
        prefetch(wb.as_ptr());
        let wb: &[u8; IQ2_XXS_BLOCK_BYTES] = wb.try_into().expect("IQ2_XXS block");
        let dec = iq2_xxs_unpack512(wb);
        let d = f16_one(wb, 0);
        for (x, acc) in xs.iter().zip(out.iter_mut()) {
            *acc += (d * x[b].d) * iq2_xxs_sum512(&dec, &x[b]) as f32;
        }
    }
    for o in out.iter_mut() {
        *o *= 0.125;
    }
}

/// Dense dots with one 16-lane register: exactly the canonical lane assignment.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn dense_avx512(n: usize, x: *const f32, load: impl Fn(usize) -> __m512) -> [f32; 16] {
    let mut a = _mm512_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        a = _mm512_fmadd_ps(load(i), _mm512_loadu_ps(x.add(i)), a);
        i += 16;
    }
    let mut lanes = [0.0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), a);
    lanes
}

/// 16 f16 at `p` → f32, exactly.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn load16_f16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

dense_dots!(
    "avx512f,avx2,fma,f16c",
    dense_avx512,
    load16_f16,
    _mm512_loadu_ps,
    dot_f16_f32_avx512,
    dot_f32_f32_avx512,
    dot_f32_avx512
);

/// `QK8_0` is what the Q8_0 kernels above assume.
const _: () = assert!(QK8_0 == 32);
