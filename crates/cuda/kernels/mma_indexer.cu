// Prefill indexer scores on tensor cores (`idx_mma`): the batched path's
// score[t][c] = Σ_h relu(index_c · q_{t,h}) · wt_{t,h} · wscale (indexer_scores in
// layer_indexer.cu) with the 64 × 128 dot products of a token and a tile of 64 rows as
// bf16 mma.sync m16n8k16 with f32 accumulators. Uses the ldmatrix / smem helpers of
// matmul.cu (kernel files are concatenated in name order).
//
// Why: a prompt of T tokens scores ~T²/8 rows × 64 heads × 128 dims, and on the FMA
// pipes that was the largest context-dependent prefill cost (781 ms of a 16k prompt on
// the H200, growing quadratically).
//
// Exactness: both operands are FP4-simulated (indexer_q; the compressor's index rows,
// then at most an f16 rounding), so every value has at most 3 significant bits and
// converts to bf16 exactly, and every product is exact in f32. The dot products then
// differ from the FMA kernel's only where a partial sum is not exact in f32 (scales of
// the four 32-blocks far apart); the head sum (relu · weight, 4 heads at a time, then
// the 16 groups in order) is done exactly as indexer_scores does it.
//
// Block: 4 warps, a tile of IMMA_ROWS index rows (loaded once) and IMMA_TOKS tokens in
// turn; warp w computes heads 16w … 16w + 15 × the 64 rows. Shared memory: the rows and
// the token's queries as bf16 [64][IMMA_LD], the raw dot products [64][IMMA_SS] f32.
#include "common.cuh"

#define IMMA_HEADS 64
#define IMMA_DIM 128
#define IMMA_ROWS 64
#define IMMA_TOKS 8
#define IMMA_LD (IMMA_DIM + 8)  // bf16 per staged row: ldmatrix rows on distinct banks
#define IMMA_SS (IMMA_ROWS + 4)  // f32 per head row of the dot products

// Two floats as bf16x2 (lo in the low half: the lower address).
__device__ __forceinline__ u32 imma_pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c += A·B, bf16 inputs, f32 accumulators.
__device__ __forceinline__ void imma_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 64 rows of 128 f32 (rows from `valid` on read as zeros) into registers: thread tid
// holds float4 number tid + 128·i of the tile.
__device__ __forceinline__ void imma_fetch(const float* src, int valid, float4 (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int f = threadIdx.x + 128 * i;
        const int r = f / (IMMA_DIM / 4), c4 = f % (IMMA_DIM / 4);
        v[i] = r < valid ? *reinterpret_cast<const float4*>(src + (i64)r * IMMA_DIM + 4 * c4)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// Those registers as bf16 rows of IMMA_LD.
__device__ __forceinline__ void imma_stage(u16* dst, const float4 (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int f = threadIdx.x + 128 * i;
        const int r = f / (IMMA_DIM / 4), c4 = f % (IMMA_DIM / 4);
        u32* d = reinterpret_cast<u32*>(dst + r * IMMA_LD + 4 * c4);
        d[0] = imma_pack(v[i].x, v[i].y);
        d[1] = imma_pack(v[i].z, v[i].w);
    }
}

// Tokens blockIdx.y·IMMA_TOKS … of the n_tok, rows 64·blockIdx.x … (heads = 64,
// dim = 128: the launcher checks). Dynamic shared memory: indexer_mma_smem bytes.
extern "C" __global__ void __launch_bounds__(128) indexer_scores_mma(const Step* step,
        const float* index_rows, const float* q, const float* wt, int n_tok, float wscale,
        int ratio, int top_k, float* scores, int scores_stride) {
    PDL_WAIT();
    extern __shared__ __align__(16) u8 smem[];
    u16* sK = reinterpret_cast<u16*>(smem);
    u16* sQ = sK + IMMA_ROWS * IMMA_LD;
    float* sS = reinterpret_cast<float*>(sQ + IMMA_HEADS * IMMA_LD);
    __shared__ float ws[IMMA_HEADS];
    const int tid = threadIdx.x, lane = tid % WARP, w = tid / WARP;
    const int g = lane >> 2, cq = lane & 3;
    const int c0 = blockIdx.x * IMMA_ROWS;
    const int t0 = blockIdx.y * IMMA_TOKS, t1 = min(n_tok, t0 + IMMA_TOKS);
    // The rows any token of the group scores (tokens with n ≤ top_k score none).
    int n_max = 0;
    for (int t = t0; t < t1; ++t) {
        const int n = (step[t].pos + 1) / ratio;
        if (n > top_k) n_max = max(n_max, n);
    }
    if (c0 >= n_max) return;  // block-uniform
    {
        float4 v[16];
        imma_fetch(index_rows + (i64)c0 * IMMA_DIM, n_max - c0, v);
        imma_stage(sK, v);
    }
    const u32 sQ_a = mm_smem(sQ + (16 * w + (lane & 15)) * IMMA_LD + 8 * (lane >> 4));
    const u32 sK_b = mm_smem(sK + ((lane & 7) + 8 * (lane >> 4)) * IMMA_LD + 8 * ((lane >> 3) & 1));
    for (int t = t0; t < t1; ++t) {
        const int n = (step[t].pos + 1) / ratio;
        if (n <= top_k || c0 >= n) continue;  // block-uniform
        {
            float4 v[16];
            imma_fetch(q + (i64)t * IMMA_HEADS * IMMA_DIM, IMMA_HEADS, v);
            __syncthreads();  // the previous token is done with sQ, sS and ws
            imma_stage(sQ, v);
            if (tid < IMMA_HEADS) ws[tid] = wt[(i64)t * IMMA_HEADS + tid] * wscale;
        }
        __syncthreads();
        float s[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < IMMA_DIM / 16; ++ks) {
            u32 a0, a1, a2, a3;
            mm_ldsm4(sQ_a + ks * 32, a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < IMMA_ROWS / 16; ++np) {
                u32 b0, b1, b2, b3;
                mm_ldsm4(sK_b + np * 16 * IMMA_LD * 2 + ks * 32, b0, b1, b2, b3);
                imma_mma(s[2 * np], a0, a1, a2, a3, b0, b1);
                imma_mma(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        // Head rows 16w + g (c[0], c[1]) and + 8 (c[2], c[3]); index rows 8·nt + 2·cq + j.
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int col = 8 * nt + 2 * cq;
            *reinterpret_cast<float2*>(sS + (16 * w + g) * IMMA_SS + col) =
                make_float2(s[nt][0], s[nt][1]);
            *reinterpret_cast<float2*>(sS + (16 * w + g + 8) * IMMA_SS + col) =
                make_float2(s[nt][2], s[nt][3]);
        }
        __syncthreads();
        // indexer_scores' head sum: groups of 4 heads as FMA chains, then the 16 groups
        // in order.
        if (tid < IMMA_ROWS && c0 + tid < n) {
            float sum = 0.f;
            for (int hg = 0; hg < IMMA_HEADS / 4; ++hg) {
                float p = 0.f;
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    p = __fmaf_rn(fmaxf(sS[(4 * hg + j) * IMMA_SS + tid], 0.f), ws[4 * hg + j], p);
                sum += p;
            }
            scores[(i64)t * scores_stride + c0 + tid] = sum;
        }
    }
}
