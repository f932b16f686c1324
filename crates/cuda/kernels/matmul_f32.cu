#include "common.cuh"

// ---------------------------------------------------------------------------------------
// f32 activations × F32/F16/BF16/Q8_0 weights: 64 rows × 64 tokens per block, k-tiles of
// 32, 256 threads with 4×4 outputs each, f32 FMAs in k order within a k-tile, tile
// partials summed in order (a two-level f32 dot product). Weights are converted to f32 on the way into shared
// memory; the next tile is fetched into registers during the current one.

#define MF_WT_F32 0
#define MF_WT_F16 1
#define MF_WT_BF16 2
#define MF_WT_Q8_0 3

__device__ __forceinline__ float mm_bf2f(u32 h) { return __int_as_float(h << 16); }

// TC: tensor cores for F16 / BF16 weights, which tf32 holds exactly; the activation is
// split into a tf32 part and its f32 remainder (two mma per product), so products
// carry ~22 bits of the activation: the f32 result to ~1e-6 instead of tf32's 1e-3.
// Warp w takes rows 32·(w & 1) … +31 and tokens 16·(w >> 1) … +15 of the 64×64 tile.
// SPREAD (mm_tc_*_p, `mm_pitch`): row stride 88 with k-row k's values shifted by
// 8·(k >> 3) columns. With stride 72 the loader's transposed stores (lanes: 8 rows ×
// 4 k-groups, k = 8·(lane & 3) + i) hit 8 banks, 4-way conflicts on 16 stores a thread
// and k-tile; with 88 + the shift they hit 32, and the fragment reads stay conflict-free
// (24·c + g spans 32 banks). The same values are read: the same sums.
template <int WT, int S, bool TC, bool SPREAD = false>
__device__ __forceinline__ void mm_f32_body(const u8* __restrict__ w, const u16* __restrict__ wd,
                                            i64 mat_w, i64 mat_d, const float* __restrict__ x,
                                            float* __restrict__ y, int rows, int cols, int n_tok,
                                            i64 x_tok, i64 x_grp, i64 y_tok, i64 y_grp) {
    // Row stride 72 (≡ 8 mod 32 banks): the tf32 fragments (k = lane & 3 (+4), row or
    // token = lane >> 2) read 32 distinct banks.
    constexpr int P = SPREAD ? 88 : 72;
    __shared__ __align__(16) float ws[2][32][P];
    __shared__ __align__(16) float xs[2][32][P];
    // The column shift of k-row k.
    auto sh = [](int k) { return SPREAD ? 8 * (k >> 3) : 0; };
    const int tid = threadIdx.x;
    // Split K over the S blocks of a cluster (z = group·S + split): split s takes k-tiles
    // [s·nkt/S, (s+1)·nkt/S); the partial tiles are summed in split order through
    // distributed shared memory (deterministic, no scratch buffer).
    const int grp = blockIdx.z / S, split = blockIdx.z % S;
    const int n0 = blockIdx.x * 64, m0 = blockIdx.y * 64;
    w += grp * mat_w;
    wd += grp * mat_d;
    x += grp * x_grp;
    y += grp * y_grp;
    const int lr = tid >> 2, lk = (tid & 3) * 8;  // loader: row / token lr, k lk..lk+7
    const int tr = tid & 15, tt = tid >> 4;       // compute: rows 4tr.., tokens 4tt..
    const int nkt_all = (cols + 31) / 32;
    const int kt0 = split * nkt_all / S, nkt = (split + 1) * nkt_all / S - kt0;
    float wv[8], xv[8];
    auto fetch = [&](int kt) {
        const int k = (kt0 + kt) * 32 + lk, row = m0 + lr, t = n0 + lr;
        const bool okw = row < rows && k < cols;
        if (!okw) {
#pragma unroll
            for (int i = 0; i < 8; ++i) wv[i] = 0.f;
        } else if (WT == MF_WT_F32) {
            const float* p = reinterpret_cast<const float*>(w) + (i64)row * cols + k;
            const float4 a = *reinterpret_cast<const float4*>(p);
            const float4 b = *reinterpret_cast<const float4*>(p + 4);
            wv[0] = a.x; wv[1] = a.y; wv[2] = a.z; wv[3] = a.w;
            wv[4] = b.x; wv[5] = b.y; wv[6] = b.z; wv[7] = b.w;
        } else if (WT == MF_WT_Q8_0) {
            const uint2 q = *reinterpret_cast<const uint2*>(w + (i64)row * cols + k);
            const float d = h2f(wd[((i64)row * cols + k) / 32]);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                wv[i] = d * (float)(i8)((q.x >> (8 * i)) & 0xff);
                wv[4 + i] = d * (float)(i8)((q.y >> (8 * i)) & 0xff);
            }
        } else {
            const uint4 h = *reinterpret_cast<const uint4*>(w + ((i64)row * cols + k) * 2);
            const u32 hw[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (WT == MF_WT_F16) {
                    wv[2 * i] = h2f((u16)(hw[i] & 0xffff));
                    wv[2 * i + 1] = h2f((u16)(hw[i] >> 16));
                } else {
                    wv[2 * i] = mm_bf2f(hw[i] & 0xffff);
                    wv[2 * i + 1] = mm_bf2f(hw[i] >> 16);
                }
            }
        }
        if (t < n_tok && k < cols) {
            const float* p = x + (i64)t * x_tok + k;
            const float4 a = *reinterpret_cast<const float4*>(p);
            const float4 b = *reinterpret_cast<const float4*>(p + 4);
            xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
            xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) xv[i] = 0.f;
        }
    };
    auto put = [&](int s) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            ws[s][lk + i][lr + sh(lk)] = wv[i];
            xs[s][lk + i][lr + sh(lk)] = xv[i];
        }
    };
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    if (nkt > 0) fetch(0);
    else {
#pragma unroll
        for (int i = 0; i < 8; ++i) wv[i] = xv[i] = 0.f;
    }
    put(0);
    __syncthreads();
    for (int kt = 0; kt < nkt; ++kt) {
        const int s = kt & 1;
        if (kt + 1 < nkt) fetch(kt + 1);
        // Two-level sum: each 32-wide k-tile in its own partial, then into acc, so the
        // rounding error grows with 32 + K/32 terms rather than K (the decode matvecs'
        // lane partials and warp tree behave alike).
        float part[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) part[i][j] = 0.f;
        if (TC) {
            // part[2·mi + ni]: the m16n8 fragment of rows 32·wr + 16·mi, tokens
            // 16·wt + 8·ni.
            const int lane = tid % WARP, wid = tid / WARP;
            const int g = lane >> 2, c = lane & 3;
            const int rb = 32 * (wid & 1), tb = 16 * (wid >> 1);
#pragma unroll
            for (int k8 = 0; k8 < 32; k8 += 8) {
                float a[2][4], bh[2][2], bl[2][2];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    const int o = rb + 16 * mi + g + sh(k8);
                    a[mi][0] = ws[s][k8 + c][o];
                    a[mi][1] = ws[s][k8 + c][o + 8];
                    a[mi][2] = ws[s][k8 + c + 4][o];
                    a[mi][3] = ws[s][k8 + c + 4][o + 8];
                }
#pragma unroll
                for (int ni = 0; ni < 2; ++ni) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float v = xs[s][k8 + c + 4 * h][tb + 8 * ni + g + sh(k8)];
                        bh[ni][h] = mm_tf32(v);
                        bl[ni][h] = mm_tf32(v - bh[ni][h]);
                    }
                }
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int ni = 0; ni < 2; ++ni) {
                        mm_mma_tf32(part[2 * mi + ni], a[mi][0], a[mi][1], a[mi][2], a[mi][3],
                                    bl[ni][0], bl[ni][1]);
                        mm_mma_tf32(part[2 * mi + ni], a[mi][0], a[mi][1], a[mi][2], a[mi][3],
                                    bh[ni][0], bh[ni][1]);
                    }
            }
        } else {
#pragma unroll 8
        for (int k = 0; k < 32; ++k) {
            const float4 a = *reinterpret_cast<const float4*>(&ws[s][k][4 * tr + sh(k)]);
            const float4 b = *reinterpret_cast<const float4*>(&xs[s][k][4 * tt + sh(k)]);
            FMA_OUTER4(part, a, b, fmaf);
        }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] += part[i][j];
        if (kt + 1 < nkt) put(s ^ 1);
        __syncthreads();
    }
    // Tile row and token of acc[i][j]: a 4×4 register tile, or (TC) element j of
    // fragment i = 2·mi + ni.
    auto row_of = [&](int i, int j) {
        if (!TC) return 4 * tr + i;
        const int lane = tid % WARP;
        return 32 * ((tid / WARP) & 1) + 16 * (i >> 1) + (lane >> 2) + 8 * (j >> 1);
    };
    auto tok_of = [&](int i, int j) {
        if (!TC) return 4 * tt + j;
        const int lane = tid % WARP;
        return 16 * (tid / WARP >> 1) + 8 * (i & 1) + 2 * (lane & 3) + (j & 1);
    };
    if (S == 1) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int t = n0 + tok_of(i, j), r = m0 + row_of(i, j);
                if (t < n_tok && r < rows) y[(i64)t * y_tok + r] = acc[i][j];
            }
        }
        return;
    }
    // Partial tile [token][row] into this block's shared memory (the k-tile buffers are
    // free after the loop's last barrier), then each block sums 4096/S entries over the
    // cluster in split order.
    float* red = &ws[0][0][0];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[tok_of(i, j) * 64 + row_of(i, j)] = acc[i][j];
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    const u32 red_s = mm_smem(red);
    for (int idx = split * (4096 / S) + tid; idx < (split + 1) * (4096 / S); idx += 256) {
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < S; ++q) {
            u32 ra;
            float pv;
            asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(red_s + idx * 4), "r"(q));
            asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(pv) : "r"(ra) : "memory");
            v += pv;
        }
        const int t = n0 + idx / 64, r = m0 + idx % 64;
        if (t < n_tok && r < rows) y[(i64)t * y_tok + r] = v;
    }
    // No block leaves while others may still read its shared memory.
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

#define MM_F32_KERNEL(NAME, WT, S, TC, SPREAD)                                                  \
    extern "C" __global__ void __launch_bounds__(256) __cluster_dims__(1, 1, S) NAME(          \
        const u8* __restrict__ w, const u16* __restrict__ wd, i64 mat_w, i64 mat_d,             \
        const float* __restrict__ x, float* __restrict__ y, int rows, int cols, int n_tok,      \
        i64 x_tok, i64 x_grp, i64 y_tok, i64 y_grp) { PDL_WAIT();                                           \
        mm_f32_body<WT, S, TC, SPREAD>(w, wd, mat_w, mat_d, x, y, rows, cols, n_tok, x_tok,     \
                                       x_grp, y_tok, y_grp);                                    \
    }
#define MM_F32_KERNELS(NAME, WT, TC, SPREAD)                                                    \
    MM_F32_KERNEL(NAME##_s1, WT, 1, TC, SPREAD)                                                 \
    MM_F32_KERNEL(NAME##_s2, WT, 2, TC, SPREAD)                                                 \
    MM_F32_KERNEL(NAME##_s4, WT, 4, TC, SPREAD)                                                 \
    MM_F32_KERNEL(NAME##_s8, WT, 8, TC, SPREAD)
MM_F32_KERNELS(mm_f32_f32, MF_WT_F32, false, false)
MM_F32_KERNELS(mm_f32_f16, MF_WT_F16, false, false)
MM_F32_KERNELS(mm_f32_bf16, MF_WT_BF16, false, false)
MM_F32_KERNELS(mm_f32_q8_0, MF_WT_Q8_0, false, false)
MM_F32_KERNELS(mm_tc_f16, MF_WT_F16, true, false)
MM_F32_KERNELS(mm_tc_bf16, MF_WT_BF16, true, false)
MM_F32_KERNELS(mm_tc_f16_p, MF_WT_F16, true, true)
MM_F32_KERNELS(mm_tc_bf16_p, MF_WT_BF16, true, true)
