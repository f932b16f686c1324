// A few tokens (2..16: a multi-row step, a batched step over sessions) of a plain Q8_0
// matrix with int8 activations on int8 tensor cores (`tokens_mma`): mma.m16n8k32 of 16
// weight rows × 32 columns (one Q8_0 block) against 8 tokens' 32 activations (their
// Q8_0 block), scaled by the two blocks' scales into f32 sums.
//
// Why: matvec_q8_0_q8_t{T}r{R} loads each weight block once but every token's 32
// activation bytes once per lane and block (T·36 bytes of L1 traffic per 32 weight
// bytes) and spends 8 dp4a per token: at T = 8 it took 2–2.6× the one-token kernel's
// time, where the weights alone say ~1×. Here a warp's 16 rows share each token's block
// loads and one mma replaces 16·8·8 dp4a.
//
// The integer block sums are exact either way; only the order of the f32 accumulation
// over blocks differs from the dp4a kernels (gpu-selftest: against them, f32 bound).
//
// Layout: warp tile = 16 rows; `ks` warps of a block split a tile's pairs of blocks
// and sum through shared memory; 8 warps a block, or ks (up to 16) where ks > 8. Lane (g = lane / 4, q = lane % 4)
// feeds rows g and g + 8 and token g; the mma's k order is a permutation of the
// block's (the same for weights and activations), which a dot product does not see.
// Accumulator c[j]: row g (+8 for j ≥ 2), token 2q + (j & 1) of the 8-token tile.
#include "common.cuh"

// (TMMA_UNROLL, MMA_TOKENS_MAX_KS: ds4_consts.h.)

__device__ __forceinline__ void tmma_s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                        u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One warp's loads of U pairs of blocks (weights of rows g and g + 8 and their scales).
template <int U>
struct TmmaW {
    uint4 wa[U], wb[U];
    u32 sa2[U], sb2[U];  // per pair: block 0's f16 scale in the low half, block 1's high
};

// A warp's running addresses (advanced a pair at a time by the steps) and sums.
template <int NT>
struct TmmaState {
    const i8* pa;
    const i8* pb;
    const u16* da;
    const u16* db;
    const i8* px[NT];        // token g of tile t, at the pair's first block
    const float* ps[NT][2];  // tokens 8t + 2q + e's block scales
    float acc[NT][4];
};

// N (2 or 4) consecutive u32 from p in one load (the caller keeps p aligned to it);
// EARLY: by ld_early* (kept ahead of PDL_WAIT).
template <int N, bool EARLY>
__device__ __forceinline__ void tmma_ld_u32(u32 (&v)[N], const void* p) {
    static_assert(N == 2 || N == 4, "a step is 2 or 4 pairs");
    if constexpr (N == 4) {
        const uint4 a = EARLY ? ld_early16(p) : *reinterpret_cast<const uint4*>(p);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    } else {
        const uint2 a = EARLY ? ld_early8(p) : *reinterpret_cast<const uint2*>(p);
        v[0] = a.x, v[1] = a.y;
    }
}

// EARLY: the loads before PDL_WAIT (ld_early*: kept ahead of the wait).
template <int NT, int U, bool EARLY = false>
__device__ __forceinline__ void tmma_load_w(TmmaW<U>& w, TmmaState<NT>& s) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        w.wa[u] = EARLY ? ld_early16(s.pa + 64 * u) : ld_stream16(s.pa + 64 * u);
        w.wb[u] = EARLY ? ld_early16(s.pb + 64 * u) : ld_stream16(s.pb + 64 * u);
    }
    tmma_ld_u32<U, EARLY>(w.sa2, s.da);
    tmma_ld_u32<U, EARLY>(w.sb2, s.db);
    s.pa += 64 * U;
    s.pb += 64 * U;
    s.da += 2 * U;
    s.db += 2 * U;
}

// The activations of the U pairs of `w`, then their mma and scaling into the sums.
template <int NT, int U>
__device__ __forceinline__ void tmma_compute(const TmmaW<U>& w, TmmaState<NT>& s, int o0,
                                             int o1, bool first) {
    // Scales: token slot e's 2U block scales (a float4 holds two pairs), its data: 8
    // bytes of each block at the lane's offset.
    float xs[NT][2][2 * U];
    uint2 xv[U][NT][2];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
            for (int h = 0; h < U / 2; ++h) {
                const float4 a = *reinterpret_cast<const float4*>(s.ps[t][e] + 4 * h);
                xs[t][e][4 * h] = a.x, xs[t][e][4 * h + 1] = a.y;
                xs[t][e][4 * h + 2] = a.z, xs[t][e][4 * h + 3] = a.w;
            }
            s.ps[t][e] += 2 * U;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            xv[u][t][0] = *reinterpret_cast<const uint2*>(s.px[t] + 64 * u + o0);
            xv[u][t][1] = *reinterpret_cast<const uint2*>(s.px[t] + 64 * u + 32 + o1);
        }
        s.px[t] += 64 * U;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        // Trade the last 8 bytes with lane q ^ 2: (own, theirs) per row.
        const u32 ta0 = __shfl_xor_sync(0xffffffffu, w.wa[u].z, 2);
        const u32 ta1 = __shfl_xor_sync(0xffffffffu, w.wa[u].w, 2);
        const u32 tb0 = __shfl_xor_sync(0xffffffffu, w.wb[u].z, 2);
        const u32 tb1 = __shfl_xor_sync(0xffffffffu, w.wb[u].w, 2);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            // Block j's 8 bytes of rows g and g + 8: own for the loading lanes.
            const bool own = (j == 0) == first;
            const uint2 a = own ? make_uint2(w.wa[u].x, w.wa[u].y) : make_uint2(ta0, ta1);
            const uint2 c8 = own ? make_uint2(w.wb[u].x, w.wb[u].y) : make_uint2(tb0, tb1);
            const float sa = h2f((u16)(j == 0 ? w.sa2[u] & 0xffffu : w.sa2[u] >> 16));
            const float sb = h2f((u16)(j == 0 ? w.sb2[u] & 0xffffu : w.sb2[u] >> 16));
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const uint2 x = xv[u][t][j];
                int c[4] = {0, 0, 0, 0};
                tmma_s8(c, a.x, c8.x, a.y, c8.y, x.x, x.y);
                const float x0 = xs[t][0][2 * u + j];
                const float x1 = xs[t][1][2 * u + j];
                // As q8_block_dot: (weight scale · activation scale) · integer sum.
                s.acc[t][0] += (sa * x0) * (float)c[0];
                s.acc[t][1] += (sa * x1) * (float)c[1];
                s.acc[t][2] += (sb * x0) * (float)c[2];
                s.acc[t][3] += (sb * x1) * (float)c[3];
            }
        }
    }
}

// NT 8-token tiles (1: ≤ 8 tokens, 2: ≤ 16). Parameters as Q8_TOK_KERNEL's; cols a
// multiple of 256 and the activations' token and group strides of 128 (16-byte scale
// loads; the launcher checks).
//
// A warp steps over pairs of blocks: lane (g, q) loads 16 bytes at 16q of the pair's 64
// bytes of rows g and g + 8 (64 contiguous bytes a row and step: 32-byte pieces of
// scattered rows used only half of each DRAM access, and this kernel ran at half the
// one-token kernel's bandwidth). Lanes q < 2 then hold block 0, q ≥ 2 block 1; each
// keeps its first 8 bytes and trades its last 8 with lane q ^ 2, so that for block j a
// lane holds 8 bytes at offset o_j(q): block 0 → 0, 16, 8, 24 and block 1 → 8, 24, 0, 16
// for q = 0..3 — a permutation of the block's k, the same for the activations.
//
// Each of a tile's `ks` warps takes a contiguous range of pairs, in steps of U: the
// addresses only advance (a step's first form recomputed 64-bit addresses and
// predicates for every load: ~700 instructions a 4-pair step, of which ~190 loads and
// arithmetic; ncu had the kernel issue-limited at 2–3× a token's bytes-time), and a
// step's weight scales are one load a row. Rows and tokens past the end read row or
// token 0 (valid memory) and are never stored.
template <int NT>
__device__ __forceinline__ void matvec_q8_0_q8_mma_body(
    const i8* __restrict__ qs, const u16* __restrict__ dw, i64 mat_q, i64 mat_d,
    const i8* __restrict__ xq, const float* __restrict__ xd, float* __restrict__ y, int rows,
    int cols, MatSel sel, int ks, int n_tok, i64 gx, i64 gy) {
    __shared__ float red[MMA_TOKENS_MAX_KS][16][8 * NT];  // a block has ≤ 16 warps
    const int grp = blockIdx.y;
    qs += grp * mat_q;
    dw += grp * mat_d;
    xq += grp * gx;
    xd += grp * (gx / 32);
    y += grp * gy;
    const int lane = threadIdx.x, w = threadIdx.y;
    const int g = lane >> 2, q = lane & 3;
    const int tile = w / ks, split = w % ks;
    const int row0 = (blockIdx.x * (blockDim.y / ks) + tile) * 16;
    const int nb = cols / 32, np = nb / 2;
    // U pairs a step: 4 for 8 tokens, 2 for 16 (registers).
    constexpr int U = NT == 1 ? TMMA_UNROLL : TMMA_UNROLL / 2;
    const int chunk = ((np + ks - 1) / ks + U - 1) / U * U;
    const int pbeg = min(np, split * chunk), pend = min(np, pbeg + chunk);
    const i64 xs = sel.x_stride;
    const int ra = row0 + g < rows ? row0 + g : 0;
    const int rb = row0 + g + 8 < rows ? row0 + g + 8 : 0;
    const bool first = q < 2;  // this lane loads block 0 of a pair
    // o_j(q): the offset of this lane's 8 bytes in block j (see above).
    const int o0 = first ? 16 * q : 16 * (q - 2) + 8;
    const int o1 = first ? 16 * q + 8 : 16 * (q - 2);
    TmmaState<NT> s;
    s.pa = qs + (i64)ra * cols + 16 * q + 64 * pbeg;
    s.pb = qs + (i64)rb * cols + 16 * q + 64 * pbeg;
    s.da = dw + (i64)ra * nb + 2 * pbeg;
    s.db = dw + (i64)rb * nb + 2 * pbeg;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int tok = 8 * t + g;
        s.px[t] = xq + (i64)(tok < n_tok ? tok : 0) * xs + 64 * pbeg;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int tc = 8 * t + 2 * q + e;
            s.ps[t][e] = xd + (i64)(tc < n_tok ? tc : 0) * (xs / 32) + 2 * pbeg;
        }
        s.acc[t][0] = s.acc[t][1] = s.acc[t][2] = s.acc[t][3] = 0.f;
    }
    // The first step's weights before the PDL wait (the matrix is plain: nothing the
    // previous kernel writes), as the one-token kernels.
    // (np is a multiple of 4 and chunk of U, so a range is whole steps.)
    const int nfull = (pend - pbeg) / U;
    TmmaW<U> wt;
    if (nfull > 0) tmma_load_w<NT, U, true>(wt, s);
    PDL_WAIT();
    for (int i = 0; i < nfull; ++i) {
        if (i > 0) tmma_load_w<NT, U>(wt, s);
        tmma_compute<NT, U>(wt, s, o0, o1, first);
    }
    PDL_TRIGGER();
    mma_tile_store<NT>(red, s.acc, row0, rows, n_tok, y, sel.y_stride, ks, split);
}

#define Q8_MMA_KERNEL(NAME, NT)                                                             \
    extern "C" __global__ void __launch_bounds__(512) NAME(                                 \
        const i8* __restrict__ qs, const u16* __restrict__ dw, i64 mat_q, i64 mat_d,       \
        const i8* __restrict__ xq, const float* __restrict__ xd, float* __restrict__ y,    \
        int rows, int cols, MatSel sel, int ks, int n_tok, i64 gx, i64 gy) {               \
        matvec_q8_0_q8_mma_body<NT>(qs, dw, mat_q, mat_d, xq, xd, y, rows, cols, sel, ks,  \
                                    n_tok, gx, gy);                                        \
    }
Q8_MMA_KERNEL(matvec_q8_0_q8_mma8, 1)
Q8_MMA_KERNEL(matvec_q8_0_q8_mma16, 2)
