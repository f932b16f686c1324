// 8 to 16 tokens (a batched step over sessions, a long multi-row step) of a plain F16
// matrix with f32 activations on tf32 tensor cores (`f16_mma`): mma.m16n8k8 of 16
// weight rows × 8 columns against 8 tokens, each activation as tf32 hi + lo (hi =
// tf32(x), lo = tf32(x − hi): ~22 bits, f32-grade; F16 weights are exact in tf32), the
// products accumulated in f32.
//
// Why: matvec_f16_t8/16 (FMA) load each weight once but every token's 8 activation floats
// per 8 weights through L1 (T·32 bytes of activations per 16 weight bytes), and took ~16
// µs a launch in an 8-session step against ~5 for one token (PDL-off trace, H200,
// NOTES session 23). Here a warp's 16 rows share each token's loads and two mma a k8
// step replace 16·8·8 FMA.
//
// The sums are not the FMA kernels' (another order, tf32 split products): the check is
// against them and an f64 product within the f32 bound (gpu-selftest `tokens`).
//
// Layout: warp tile = 16 rows, `ks` warps of a block split a tile's 32-column spans and
// add through shared memory in a fixed order (as mma_tokens.cu). Lane (g = lane / 4,
// t = lane % 4) loads the 8 weights 8t..8t+7 of a span of rows g and g + 8 (16 bytes
// each) and token g's 8 activations at the same columns; in k8 step j of the span the
// mma's column t is span column 8t + 2j and column t + 4 is 8t + 2j + 1 — a permutation
// of the span's k, the same for weights and activations, which a dot product does not
// see. Accumulator c[i]: row g (+8 for i ≥ 2), token 2t + (i & 1) of the 8-token tile.
#include "common.cuh"

#define F16MMA_SPANS 2  // spans a warp has in flight per step

// Each of a tile's `ks` warps takes a contiguous range of spans, whole steps of U: the
// addresses only advance and no load is predicated (rows and tokens past the end read
// row or token 0, valid memory, and are never stored). The first form recomputed
// addresses and predicates for every load: ~290 instructions a 2-span step, of which
// ~100 loads and arithmetic.
template <int NT>
__device__ __forceinline__ void matvec_f16_mma_body(const u16* __restrict__ w,
                                                    const float* __restrict__ x,
                                                    float* __restrict__ y, int rows, int cols,
                                                    MatSel sel, int ks, int n_tok) {
    __shared__ float red[MMA_TOKENS_MAX_KS][16][8 * NT];
    const int lane = threadIdx.x, wq = threadIdx.y;
    const int g = lane >> 2, t = lane & 3;
    const int tile = wq / ks, split = wq % ks;
    const int row0 = (blockIdx.x * (blockDim.y / ks) + tile) * 16;
    constexpr int U = F16MMA_SPANS;
    const int ns = cols / 32;  // even (cols a multiple of 64: the launcher checks)
    const int chunk = ((ns + ks - 1) / ks + U - 1) / U * U;
    const int sbeg = min(ns, split * chunk), send = min(ns, sbeg + chunk);
    const int nsteps = (send - sbeg) / U;
    const int ra = row0 + g < rows ? row0 + g : 0;
    const int rb = row0 + g + 8 < rows ? row0 + g + 8 : 0;
    // (A warp without spans loads its row's first step before the wait, unused: the
    // load is unconditional, or ptxas moves the wait above it.)
    const int s0 = nsteps > 0 ? sbeg : 0;
    const u16* pa = w + (i64)ra * cols + 8 * t + 32 * s0;
    const u16* pb = w + (i64)rb * cols + 8 * t + 32 * s0;
    const i64 xs = sel.x_stride;
    const float* px[NT];
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) {
        const int tok = 8 * tt + g;
        px[tt] = x + (i64)(tok < n_tok ? tok : 0) * xs + 8 * t + 32 * sbeg;
    }
    float acc[NT][4];
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) acc[tt][0] = acc[tt][1] = acc[tt][2] = acc[tt][3] = 0.f;
    uint4 wa[U], wb[U];
    // A step's weights (the matrix is plain: the first step's are loaded before the PDL
    // wait, as the one-token F16 kernel's).
    // (early: before PDL_WAIT, by ld_early16, which the compiler keeps ahead of it.)
    auto load_w = [&](bool early) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (early) {
                wa[u] = ld_early16(pa + 32 * u);
                wb[u] = ld_early16(pb + 32 * u);
            } else {
                wa[u] = ld_stream16(pa + 32 * u);
                wb[u] = ld_stream16(pb + 32 * u);
            }
        }
        pa += 32 * U;
        pb += 32 * U;
    };
    load_w(true);
    PDL_WAIT_AFTER_LOADS(rows < 0);
    for (int i = 0; i < nsteps; ++i) {
        float4 xv[U][NT][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int tt = 0; tt < NT; ++tt) {
                const float4* p = reinterpret_cast<const float4*>(px[tt] + 32 * u);
                xv[u][tt][0] = p[0];
                xv[u][tt][1] = p[1];
            }
        }
#pragma unroll
        for (int tt = 0; tt < NT; ++tt) px[tt] += 32 * U;
        uint4 ca[U], cb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            ca[u] = wa[u];
            cb[u] = wb[u];
        }
        if (i + 1 < nsteps) load_w(false);  // the next step's weights while this one is multiplied
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 va[4] = {ca[u].x, ca[u].y, ca[u].z, ca[u].w};
            const u32 vb[4] = {cb[u].x, cb[u].y, cb[u].z, cb[u].w};
#pragma unroll
            for (int tt = 0; tt < NT; ++tt) {
                const float xx[8] = {xv[u][tt][0].x, xv[u][tt][0].y, xv[u][tt][0].z,
                                     xv[u][tt][0].w, xv[u][tt][1].x, xv[u][tt][1].y,
                                     xv[u][tt][1].z, xv[u][tt][1].w};
                // A fresh partial a span, added to the sums in f32 (the tensor cores'
                // own accumulation over a whole row lost ~1e-6: NOTES session 23).
                float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // Weights 2j, 2j + 1 of the lane's 8 (one u32 of two halves).
                    const float a0 = h2f((u16)(va[j] & 0xffffu)), a2 = h2f((u16)(va[j] >> 16));
                    const float a1 = h2f((u16)(vb[j] & 0xffffu)), a3 = h2f((u16)(vb[j] >> 16));
                    const float h0 = mm_tf32(xx[2 * j]), h1 = mm_tf32(xx[2 * j + 1]);
                    const float l0 = mm_tf32(xx[2 * j] - h0), l1 = mm_tf32(xx[2 * j + 1] - h1);
                    mm_mma_tf32(part, a0, a1, a2, a3, l0, l1);
                    mm_mma_tf32(part, a0, a1, a2, a3, h0, h1);
                }
#pragma unroll
                for (int i2 = 0; i2 < 4; ++i2) acc[tt][i2] += part[i2];
            }
        }
    }
    PDL_TRIGGER();
    mma_tile_store<NT>(red, acc, row0, rows, n_tok, y, sel.y_stride, ks, split);
}

#define F16_MMA_KERNEL(NAME, NT)                                                           \
    extern "C" __global__ void __launch_bounds__(512) NAME(                                \
        const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,    \
        int rows, int cols, MatSel sel, int ks, int n_tok) {                              \
        matvec_f16_mma_body<NT>(w, x, y, rows, cols, sel, ks, n_tok);                     \
    }
F16_MMA_KERNEL(matvec_f16_mma8, 1)
F16_MMA_KERNEL(matvec_f16_mma16, 2)
