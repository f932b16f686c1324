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

#define TMMA_UNROLL 4
// (MMA_TOKENS_MAX_KS: ds4_consts.h.)

__device__ __forceinline__ void tmma_s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                        u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// NT 8-token tiles (1: ≤ 8 tokens, 2: ≤ 16). Parameters as Q8_TOK_KERNEL's; cols a
// multiple of 64.
//
// A warp steps over pairs of blocks: lane (g, q) loads 16 bytes at 16q of the pair's 64
// bytes of rows g and g + 8 (64 contiguous bytes a row and step: 32-byte pieces of
// scattered rows used only half of each DRAM access, and this kernel ran at half the
// one-token kernel's bandwidth). Lanes q < 2 then hold block 0, q ≥ 2 block 1; each
// keeps its first 8 bytes and trades its last 8 with lane q ^ 2, so that for block j a
// lane holds 8 bytes at offset o_j(q): block 0 → 0, 16, 8, 24 and block 1 → 8, 24, 0, 16
// for q = 0..3 — a permutation of the block's k, the same for the activations.
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
    const i64 xs = sel.x_stride;
    const int ra = row0 + g, rb = row0 + g + 8;
    const bool oka = ra < rows, okb = rb < rows;
    const i8* pa = qs + (i64)(oka ? ra : 0) * cols + 16 * q;
    const i8* pb = qs + (i64)(okb ? rb : 0) * cols + 16 * q;
    const u16* da = dw + (i64)(oka ? ra : 0) * nb;
    const u16* db = dw + (i64)(okb ? rb : 0) * nb;
    const bool first = q < 2;  // this lane loads block 0 of a pair
    // o_j(q): the offset of this lane's 8 bytes in block j (see above).
    const int o0 = first ? 16 * q : 16 * (q - 2) + 8;
    const int o1 = first ? 16 * q + 8 : 16 * (q - 2);
    const i8* px[NT];
    bool okx[NT];
    int tc[NT][2];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int tok = 8 * t + g;
        okx[t] = tok < n_tok;
        px[t] = xq + (i64)(okx[t] ? tok : 0) * xs;
        tc[t][0] = 8 * t + 2 * q;
        tc[t][1] = 8 * t + 2 * q + 1;
    }
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
    const uint2 zero = make_uint2(0u, 0u);
    PDL_WAIT();
    // A step of U pairs issues all its loads first — weights, their scales, the
    // tokens' activations and scales — then computes: with the activation loads after
    // each pair's shuffles (behind the `break` of a short last step) every pair paid an
    // L1/L2 round trip on top of the step's DRAM one (ncu: long-scoreboard stalls 7–8
    // cycles an instruction). U = 4 pairs for 8 tokens, 2 for 16 (registers).
    constexpr int U = NT == 1 ? TMMA_UNROLL : TMMA_UNROLL / 2;
    for (int p0 = split; p0 < np; p0 += U * ks) {
        uint4 wa[U], wb[U];
        u32 sa2[U], sb2[U];
        float2 xs2[U][NT][2];
        uint2 xv[U][NT][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int p = p0 + u * ks;
            const bool live = p < np;
            wa[u] = live && oka ? ld_stream16(pa + p * 64) : zero4;
            wb[u] = live && okb ? ld_stream16(pb + p * 64) : zero4;
            // The pair's two weight scales of each row and two activation scales of each
            // token in one load apiece (cols and the token stride are multiples of 64).
            sa2[u] = live && oka ? *reinterpret_cast<const u32*>(da + 2 * p) : 0u;
            sb2[u] = live && okb ? *reinterpret_cast<const u32*>(db + 2 * p) : 0u;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    xs2[u][t][e] = live && tc[t][e] < n_tok
                        ? *reinterpret_cast<const float2*>(xd + tc[t][e] * (xs / 32) + 2 * p)
                        : make_float2(0.f, 0.f);
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    xv[u][t][j] = live && okx[t]
                        ? *reinterpret_cast<const uint2*>(px[t] + (2 * p + j) * 32 +
                                                          (j == 0 ? o0 : o1))
                        : zero;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (p0 + u * ks >= np) break;  // the same for every lane of the warp
            // Trade the last 8 bytes with lane q ^ 2: (own, theirs) per row.
            const u32 ta0 = __shfl_xor_sync(0xffffffffu, wa[u].z, 2);
            const u32 ta1 = __shfl_xor_sync(0xffffffffu, wa[u].w, 2);
            const u32 tb0 = __shfl_xor_sync(0xffffffffu, wb[u].z, 2);
            const u32 tb1 = __shfl_xor_sync(0xffffffffu, wb[u].w, 2);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                // Block j's 8 bytes of rows g and g + 8: own for the loading lanes.
                const bool own = (j == 0) == first;
                const uint2 a = own ? make_uint2(wa[u].x, wa[u].y) : make_uint2(ta0, ta1);
                const uint2 c8 = own ? make_uint2(wb[u].x, wb[u].y) : make_uint2(tb0, tb1);
                // (A missing row's scales are 0: its loads were skipped.)
                const float sa = h2f((u16)(j == 0 ? sa2[u] & 0xffffu : sa2[u] >> 16));
                const float sb = h2f((u16)(j == 0 ? sb2[u] & 0xffffu : sb2[u] >> 16));
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const uint2 x = xv[u][t][j];
                    int c[4] = {0, 0, 0, 0};
                    tmma_s8(c, a.x, c8.x, a.y, c8.y, x.x, x.y);
                    const float x0 = j == 0 ? xs2[u][t][0].x : xs2[u][t][0].y;
                    const float x1 = j == 0 ? xs2[u][t][1].x : xs2[u][t][1].y;
                    // As q8_block_dot: (weight scale · activation scale) · integer sum.
                    acc[t][0] += (sa * x0) * (float)c[0];
                    acc[t][1] += (sa * x1) * (float)c[1];
                    acc[t][2] += (sb * x0) * (float)c[2];
                    acc[t][3] += (sb * x1) * (float)c[3];
                }
            }
        }
    }
    PDL_TRIGGER();
    mma_tile_store<NT>(red, acc, row0, rows, n_tok, y, sel.y_stride, ks, split);
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
