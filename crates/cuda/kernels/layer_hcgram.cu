#include "common.cuh"

// ---- The HC boundary with one reduction on its chain (`hc_gram`, fast numerics).
//
// A sublayer ends with hc_post (H'_j = o·post_j + Σ_i comb[i][j]·H_i, element-wise),
// and the next one starts by reducing over all of H' twice: hc_mix (24 blocks: the dots
// fn_k·H' and |H'|²), then hc_pre (one block: y = Σ_j pre_j·H'_j, whose RMS norm needs
// |y|² once pre is known). Both reductions are sums over the columns of a few products
// of H' values, so they can be formed where H' is:
//   - mix_k = (fn_k·H') / rms(H'), with fn_k·H' = Σ_d Σ_j fn_k[j·n + d]·H'_j[d];
//   - |H'|² = Σ_j G_jj and |y|² = Σ_jj' pre_j·pre_j'·G_jj', with G_jj' = H'_j·H'_j'.
// hc_post_gram writes, per block of columns, those 24 dots and the 10 products G_jj'
// (j ≤ j'). hc_start_gram's blocks each add all the blocks' shares (a few KB), then form
// the mix, pre, |y|² and their own columns of y, its norm and its Q8_0 form. The chain
// goes from four launches (hc_post, hc_mix, hc_pre and the first product) with two
// grid-wide waits between them to three with one. The sums are in another order than
// hc_mix / hc_pre's (|y|² from the Gram products instead of over y), so this is a
// fast-numerics form, checked against them within the tier.

// A block's share of one token: the 24 dots fn_k·H' over its columns, then G_jj' for
// (0,0) (0,1) (0,2) (0,3) (1,1) (1,2) (1,3) (2,2) (2,3) (3,3).
__device__ __forceinline__ int hcg_pair(int j, int jj) {
    // index of G_{j,jj} (j ≤ jj) after the mix dots
    return HCG_MIX + j * HCG_STREAMS - j * (j - 1) / 2 + (jj - j);
}

// One raw 32-bit word of a small dense weight (F16/BF16 zero-extended), converted after
// the PDL wait so that the loads are not each followed by their use.
__device__ __forceinline__ u32 hcg_raw(const void* w, int type, i64 i) {
    if (type == WT_F16 || type == WT_BF16) return reinterpret_cast<const u16*>(w)[i];
    return reinterpret_cast<const u32*>(w)[i];
}
__device__ __forceinline__ float hcg_cvt(u32 r, int type) {
    if (type == WT_F16) return h2f((u16)r);
    if (type == WT_BF16) return __uint_as_float(r << 16);
    return __uint_as_float(r);
}

// POST (hc_post_gram): hc_post of one column a thread (hc_post_pl's sums and
// roundings, so H' is bit-identical to it) and the block's share of the next mix and of
// the Gram products into gram[token][block][HCG_PARTS]. fn: the next sublayer's mix
// weights (HCG_MIX rows of HCG_STREAMS·n_embd, stream-major), loaded before the PDL
// wait. Without POST (hc_gram_shares): the shares of the streams h as they are (a
// sublayer whose predecessor formed none: the first layer, a split model's first layer
// on a GPU, the MTP block), the same sums over the same values, so that every
// sublayer start under `hc_gram` has the same bits wherever the model is cut.
template <bool POST>
__device__ __forceinline__ void hc_gram_body(const float* h, const float* out,
                                             const float* parts, int n_parts, const float* hcp,
                                             int n_embd, float* h_out, const void* fn,
                                             int fn_type, float* gram) {
    constexpr int S = HCG_STREAMS, M = HCG_MIX;
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    const bool on = d < n_embd;
    u32 wraw[M][S];
#pragma unroll
    for (int k = 0; k < M; ++k)
#pragma unroll
        for (int j = 0; j < S; ++j)
            wraw[k][j] = on ? hcg_raw(fn, fn_type, (i64)k * S * n_embd + (i64)j * n_embd + d) : 0u;
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    float hn[S] = {0.f, 0.f, 0.f, 0.f};
    if (!POST) {
        h += (i64)blockIdx.y * S * n_embd;
        if (on) {
#pragma unroll
            for (int j = 0; j < S; ++j) hn[j] = h[(i64)j * n_embd + d];
        }
    } else if (on) {
        hc_post_rows(blockIdx.y, S, n_embd, n_parts, h, h_out, out, parts, hcp);
        float post[HC_MAX], comb[HC_MAX][HC_MAX], hv[HC_MAX];
        hc_post_coefs(hcp, S, post, comb);
        hc_post_column(h, out, parts, n_parts, S, n_embd, d, post, comb, h_out, hv);
#pragma unroll
        for (int jj = 0; jj < S; ++jj) hn[jj] = hv[jj];
    }
    // The 32 first values through warp_sums (24 dots, 8 Gram products), the last two
    // Gram products through warp_sum.
    float v[32];
#pragma unroll
    for (int k = 0; k < M; ++k) {
        float a = 0.f;
#pragma unroll
        for (int j = 0; j < S; ++j) a += hcg_cvt(wraw[k][j], fn_type) * hn[j];
        v[k] = a;
    }
    float g8 = 0.f, g9 = 0.f;
#pragma unroll
    for (int j = 0; j < S; ++j)
#pragma unroll
        for (int jj = j; jj < S; ++jj) {
            const int p = hcg_pair(j, jj);
            const float x = hn[j] * hn[jj];
            if (p < 32) v[p] = x;
            else if (p == 32) g8 = x;
            else g9 = x;
        }
    int first;
    warp_sums<32>(v, first);
    g8 = warp_sum(g8);
    g9 = warp_sum(g9);
    __shared__ float red[HCG_POST_THREADS / WARP][HCG_PARTS];
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    red[wid][first] = v[0];
    if (lane == 0) {
        red[wid][32] = g8;
        red[wid][33] = g9;
    }
    __syncthreads();
    if (threadIdx.x < HCG_PARTS) {
        float s = 0.f;
        for (int w = 0; w < (int)(blockDim.x / WARP); ++w) s += red[w][threadIdx.x];
        gram[((i64)blockIdx.y * gridDim.x + blockIdx.x) * HCG_PARTS + threadIdx.x] = s;
    }
}

extern "C" __global__ void __launch_bounds__(HCG_POST_THREADS) hc_post_gram(
    const float* h, const float* out, const float* parts, int n_parts, const float* hcp,
    int n_embd, float* h_out, const void* fn, int fn_type, float* gram) {
    hc_gram_body<true>(h, out, parts, n_parts, hcp, n_embd, h_out, fn, fn_type, gram);
}

extern "C" __global__ void __launch_bounds__(HCG_POST_THREADS) hc_gram_shares(
    const float* h, int n_embd, const void* fn, int fn_type, float* gram) {
    hc_gram_body<false>(h, nullptr, nullptr, 0, nullptr, n_embd, nullptr, fn, fn_type, gram);
}

// The next sublayer's start from hc_post_gram's shares (n_blocks of them a token): the
// mix (block 0 writes it, for hc_comb), pre, the RMS factors, and this block's columns
// (4 a thread, 8 threads a Q8_0 block) of y = Σ_j pre_j·H'_j (in hc_pre's order),
// norm_out = rmsnorm(y)·norm_w and, with q set, its Q8_0 form (q, qd).
extern "C" __global__ void __launch_bounds__(HCG_START_THREADS) hc_start_gram(
    const float* hn, const float* gram, int n_blocks, const float* scale, const float* base,
    int n_embd, float hc_eps, float mix_eps, float* mix, const void* norm_w, int norm_type,
    float norm_eps, float* norm_out, i8* q, float* qd) {
    constexpr int S = HCG_STREAMS, M = HCG_MIX;
    const int t = threadIdx.x;
    const int i0 = 4 * (blockIdx.x * blockDim.x + t);
    const bool on = i0 < n_embd;
    float nw[4] = {1.f, 1.f, 1.f, 1.f};
    if (on && norm_w) {
#pragma unroll
        for (int k = 0; k < 4; ++k) nw[k] = ldw(norm_w, norm_type, i0 + k);
    }
    const float s0 = scale[0];
    float bv[S];
#pragma unroll
    for (int j = 0; j < S; ++j) bv[j] = base[j];
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const i64 tok = blockIdx.y;
    hn += tok * S * n_embd;
    gram += tok * n_blocks * HCG_PARTS;
    float4 hv[S];
    if (on) {
#pragma unroll
        for (int j = 0; j < S; ++j) hv[j] = ldx4(hn + (i64)j * n_embd + i0);
    }
    __shared__ float tot[HCG_PARTS];
    if (t < HCG_PARTS) {
        // The blocks' shares in block order; the loads go out together.
        float s = 0.f;
        int b = 0;
        for (; b + 8 <= n_blocks; b += 8) {
            float x[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) x[u] = gram[(i64)(b + u) * HCG_PARTS + t];
#pragma unroll
            for (int u = 0; u < 8; ++u) s += x[u];
        }
        for (; b < n_blocks; ++b) s += gram[(i64)b * HCG_PARTS + t];
        tot[t] = s;
    }
    __syncthreads();
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < S; ++j) ss += tot[hcg_pair(j, j)];
    const float rs = 1.0f / sqrtf(ss / (float)(S * n_embd) + mix_eps);
    if (blockIdx.x == 0 && t < M) mix[tok * M + t] = tot[t] * rs;
    float pre[S];
#pragma unroll
    for (int j = 0; j < S; ++j) pre[j] = sigmoidf_(tot[j] * rs * s0 + bv[j]) + hc_eps;
    float yy = 0.f;
#pragma unroll
    for (int j = 0; j < S; ++j) {
        yy += pre[j] * pre[j] * tot[hcg_pair(j, j)];
#pragma unroll
        for (int jj = j + 1; jj < S; ++jj) yy += 2.f * pre[j] * pre[jj] * tot[hcg_pair(j, jj)];
    }
    const float sc = 1.0f / sqrtf(yy / (float)n_embd + norm_eps);
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    if (on) {
        float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < S; ++j) {
            a[0] += pre[j] * hv[j].x;
            a[1] += pre[j] * hv[j].y;
            a[2] += pre[j] * hv[j].z;
            a[3] += pre[j] * hv[j].w;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            o[k] = a[k] * sc;
            if (norm_w) o[k] = o[k] * nw[k];
        }
        *reinterpret_cast<float4*>(norm_out + tok * n_embd + i0) = make_float4(o[0], o[1], o[2], o[3]);
    }
    if (q != nullptr)
        quant_block32_x4(o, on, q + tok * n_embd + i0, qd + tok * (n_embd / 32) + i0 / 32);
}
