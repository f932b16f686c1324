// The hyper-connection mix of a prefill chunk in one pass over H (variant `hc_mix_tc`):
// mix[t][r] = (fn_r · h_t) / rms(h_t) for the ≤ 24 rows of an F16 `hc_*_fn`.
//
// Why: the chunk's path was the generic tf32 GEMM (mm_tc_f16_p_s8: 64 × 64 tiles, of
// which the 24 rows fill 3/8, split over 8 blocks of k) and then hc_mix_scale, which
// reads H a second time for the sums of squares: 107 + 60 µs a 2,048-token launch,
// against ~31 µs to read H's 134 MB once on an H200. Here a block is 16 tokens and
// 8 warps that split k; each warp reads its tokens' values straight into the
// m16n8k8 A fragments (no shared memory), squares them on the way, and the block
// adds the warps' partials in a fixed order and applies the RMS factor.
//
// Numerics are the tf32 GEMM's: F16 weights are exact in tf32, each activation is its
// tf32 part plus the tf32 of the remainder (two mma a product, weight × lo then
// × hi), and each 32-wide k-span sums into a fresh partial that is then added in f32
// (the tensor cores' f32 accumulation truncates; the two-level sum keeps the error at
// ~1e-6 over k = 16,384).
//
// The k order: a lane's float4 of 4 consecutive values serves two k8 steps, its first
// two values as the fragment's columns (t, t + 4) of one step and the last two of the
// next; the weight fragment takes its columns in the same order, so each operand is
// one contiguous load (16 bytes of H, 8 bytes of fn) a lane and k16.

#include "common.cuh"

#define HX_WARPS 8
#define HX_TOK 16

__device__ __forceinline__ float hx_h2f(u32 w, int hi) {
    return h2f((u16)(hi ? w >> 16 : w & 0xffff));
}

// NT n-tiles of 8 weight rows (rows ≤ 8·NT). h: n_tok rows of n floats, x_tok apart
// (16-byte aligned); fn: rows × n F16; n % 64 == 0. rms = 0: plain products (no 1/rms).
template <int NT>
__device__ __forceinline__ void hc_mix_tc_body(const float* __restrict__ h, i64 x_tok, int n,
                                               const u16* __restrict__ fn, int rows, float eps,
                                               int rms, float* __restrict__ out, i64 y_tok,
                                               int n_tok) {
    __shared__ float red[HX_WARPS][HX_TOK][8 * NT + 1];
    __shared__ float rss[HX_WARPS][HX_TOK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tok0 = blockIdx.x * HX_TOK;
    // Rows of the fragment past the chunk read its last token (never stored).
    const int ta = min(tok0 + g, n_tok - 1), tb = min(tok0 + g + 8, n_tok - 1);
    const float* pa = h + (i64)ta * x_tok + 4 * t;
    const float* pb = h + (i64)tb * x_tok + 4 * t;
    const u16* pw[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) pw[j] = fn + (i64)min(8 * j + g, rows - 1) * n + 4 * t;

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
    float ssa = 0.f, ssb = 0.f;

    // Two iterations of 64 values in flight: the next one's loads are issued before
    // the current one's products.
    float4 xa[4], xb[4];
    uint2 wv[NT][4];
    auto load = [&](int it) {
        const int k0 = it * 64;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            xa[c] = __ldcs(reinterpret_cast<const float4*>(pa + k0 + 16 * c));
            xb[c] = __ldcs(reinterpret_cast<const float4*>(pb + k0 + 16 * c));
        }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c)
                wv[j][c] = __ldg(reinterpret_cast<const uint2*>(pw[j] + k0 + 16 * c));
    };
    const int nk = n / 64;
    PDL_WAIT();
    if (warp < nk) load(warp);
    for (int it = warp; it < nk; it += HX_WARPS) {
        float4 ca[4], cb[4];
        uint2 cw[NT][4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            ca[c] = xa[c];
            cb[c] = xb[c];
#pragma unroll
            for (int j = 0; j < NT; ++j) cw[j][c] = wv[j][c];
        }
        if (it + HX_WARPS < nk) load(it + HX_WARPS);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float part[NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[j][i] = 0.f;
#pragma unroll
            for (int c = 2 * half; c < 2 * half + 2; ++c) {
                const float va[4] = {ca[c].x, ca[c].y, ca[c].z, ca[c].w};
                const float vb[4] = {cb[c].x, cb[c].y, cb[c].z, cb[c].w};
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const float a0 = va[2 * s], a1 = vb[2 * s], a2 = va[2 * s + 1],
                                a3 = vb[2 * s + 1];
                    ssa = fmaf(a0, a0, ssa);
                    ssa = fmaf(a2, a2, ssa);
                    ssb = fmaf(a1, a1, ssb);
                    ssb = fmaf(a3, a3, ssb);
                    const float h0 = mm_tf32(a0), h1 = mm_tf32(a1), h2 = mm_tf32(a2),
                                h3 = mm_tf32(a3);
                    const float l0 = mm_tf32(a0 - h0), l1 = mm_tf32(a1 - h1),
                                l2 = mm_tf32(a2 - h2), l3 = mm_tf32(a3 - h3);
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        const u32 w = s ? cw[j][c].y : cw[j][c].x;
                        const float b0 = hx_h2f(w, 0), b1 = hx_h2f(w, 1);
                        mm_mma_tf32(part[j], l0, l1, l2, l3, b0, b1);
                        mm_mma_tf32(part[j], h0, h1, h2, h3, b0, b1);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[j][i] += part[j][i];
        }
    }
    PDL_TRIGGER();

    // A token's sum of squares is spread over the 4 lanes of its quad.
    ssa += __shfl_xor_sync(0xffffffffu, ssa, 1);
    ssa += __shfl_xor_sync(0xffffffffu, ssa, 2);
    ssb += __shfl_xor_sync(0xffffffffu, ssb, 1);
    ssb += __shfl_xor_sync(0xffffffffu, ssb, 2);
    if (t == 0) {
        rss[warp][g] = ssa;
        rss[warp][g + 8] = ssb;
    }
    // acc[j]: (token g, rows 8j + 2t, +1), (token g + 8, the same rows).
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        red[warp][g][8 * j + 2 * t] = acc[j][0];
        red[warp][g][8 * j + 2 * t + 1] = acc[j][1];
        red[warp][g + 8][8 * j + 2 * t] = acc[j][2];
        red[warp][g + 8][8 * j + 2 * t + 1] = acc[j][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < HX_TOK * rows; i += blockDim.x) {
        const int tk = i / rows, r = i - tk * rows;
        if (tok0 + tk >= n_tok) break;
        float s = 0.f, ss = 0.f;
#pragma unroll
        for (int w = 0; w < HX_WARPS; ++w) {
            s += red[w][tk][r];
            ss += rss[w][tk];
        }
        const float f = rms ? 1.0f / sqrtf(ss / (float)n + eps) : 1.0f;
        out[(i64)(tok0 + tk) * y_tok + r] = s * f;
    }
}

// The HC mix (≤ 24 rows, with the RMS factor). A block of HX_WARPS warps a 16 tokens.
extern "C" __global__ void __launch_bounds__(HX_WARPS * 32)
    hc_mix_tc(const float* __restrict__ h, i64 x_tok, int n, const u16* __restrict__ fn,
              int rows, float eps, float* __restrict__ out, i64 y_tok, int n_tok) {
    hc_mix_tc_body<3>(h, x_tok, n, fn, rows, eps, 1, out, y_tok, n_tok);
}
