//! Dot products of one weight row with one activation row.
//!
//! Canonical evaluation orders (every SIMD path reproduces them bit for bit):
//! * quantised × Q8: the integer sum of each block is exact; blocks are combined in
//!   order with the float formula of each function;
//! * F16/F32 × f32: 16 interleaved lanes (`lane[i % 16] = fma(w[i], x[i], lane)`), then
//!   the lanes are summed as a fixed pairwise tree. This is the order a 16-wide (or
//!   2×8-wide) FMA loop produces naturally.
//!
//! The public `dot_*` functions dispatch to the best kernel this CPU has (chosen once,
//! at first use); `dot_*_scalar` are the reference implementations. `dot_*_multi`
//! compute one weight row against several activation rows, streaming each weight
//! block once (prefill, batched decode); each result equals the single-row dot.

use super::blocks::{BlockQ8K, BlockQ8_0, QK8_0, QK_K};
use super::dequant::{ksigns, q4k_scale_min};
use super::iq2xxs_grid::IQ2XXS_GRID;
use super::{f16_to_f32, le_u16, le_u32};

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

/// Finishes a SIMD dense dot of `n` elements: the vector part left the lanes of
/// elements `0..n / 16 * 16`; the tail continues the same lane assignment with
/// `elem(i) = (w_i, x_i)`, then the canonical reduction.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline]
pub(crate) fn dense_finish(
    mut lanes: [f32; DENSE_LANES],
    n: usize,
    elem: impl Fn(usize) -> (f32, f32),
) -> f32 {
    for i in n / DENSE_LANES * DENSE_LANES..n {
        let (a, b) = elem(i);
        let l = &mut lanes[i % DENSE_LANES];
        *l = a.mul_add(b, *l);
    }
    reduce_lanes(&lanes)
}

/// Q8_0 weight row · Q8_0 activations: `Σ_b (f16(d_w)·d_x)·Σ q_w·q_x`.
pub fn dot_q8_0_q8_0_scalar(w: &[u8], x: &[BlockQ8_0]) -> f32 {
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
pub fn dot_q2_k_q8_k_scalar(w: &[u8], x: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 84);
    k_quant_row(w, x, 84, 80, q2_k_block_sums)
}

/// A K-quant row (Q2_K, Q4_K): `Σ_b (d_x·f16(d))·isum − (d_x·f16(dmin))·summs` with the
/// block sums of `sums` and the f16 pair `d`, `dmin` at byte `d_at` of each block. The
/// SIMD kernels that keep the scalar float order share it.
#[inline(always)]
pub(crate) fn k_quant_row(
    w: &[u8],
    x: &[BlockQ8K],
    block_bytes: usize,
    d_at: usize,
    sums: impl Fn(&[u8], &BlockQ8K) -> (i32, i32),
) -> f32 {
    let mut acc = 0.0f32;
    for (wb, xb) in w.chunks_exact(block_bytes).zip(x) {
        let (isum, summs) = sums(wb, xb);
        let d = xb.d * f16_to_f32(le_u16(wb, d_at));
        let dmin = xb.d * f16_to_f32(le_u16(wb, d_at + 2));
        acc += d * isum as f32 - dmin * summs as f32;
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
pub fn dot_q4_k_q8_k_scalar(w: &[u8], x: &[BlockQ8K]) -> f32 {
    debug_assert_eq!(w.len(), x.len() * 144);
    k_quant_row(w, x, 144, 0, q4_k_block_sums)
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
pub fn dot_iq2_xxs_q8_k_scalar(w: &[u8], x: &[BlockQ8K]) -> f32 {
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
        let a1 = le_u32(w, 4);
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
pub fn dot_f16_f32_scalar(w: &[u8], x: &[f32]) -> f32 {
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
pub fn dot_f32_f32_scalar(w: &[u8], x: &[f32]) -> f32 {
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
pub fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
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

// ---------------------------------------------------------------------------------
// Runtime dispatch
// ---------------------------------------------------------------------------------

/// An instruction-set level the dot kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimdLevel {
    Scalar,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// x86_64 AVX-512 F/BW/VL (+VNNI where a kernel uses it) on top of AVX2.
    Avx512,
    /// aarch64 NEON (+dotprod is not assumed).
    Neon,
}

type QDot<B> = fn(&[u8], &[B]) -> f32;
type QMulti<B> = fn(&[u8], &[&[B]], &mut [f32]);

/// The kernels of one [`SimdLevel`]. Obtain one with [`DotKernels::get`] (which checks
/// the CPU) or [`DotKernels::best`].
#[derive(Clone, Copy, Debug)]
pub struct DotKernels {
    pub level: SimdLevel,
    pub q8_0: QDot<BlockQ8_0>,
    pub q2_k: QDot<BlockQ8K>,
    pub q4_k: QDot<BlockQ8K>,
    pub iq2_xxs: QDot<BlockQ8K>,
    pub f16_f32: fn(&[u8], &[f32]) -> f32,
    pub f32_f32: fn(&[u8], &[f32]) -> f32,
    pub f32: fn(&[f32], &[f32]) -> f32,
    pub q8_0_multi: QMulti<BlockQ8_0>,
    pub q2_k_multi: QMulti<BlockQ8K>,
    pub q4_k_multi: QMulti<BlockQ8K>,
    pub iq2_xxs_multi: QMulti<BlockQ8K>,
}

/// `out[r] = f(w, xs[r])`: the multi-row kernel of levels with no dedicated one.
pub(crate) fn multi_by_rows<B>(w: &[u8], xs: &[&[B]], out: &mut [f32], f: QDot<B>) {
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        *o = f(w, x);
    }
}

static SCALAR: DotKernels = DotKernels {
    level: SimdLevel::Scalar,
    q8_0: dot_q8_0_q8_0_scalar,
    q2_k: dot_q2_k_q8_k_scalar,
    q4_k: dot_q4_k_q8_k_scalar,
    iq2_xxs: dot_iq2_xxs_q8_k_scalar,
    f16_f32: dot_f16_f32_scalar,
    f32_f32: dot_f32_f32_scalar,
    f32: dot_f32_scalar,
    q8_0_multi: |w, xs, out| multi_by_rows(w, xs, out, dot_q8_0_q8_0_scalar),
    q2_k_multi: |w, xs, out| multi_by_rows(w, xs, out, dot_q2_k_q8_k_scalar),
    q4_k_multi: |w, xs, out| multi_by_rows(w, xs, out, dot_q4_k_q8_k_scalar),
    iq2_xxs_multi: |w, xs, out| multi_by_rows(w, xs, out, dot_iq2_xxs_q8_k_scalar),
};

#[cfg(target_arch = "x86_64")]
mod x86_tables {
    use super::super::simd_x86 as k;
    use super::{DotKernels, SimdLevel};

    // SAFETY (every wrapper below): these tables are only handed out by
    // `DotKernels::get` after `is_x86_feature_detected!` confirmed the features the
    // kernels are compiled for; the kernels bound every memory access by the slice
    // lengths they are given.
    macro_rules! wrap {
        ($f:path, $($a:ident : $t:ty),*) => {
            |$($a: $t),*| unsafe { $f($($a),*) }
        };
    }

    pub(super) static AVX2: DotKernels = DotKernels {
        level: SimdLevel::Avx2,
        q8_0: wrap!(k::dot_q8_0_avx2, w: &[u8], x: &[_]),
        q2_k: wrap!(k::dot_q2_k_avx2, w: &[u8], x: &[_]),
        q4_k: wrap!(k::dot_q4_k_avx2, w: &[u8], x: &[_]),
        iq2_xxs: wrap!(k::dot_iq2_xxs_avx2, w: &[u8], x: &[_]),
        f16_f32: wrap!(k::dot_f16_f32_avx2, w: &[u8], x: &[f32]),
        f32_f32: wrap!(k::dot_f32_f32_avx2, w: &[u8], x: &[f32]),
        f32: wrap!(k::dot_f32_avx2, a: &[f32], b: &[f32]),
        q8_0_multi: wrap!(k::dot_q8_0_multi_avx2, w: &[u8], xs: &[&[_]], o: &mut [f32]),
        q2_k_multi: wrap!(k::dot_q2_k_multi_avx2, w: &[u8], xs: &[&[_]], o: &mut [f32]),
        q4_k_multi: wrap!(k::dot_q4_k_multi_avx2, w: &[u8], xs: &[&[_]], o: &mut [f32]),
        iq2_xxs_multi: wrap!(k::dot_iq2_xxs_multi_avx2, w: &[u8], xs: &[&[_]], o: &mut [f32]),
    };

    pub(super) static AVX512: DotKernels = DotKernels {
        level: SimdLevel::Avx512,
        q8_0: wrap!(k::dot_q8_0_vnni, w: &[u8], x: &[_]),
        iq2_xxs: wrap!(k::dot_iq2_xxs_avx512, w: &[u8], x: &[_]),
        iq2_xxs_multi: wrap!(k::dot_iq2_xxs_multi_avx512, w: &[u8], xs: &[&[_]], o: &mut [f32]),
        f16_f32: wrap!(k::dot_f16_f32_avx512, w: &[u8], x: &[f32]),
        f32_f32: wrap!(k::dot_f32_f32_avx512, w: &[u8], x: &[f32]),
        f32: wrap!(k::dot_f32_avx512, a: &[f32], b: &[f32]),
        ..AVX2
    };

    pub(super) fn has_avx2() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    pub(super) fn has_avx512() -> bool {
        has_avx2()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
    }
}

impl DotKernels {
    /// The kernels of `level`, or `None` when this CPU (or build target) lacks it.
    pub fn get(level: SimdLevel) -> Option<&'static DotKernels> {
        match level {
            SimdLevel::Scalar => Some(&SCALAR),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 if x86_tables::has_avx2() => Some(&x86_tables::AVX2),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 if x86_tables::has_avx512() => Some(&x86_tables::AVX512),
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Neon if std::arch::is_aarch64_feature_detected!("neon") => {
                Some(&super::simd_neon::NEON)
            }
            _ => None,
        }
    }

    /// Every level this CPU supports, best last.
    pub fn available() -> Vec<&'static DotKernels> {
        [
            SimdLevel::Scalar,
            SimdLevel::Neon,
            SimdLevel::Avx2,
            SimdLevel::Avx512,
        ]
        .into_iter()
        .filter_map(DotKernels::get)
        .collect()
    }

    /// The best supported level, chosen once. `DS4_SIMD=scalar|avx2|avx512|neon` caps
    /// the choice (benchmarks, bisecting a numerical difference).
    pub fn best() -> &'static DotKernels {
        static BEST: std::sync::OnceLock<&'static DotKernels> = std::sync::OnceLock::new();
        BEST.get_or_init(|| {
            let all = DotKernels::available();
            let wanted = std::env::var("DS4_SIMD")
                .ok()
                .map(|s| s.to_ascii_lowercase());
            let pick = wanted.and_then(|w| {
                all.iter()
                    .copied()
                    .find(|k| format!("{:?}", k.level).to_ascii_lowercase() == w)
            });
            pick.unwrap_or_else(|| all[all.len() - 1])
        })
    }
}

/// The level the public `dot_*` functions use.
pub fn simd_level() -> SimdLevel {
    DotKernels::best().level
}

/// The public entry points: each checks its row lengths in debug builds (`per` weight
/// bytes per activation element or block) and calls the kernel of [`DotKernels::best`].
macro_rules! dispatch {
    ($($(#[$doc:meta])* $name:ident($w:ident: $wt:ty, $x:ident: $xt:ty) => $kernel:ident, $per:literal;)*) => {$(
        $(#[$doc])*
        #[inline]
        pub fn $name($w: $wt, $x: $xt) -> f32 {
            debug_assert_eq!($w.len(), $x.len() * $per);
            (DotKernels::best().$kernel)($w, $x)
        }
    )*};
}

dispatch! {
    /// Q8_0 weight row · Q8_0 activations: `Σ_b (f16(d_w)·d_x)·Σ q_w·q_x`.
    dot_q8_0_q8_0(w: &[u8], x: &[BlockQ8_0]) => q8_0, 34;
    /// Q2_K weight row · Q8_K activations (ggml scalar `vec_dot_q2_K_q8_K` order).
    dot_q2_k_q8_k(w: &[u8], x: &[BlockQ8K]) => q2_k, 84;
    /// Q4_K weight row · Q8_K activations (see [`dot_q4_k_q8_k_scalar`]).
    dot_q4_k_q8_k(w: &[u8], x: &[BlockQ8K]) => q4_k, 144;
    /// IQ2_XXS weight row · Q8_K activations (see [`dot_iq2_xxs_q8_k_scalar`]).
    dot_iq2_xxs_q8_k(w: &[u8], x: &[BlockQ8K]) => iq2_xxs, 66;
    /// F16 weight row · f32 activations in the canonical 16-lane FMA order.
    dot_f16_f32(w: &[u8], x: &[f32]) => f16_f32, 2;
    /// F32 weight row · f32 activations in the canonical 16-lane FMA order.
    dot_f32_f32(w: &[u8], x: &[f32]) => f32_f32, 4;
    /// f32 · f32 in the canonical 16-lane FMA order (attention scores, pooled sums).
    dot_f32(a: &[f32], b: &[f32]) => f32, 1;
}

fn check_multi<B>(w: &[u8], block_bytes: usize, xs: &[&[B]], out: &[f32]) {
    assert_eq!(
        xs.len(),
        out.len(),
        "dot multi: one output per activation row"
    );
    let nb = w.len() / block_bytes;
    assert_eq!(w.len(), nb * block_bytes, "dot multi: partial weight block");
    for x in xs {
        assert_eq!(x.len(), nb, "dot multi: activation row length");
    }
}

/// The multi-row entry points: each checks the shapes (see [`check_multi`], `$bytes`
/// per weight block) and calls the kernel of [`DotKernels::best`].
macro_rules! dispatch_multi {
    ($($(#[$doc:meta])* $name:ident($block:ty) => $kernel:ident, $bytes:literal;)*) => {$(
        $(#[$doc])*
        pub fn $name(w: &[u8], xs: &[&[$block]], out: &mut [f32]) {
            check_multi(w, $bytes, xs, out);
            (DotKernels::best().$kernel)(w, xs, out)
        }
    )*};
}

dispatch_multi! {
    /// `out[r] = dot_q8_0_q8_0(w, xs[r])` for every activation row, reading `w` once.
    /// Panics unless `xs.len() == out.len()` and every row has `w.len()/34` blocks.
    dot_q8_0_q8_0_multi(BlockQ8_0) => q8_0_multi, 34;
    /// `out[r] = dot_q2_k_q8_k(w, xs[r])`, each weight block unpacked once for all rows.
    /// Panics unless `xs.len() == out.len()` and every row has `w.len()/84` blocks.
    dot_q2_k_q8_k_multi(BlockQ8K) => q2_k_multi, 84;
    /// `out[r] = dot_q4_k_q8_k(w, xs[r])`, each weight block unpacked once for all rows.
    /// Panics unless `xs.len() == out.len()` and every row has `w.len()/144` blocks.
    dot_q4_k_q8_k_multi(BlockQ8K) => q4_k_multi, 144;
    /// `out[r] = dot_iq2_xxs_q8_k(w, xs[r])`: the grid lookups and sign expansion of each
    /// weight block (the expensive part) are done once for all rows.
    /// Panics unless `xs.len() == out.len()` and every row has `w.len()/66` blocks.
    dot_iq2_xxs_q8_k_multi(BlockQ8K) => iq2_xxs_multi, 66;
}
