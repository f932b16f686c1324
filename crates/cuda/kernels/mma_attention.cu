// Prefill attention on tensor cores (fast numerics): one block per token computes
// S = Q·Kᵀ for all 64 heads over 32-row tiles of the token's rows (raw window oldest
// first, then the compressed rows or their top-k selection, as attention_split), an
// online softmax, and O += P·V, with K = V = the stored row (MQA). Q, the row tile and P
// are fp16 (rows are RMS-normed and q heads too, so values are O(1)); products and the
// softmax accumulate in f32. Uses the cp.async / ldmatrix helpers of matmul.cu (kernel
// files are concatenated in name order).
//
// Why: attention_split reads every row once per head group of 8 (8 re-reads per token)
// and runs on the FMA pipes; here a token's rows are read once and its 4·64·512 FLOPs
// per row run as mma.sync m16n8k16.
//
// Layout: 8 warps; warp w owns heads 16·(w & 3) … +15 and output dims 256·(w >> 2) …
// +255 (so warps w and w + 4 compute the same scores: 1.5× the score FLOPs, no shared
// memory exchange). Shared memory: Q [64][AMMA_LD] fp16, the row tile [32][AMMA_LD]
// fp16, and the next tile's f32 rows [32][512] arriving by cp.async while this tile
// computes. Rows are padded to AMMA_LD halves so ldmatrix rows land on distinct banks.
//
// HALF (attention_prefill_mma_h, a prefill chunk): the rows come as fp16 copies made
// once per layer and chunk (rows_f16: the ring and the compressed rows; a token's ~640
// rows are shared with its neighbours, so converting each row per token was ~8,000×
// the work), straight into two alternating row tiles by cp.async — half the bytes, no
// conversion pass and one barrier a tile instead of two. The fp16 operands are the
// same values (cvt.rn either way): bit-identical to attention_prefill_mma.
#include "common.cuh"

// (AMMA_HEADS, AMMA_HD: ds4_consts.h.)
#define AMMA_ROWS 32
#define AMMA_LD (AMMA_HD + 8)

__device__ __forceinline__ u32 amma_pack(float lo, float hi) {
    u32 r;
    asm("{ .reg .b16 l, h; cvt.rn.f16.f32 l, %1; cvt.rn.f16.f32 h, %2; mov.b32 %0, {l, h}; }"
        : "=r"(r)
        : "f"(lo), "f"(hi));
    return r;
}

__device__ __forceinline__ void amma_ldsm4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c0 += A·B0, c1 += A·B1 for the two 8-column halves (b0 b1, b2 b3) of one ldmatrix x4.
__device__ __forceinline__ void amma_mma2(float (&c0)[4], float (&c1)[4], u32 a0, u32 a1, u32 a2,
                                          u32 a3, u32 b0, u32 b1, u32 b2, u32 b3) {
    mma_f16_f32(c0, a0, a1, a2, a3, b0, b1);
    mma_f16_f32(c1, a0, a1, a2, a3, b2, b3);
}

// cp.async of 32-row tile `tile` of a token's rows (`T`: f32 or fp16 values, AMMA_HD a
// row; `total` of them) into shared memory at `dst`, rows LD elements apart: each row is CH chunks of 16
// bytes, and thread tid copies chunk tid % CH of rows tid / CH + (256 / CH)·i. Rows past
// the end are zero-filled. UNROLL: the copy loop's unroll factor.
template <typename T, int LD, int UNROLL>
__device__ __forceinline__ void amma_copy_rows(T* dst, const AttRows& rows, int total, int tile,
                                               int tid, const T* ring, int raw_cap, const T* comp) {
    constexpr int EL = 16 / sizeof(T), CH = AMMA_HD / EL, STEP = 256 / CH;
    constexpr int LOG_CH = CH == 128 ? 7 : 6;
    static_assert(CH == 1 << LOG_CH, "64 or 128 chunks a row");
    const int cc = tid & (CH - 1);
#pragma unroll UNROLL
    for (int i = 0; i < AMMA_ROWS / STEP; ++i) {
        const int rr = (tid >> LOG_CH) + STEP * i;
        const int r = tile * AMMA_ROWS + rr;
        const bool ok = r < total;
        const T* src = ok ? rows.row(r, ring, raw_cap, comp, AMMA_HD) + cc * EL : ring;
        mm_cp16(mm_smem(dst + rr * LD + cc * EL), src, ok);
    }
}

__device__ __forceinline__ void amma_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// SPLIT (attention_split_mma, a multi-row step's few tokens, fast numerics): block
// (chunk c, token t) takes the contiguous run of 32-row tiles c·⌈tiles/chunks⌉ … of the
// token's rows and writes the unnormalised partials of attention_split's layout (acc
// [t][h][c][hd], (max, sum) [t][h][c]) for attention_combine, which adds the sink and the
// tail: a decode-sized batch cannot fill the GPU with one block per token. A chunk
// without rows writes an empty partial (sum 0, which the combine skips).
template <bool SPLIT, bool HALF>
__device__ __forceinline__ void attention_mma_body(const Step* step, const float* q,
        const float* ring, int raw_cap, int window, const float* comp, int ratio,
        const i32* sel, int top_k, const float* sinks, float scale, float* out,
        int n_chunks, float* part_acc, float* part_ml, const u64* kvt,
        const u16* ring16 = nullptr, const u16* comp16 = nullptr) {
    PDL_WAIT();
    extern __shared__ __align__(16) u8 smem[];
    u16* sQ = reinterpret_cast<u16*>(smem);
    u16* sK = sQ + AMMA_HEADS * AMMA_LD;
    // (HALF: a second row tile at sK + AMMA_ROWS · AMMA_LD instead of the f32 stage.)
    float* sF = reinterpret_cast<float*>(sK + AMMA_ROWS * AMMA_LD);
    const int t = SPLIT ? blockIdx.y : blockIdx.x;
    const int tid = threadIdx.x, lane = tid % WARP, w = tid / WARP;
    const int g = lane >> 2, cq = lane & 3;
    // A batched step over several sessions: token t's own ring and rows (kvt).
    ring = kvt_ptr(kvt, t, KVT_RING, ring);
    comp = kvt_ptr(kvt, t, KVT_COMP, comp);
    raw_cap = kvt_raw_cap(kvt, t, raw_cap);
    const AttRows rows(step, t, window, ratio, sel, top_k);
    const int total = rows.total;
    const int all_tiles = (total + AMMA_ROWS - 1) / AMMA_ROWS;
    // This block's tiles [tile0, tile0 + n_tiles).
    int tile0 = 0, n_tiles = all_tiles;
    if (SPLIT) {
        const int per = (all_tiles + n_chunks - 1) / n_chunks;
        tile0 = min(all_tiles, (int)blockIdx.x * per);
        n_tiles = min(all_tiles, tile0 + per) - tile0;
        if (n_tiles <= 0) {
            const i64 base = ((i64)t * AMMA_HEADS) * n_chunks + blockIdx.x;
            for (int i = tid; i < AMMA_HEADS * AMMA_HD; i += 256) {
                const int h = i / AMMA_HD, d = i % AMMA_HD;
                part_acc[(base + (i64)h * n_chunks) * AMMA_HD + d] = 0.f;
            }
            if (tid < AMMA_HEADS) {
                part_ml[2 * (base + (i64)tid * n_chunks)] = -3.0e38f;
                part_ml[2 * (base + (i64)tid * n_chunks) + 1] = 0.f;
            }
            return;
        }
    }

    // Tile `tile`'s rows: f32 into sF, or (HALF) fp16 into row tile tile & 1.
    auto issue = [&](int tile) {
        if (HALF)
            amma_copy_rows<u16, AMMA_LD, AMMA_ROWS / 4>(sK + (tile & 1) * AMMA_ROWS * AMMA_LD,
                                                        rows, total, tile0 + tile, tid, ring16,
                                                        raw_cap, comp16);
        else
            amma_copy_rows<float, AMMA_HD, 4>(sF, rows, total, tile0 + tile, tid, ring, raw_cap,
                                              comp);
        mm_commit();
    };
    issue(0);

    // Q (scaled) to fp16.
    const float* qt = q + (i64)t * AMMA_HEADS * AMMA_HD;
#pragma unroll 4
    for (int i = tid; i < AMMA_HEADS * AMMA_HD / 4; i += 256) {
        const float4 v = *reinterpret_cast<const float4*>(qt + 4 * i);
        const int h = (4 * i) / AMMA_HD, d = (4 * i) % AMMA_HD;
        u32* dst = reinterpret_cast<u32*>(sQ + h * AMMA_LD + d);
        dst[0] = amma_pack(v.x * scale, v.y * scale);
        dst[1] = amma_pack(v.z * scale, v.w * scale);
    }

    const int h0 = 16 * (w & 3), d0 = 256 * (w >> 2);
    float o[32][4];
#pragma unroll
    for (int i = 0; i < 32; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    // Running max and (this thread's partial) sum of heads h0 + g and h0 + g + 8.
    float m0 = -3.0e38f, m1 = -3.0e38f, l0 = 0.f, l1 = 0.f;
    const u32 sQ_a = mm_smem(sQ + (h0 + (lane & 15)) * AMMA_LD + 8 * (lane >> 4));
    const u32 sK_s = mm_smem(sK + ((lane & 7) + 8 * (lane >> 4)) * AMMA_LD + 8 * ((lane >> 3) & 1));
    const u32 sK_v = mm_smem(sK + ((lane & 7) + 8 * ((lane >> 3) & 1)) * AMMA_LD + d0 + 8 * (lane >> 4));

    for (int tile = 0; tile < n_tiles; ++tile) {
        amma_wait_all();
        // HALF: row tile tile & 1 holds this tile; every warp is done with the other
        // (the last tile's), which the next tile's copies now fill.
        // Else: sF holds this tile; every warp is done with the last sK.
        __syncthreads();
        u32 kb = 0;  // byte offset of this tile's row tile from sK
        if (HALF) {
            kb = (tile & 1) * AMMA_ROWS * AMMA_LD * 2;
        } else {
#pragma unroll 4
            for (int i = tid; i < AMMA_ROWS * AMMA_HD / 4; i += 256) {
                const int r = (4 * i) / AMMA_HD, d = (4 * i) % AMMA_HD;
                const float4 v = *reinterpret_cast<const float4*>(sF + 4 * i);
                u32* dst = reinterpret_cast<u32*>(sK + r * AMMA_LD + d);
                dst[0] = amma_pack(v.x, v.y);
                dst[1] = amma_pack(v.z, v.w);
            }
            __syncthreads();  // sK ready; sF free for the next tile
        }
        if (tile + 1 < n_tiles) issue(tile + 1);

        // Scores of 16 heads × 32 rows.
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll 8
        for (int ks = 0; ks < AMMA_HD / 16; ++ks) {
            u32 a0, a1, a2, a3;
            mm_ldsm4(sQ_a + ks * 32, a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                u32 b0, b1, b2, b3;
                mm_ldsm4(sK_s + kb + np * 16 * AMMA_LD * 2 + ks * 32, b0, b1, b2, b3);
                amma_mma2(s[2 * np], s[2 * np + 1], a0, a1, a2, a3, b0, b1, b2, b3);
            }
        }
        // Rows past the end score −∞; online softmax per head row.
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = (tile0 + tile) * AMMA_ROWS + nt * 8 + 2 * cq + (j & 1);
                if (col >= total) s[nt][j] = __int_as_float(0xff800000u);
            }
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float c0 = expf(m0 - mx0), c1 = expf(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            s[nt][0] = expf(s[nt][0] - m0);
            s[nt][1] = expf(s[nt][1] - m0);
            s[nt][2] = expf(s[nt][2] - m1);
            s[nt][3] = expf(s[nt][3] - m1);
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
        }
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            o[i][0] *= c0;
            o[i][1] *= c0;
            o[i][2] *= c1;
            o[i][3] *= c1;
        }
        // O += P·V over the tile's 32 rows (two k-steps of 16).
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            const u32 a0 = amma_pack(s[2 * kk][0], s[2 * kk][1]);
            const u32 a1 = amma_pack(s[2 * kk][2], s[2 * kk][3]);
            const u32 a2 = amma_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const u32 a3 = amma_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int np = 0; np < 16; ++np) {
                u32 b0, b1, b2, b3;
                amma_ldsm4_t(sK_v + kb + kk * 16 * AMMA_LD * 2 + np * 32, b0, b1, b2, b3);
                amma_mma2(o[2 * np], o[2 * np + 1], a0, a1, a2, a3, b0, b1, b2, b3);
            }
        }
    }

    // The sink joins the denominator only.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int ha = h0 + g, hb = h0 + g + 8;
    if (SPLIT) {
        // Unnormalised partials of heads ha, hb over this chunk's rows; warps w and
        // w + 4 hold the same (max, sum), the first writes it.
        const i64 ca = ((i64)t * AMMA_HEADS + ha) * n_chunks + blockIdx.x;
        const i64 cb = ((i64)t * AMMA_HEADS + hb) * n_chunks + blockIdx.x;
        float* pa = part_acc + ca * AMMA_HD + d0 + 2 * cq;
        float* pb = part_acc + cb * AMMA_HD + d0 + 2 * cq;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            *reinterpret_cast<float2*>(pa + 8 * i) = make_float2(o[i][0], o[i][1]);
            *reinterpret_cast<float2*>(pb + 8 * i) = make_float2(o[i][2], o[i][3]);
        }
        if (w < 4 && cq == 0) {
            part_ml[2 * ca] = m0;
            part_ml[2 * ca + 1] = l0;
            part_ml[2 * cb] = m1;
            part_ml[2 * cb + 1] = l1;
        }
        return;
    }
    const float ska = sinks[ha], skb = sinks[hb];
    const float ma = fmaxf(m0, ska), mb = fmaxf(m1, skb);
    const float fa = expf(m0 - ma) / (l0 * expf(m0 - ma) + expf(ska - ma));
    const float fb = expf(m1 - mb) / (l1 * expf(m1 - mb) + expf(skb - mb));
    float* oa = out + ((i64)t * AMMA_HEADS + ha) * AMMA_HD + d0 + 2 * cq;
    float* ob = out + ((i64)t * AMMA_HEADS + hb) * AMMA_HD + d0 + 2 * cq;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        *reinterpret_cast<float2*>(oa + 8 * i) = make_float2(o[i][0] * fa, o[i][1] * fa);
        *reinterpret_cast<float2*>(ob + 8 * i) = make_float2(o[i][2] * fb, o[i][3] * fb);
    }
}

extern "C" __global__ void __launch_bounds__(256, 1) attention_prefill_mma(const Step* step,
        const float* q, const float* ring, int raw_cap, int window, const float* comp,
        int ratio, const i32* sel, int top_k, const float* sinks, float scale, float* out) {
    attention_mma_body<false, false>(step, q, ring, raw_cap, window, comp, ratio, sel, top_k,
                                     sinks, scale, out, 1, nullptr, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(256, 1) attention_prefill_mma_h(const Step* step,
        const float* q, const u16* ring16, int raw_cap, int window, const u16* comp16,
        int ratio, const i32* sel, int top_k, const float* sinks, float scale, float* out) {
    attention_mma_body<false, true>(step, q, nullptr, raw_cap, window, nullptr, ratio, sel,
                                    top_k, sinks, scale, out, 1, nullptr, nullptr, nullptr,
                                    ring16, comp16);
}

// fp16 copies of n f32 values (n a multiple of 8): attention_prefill_mma_h's rows.
extern "C" __global__ void __launch_bounds__(256) rows_f16(const float* __restrict__ x,
                                                            u16* __restrict__ y, i64 n) {
    PDL_WAIT();
    const i64 i = 8 * ((i64)blockIdx.x * 256 + threadIdx.x);
    if (i >= n) return;
    const float4 a = *reinterpret_cast<const float4*>(x + i);
    const float4 b = *reinterpret_cast<const float4*>(x + i + 4);
    uint4 o;
    o.x = amma_pack(a.x, a.y);
    o.y = amma_pack(a.z, a.w);
    o.z = amma_pack(b.x, b.y);
    o.w = amma_pack(b.z, b.w);
    *reinterpret_cast<uint4*>(y + i) = o;
}

extern "C" __global__ void __launch_bounds__(256, 1) attention_split_mma(const Step* step,
        const float* q, const float* ring, int raw_cap, int window, const float* comp,
        int ratio, const i32* sel, int top_k, const float* sinks, float scale, int n_chunks,
        float* part_acc, float* part_ml, const u64* kvt) {
    attention_mma_body<true, false>(step, q, ring, raw_cap, window, comp, ratio, sel, top_k,
                                    sinks, scale, nullptr, n_chunks, part_acc, part_ml, kvt);
}
