// The lightning indexer (model-spec.md §5.5): its query (RoPE, Hadamard, FP4), the
// scores of the compressed rows, and the top-k selection the attention reads.
// Helpers are in layer.cu, which the build places first.
#include "common.cuh"

// ---- Indexer query: per head (one block each) RoPE on the tail, Hadamard, FP4.
extern "C" __global__ void __launch_bounds__(256) indexer_q(const Step* step, float* q, int dim,
                                                            RopeP p) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float v[1024];
    step += blockIdx.y;
    float* qh = q + ((i64)blockIdx.y * gridDim.x + blockIdx.x) * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) v[i] = qh[i];
    __syncthreads();
    const int nope = dim - p.rope_dim;
    for (int k = threadIdx.x; k < p.rope_dim / 2; k += blockDim.x)
        rope_pair(v[nope + 2 * k], v[nope + 2 * k + 1], k, (float)step->pos, p, false);
    hadamard_smem(v, dim);
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    for (int b = wid; b < dim / 32; b += blockDim.x / WARP) fp4_block32(v + b * 32, lane);
    __syncthreads();
    for (int i = threadIdx.x; i < dim; i += blockDim.x) qh[i] = v[i];
}

// The Hadamard transform of a warp's 128 values (lane l holds 4l…4l+3), × 1/√128, as
// hadamard_smem computes it: strides 1 and 2 pair values inside a lane, strides 4…64
// pair lane l with lane l ^ (stride/4) by shuffle, every butterfly the same a + b
// (lower) / a − b (upper) on the same operands. Shared by indexer_q_warp and
// indexer_step (layer_indexer_step.cu).
__device__ __forceinline__ void hadamard128_lane(float (&x)[4], int lane) {
    // Stride 1: (0,1), (2,3); stride 2: (0,2), (1,3).
    {
        const float a0 = x[0], b0 = x[1], a1 = x[2], b1 = x[3];
        x[0] = a0 + b0;
        x[1] = a0 - b0;
        x[2] = a1 + b1;
        x[3] = a1 - b1;
    }
    {
        const float a0 = x[0], b0 = x[2], a1 = x[1], b1 = x[3];
        x[0] = a0 + b0;
        x[2] = a0 - b0;
        x[1] = a1 + b1;
        x[3] = a1 - b1;
    }
#pragma unroll
    for (int ls = 1; ls < WARP; ls <<= 1) {
        const bool upper = lane & ls;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float o = __shfl_xor_sync(0xffffffffu, x[j], ls);
            // lower: a + b with a = mine; upper: a − b with a = the partner's.
            x[j] = upper ? o - x[j] : x[j] + o;
        }
    }
    const float sc = 1.0f / sqrtf(128.0f);
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] *= sc;
}

// ---- indexer_q with one warp per head (`idxq_warp`; dim = 128, an even RoPE start):
// lane l holds dims 4l…4l+3 in registers, and the Hadamard is hadamard128_lane's, so
// the result is indexer_q's bit for bit, without its shared memory and 9 barriers (only
// 64 of its 256 threads worked in each Hadamard stage). The FP4 block maximum runs over
// the block's 8 lanes (a maximum is exact in any order). The RoPE frequencies are
// loaded before the PDL wait. Block = 8 heads.
extern "C" __global__ void __launch_bounds__(256) indexer_q_warp(const Step* step, float* q,
                                                                 int heads, RopeP p) {
    constexpr int DIM = 128;
    const int lane = threadIdx.x % WARP;
    const int h = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int nope = DIM - p.rope_dim;
    const int e0 = 4 * lane;
    // The lane's two RoPE pairs (e0, e0+1) and (e0+2, e0+3) when they are in the tail.
    float fq[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 2; ++j)
        if (e0 + 2 * j >= nope) fq[j] = p.freqs[(e0 + 2 * j - nope) / 2];
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    if (h >= heads) return;
    step += blockIdx.y;
    float* qh = q + ((i64)blockIdx.y * heads + h) * DIM;
    const float4 in = ldx4(qh + e0);
    float x[4] = {in.x, in.y, in.z, in.w};
    const float pos = (float)step->pos;
#pragma unroll
    for (int j = 0; j < 2; ++j)
        if (e0 + 2 * j >= nope) rope_pair_f(x[2 * j], x[2 * j + 1], fq[j], pos, false);
    hadamard128_lane(x, lane);
    // FP4 per 32 values = lanes 8b…8b+7.
    float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    amax = fmaxf(amax, 7.052966104933725e-38f);
    const float s4 = pow2_ceil_log2(amax / 6.f);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float qv = fminf(fabsf(x[j]) / s4, 6.f);
        x[j] = copysignf(e2m1_round(qv) * s4, x[j]);
    }
    *reinterpret_cast<float4*>(qh + e0) = make_float4(x[0], x[1], x[2], x[3]);
}

// ---- Indexer scores: score[c] = Σ_h relu(index_c · q_h) · wt_h · wscale for the
// (pos+1)/ratio index rows of token blockIdx.y, skipped while that count is ≤ top_k
// (checked on the device). Block = 64 rows × every head (≤ 64; dim ≤ 128): the rows
// and the token's queries are staged k-major in shared memory, each thread owns a
// 4-row × 4-head register tile, and the per-row head sums are reduced in shared
// memory. Dynamic shared memory: indexer_scores_smem(dim) bytes.
// SPREAD (indexer_scores_sp, `idx_banks`): which 16-byte piece each lane stages. The
// plain mapping gives a warp one row's 32 k-quads: its transposed stores
// (4·kq + j)·68 + r fall in two banks, 16-way conflicts on each of a thread's 64
// stores (~8K shared-memory cycles per block, more than its FMAs). SPREAD gives a warp
// 16 rows × 2 k-quads (each row's 32 bytes one sector): 16·kq + 4·j + r spans all 32
// banks. The same values land in the same places; the sums are untouched.
#define IDX_ROWS 64
#define IDX_HEADS 64
#define IDX_S 68  // k-major row stride (floats): float4-aligned, conflict-free reads
template <bool SPREAD>
__device__ __forceinline__ void indexer_scores_body(const Step* step, const float* index_rows,
                                                    const float* q, const float* wt, int heads,
                                                    int dim, float wscale, int ratio, int top_k,
                                                    float* scores, int scores_stride,
                                                    const u64* kvt) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    // A batched step over several sessions: this token's own index rows (kvt).
    index_rows = kvt_ptr(kvt, blockIdx.y, KVT_INDEX, index_rows);
    extern __shared__ __align__(16) float ism[];
    float* qs = ism;                  // [dim][IDX_S]: qs[k][h]
    float* ks = ism + dim * IDX_S;    // [dim][IDX_S]: ks[k][row]
    float* red = ks + dim * IDX_S;    // [16][IDX_ROWS]
    __shared__ float ws[IDX_HEADS];
    step += blockIdx.y;
    q += (i64)blockIdx.y * heads * dim;
    wt += (i64)blockIdx.y * heads;
    scores += (i64)blockIdx.y * scores_stride;
    const int n = (step->pos + 1) / ratio;
    if (n <= top_k) return;
    const int c0 = blockIdx.x * IDX_ROWS;
    if (c0 >= n) return;
    const int tid = threadIdx.x;
    // Every 16-byte load of the queries and rows is issued before the first transposed
    // store (a load-store loop made the staging a chain of ~32 L2 round trips per block,
    // most of a decode token's scoring time). blockDim = 256, dim ≤ 128, dim % 4 = 0.
    constexpr int STAGE4 = IDX_HEADS * 128 / 4 / 256;  // float4 per thread and operand
    const int nq = dim / 4;
    float4 qv[STAGE4], kv[STAGE4];
    int at[STAGE4];  // the piece's k · IDX_S + row, or -1 where it stages nothing
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int u = 0; u < STAGE4; ++u) {
        const int f = tid + u * 256;
        int r, k;
        if (SPREAD) {
            const int g = f / WARP, l = f % WARP;
            r = 16 * (g % 4) + l % 16;
            const int kq = 2 * (g / 4) + l / 16;
            k = kq < nq ? 4 * kq : -1;
        } else {
            const int i = 4 * f;
            r = i < IDX_HEADS * dim ? i / dim : 0;
            k = i < IDX_HEADS * dim ? i % dim : -1;
        }
        at[u] = k < 0 ? -1 : k * IDX_S + r;
        qv[u] = zero4;
        kv[u] = zero4;
        if (k >= 0) {
            if (r < heads) qv[u] = ldx4(q + (i64)r * dim + k);
            if (c0 + r < n) kv[u] = ldx4(index_rows + (i64)(c0 + r) * dim + k);
        }
    }
    if (tid < IDX_HEADS) ws[tid] = tid < heads ? wt[tid] * wscale : 0.f;
#pragma unroll
    for (int u = 0; u < STAGE4; ++u) {
        if (at[u] >= 0) {
            const float qa[4] = {qv[u].x, qv[u].y, qv[u].z, qv[u].w};
            const float ka[4] = {kv[u].x, kv[u].y, kv[u].z, kv[u].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                qs[at[u] + j * IDX_S] = qa[j];
                ks[at[u] + j * IDX_S] = ka[j];
            }
        }
    }
    __syncthreads();
    const int rg = tid % 16, hg = tid / 16;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k = 0; k < dim; ++k) {
        const float4 a = *reinterpret_cast<const float4*>(ks + k * IDX_S + rg * 4);
        const float4 b = *reinterpret_cast<const float4*>(qs + k * IDX_S + hg * 4);
        FMA_OUTER4(acc, a, b, __fmaf_rn);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float p = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) p = __fmaf_rn(fmaxf(acc[i][j], 0.f), ws[hg * 4 + j], p);
        red[hg * IDX_ROWS + rg * 4 + i] = p;
    }
    __syncthreads();
    if (tid < IDX_ROWS && c0 + tid < n) {
        float sum = 0.f;
        for (int g = 0; g < 16; ++g) sum += red[g * IDX_ROWS + tid];
        scores[c0 + tid] = sum;
    }
}

#define IDX_PARAMS                                                                        \
    const Step *step, const float *index_rows, const float *q, const float *wt, int heads, \
        int dim, float wscale, int ratio, int top_k, float *scores, int scores_stride,      \
        const u64 *kvt
#define IDX_ARGS \
    step, index_rows, q, wt, heads, dim, wscale, ratio, top_k, scores, scores_stride, kvt
KERNEL_PAIR(__launch_bounds__(256), indexer_scores, indexer_scores_sp, indexer_scores_body,
            IDX_PARAMS, IDX_ARGS)

// Order-preserving key of a float (larger float → larger key).
__device__ __forceinline__ u32 fkey(float f) {
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix sum over the block of one int per thread (blockDim.x ≤ 1024).
__device__ int block_exclusive_scan(int v, int* red, int* total) {
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    int x = v;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == WARP - 1) red[wid] = x;
    __syncthreads();
    if (wid == 0) {
        const int nw = blockDim.x / WARP;
        int w = lane < nw ? red[lane] : 0;
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < nw) red[lane] = w;
    }
    __syncthreads();
    const int before = (wid > 0 ? red[wid - 1] : 0) + x - v;
    if (total) *total = red[blockDim.x / WARP - 1];
    __syncthreads();
    return before;
}

// One radix pass's choice, by the first warp: the digit of the 256-bin histogram
// `hist` where the count from the top reaches `need` — lane l scans digits
// 255 − 8l … 248 − 8l after a warp prefix sum of the lanes' totals (one thread walking
// 256 digits was most of topk_select's time) — written as prefix | digit << shift with
// the rank still to find among its keys. Called by threads 0…31 only.
__device__ __forceinline__ void topk_pick_digit(const u32* hist, u32 prefix, u32 need, int shift,
                                                u32* sel_prefix, u32* sel_need) {
    const int lane = threadIdx.x;
    u32 cnt[8], tot = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        cnt[j] = hist[255 - 8 * lane - j];
        tot += cnt[j];
    }
    u32 incl = tot;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    const u32 before = incl - tot;
    if (before < need && need <= incl) {
        u32 acc = before;
        int digit = 248 - 8 * lane;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (acc + cnt[j] >= need) {
                digit = 255 - 8 * lane - j;
                break;
            }
            acc += cnt[j];
        }
        *sel_prefix = prefix | ((u32)digit << shift);
        *sel_need = need - acc;
    }
}

// ---- Top-k selection over n scores: sel receives the indices of the k largest in
// ascending index order (ties at the k-th value to the lowest indices), found by a
// 4-pass radix select and a block-wide compaction. With n ≤ k nothing is written:
// attention then uses every row. One block per token (blockIdx.y), 1024 threads.
// REG (topk_select_rg, `topk_reg`): while a thread's contiguous chunk of the scores
// fits TOPK_REG keys (n ≤ 4·blockDim: contexts up to 16K at ratio 4), the keys are
// read once into registers and every pass counts from there; the plain kernel reads
// the scores from memory in each of its four passes and twice more at the end (six
// dependent L2 round trips). Integer counts: the same selection.
#define TOPK_REG 4
template <bool REG>
__device__ __forceinline__ void topk_select_body(const Step* step, const float* scores,
                                                 int scores_stride, int ratio, int k, i32* sel) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ u32 hist[256];
    __shared__ u32 sel_prefix, sel_need;
    __shared__ int red[32];
    step += blockIdx.y;
    scores += (i64)blockIdx.y * scores_stride;
    sel += (i64)blockIdx.y * k;
    const int n = (step->pos + 1) / ratio;
    if (n <= k) return;
    // Each thread's contiguous chunk (the final scan's order; REG's passes count it too).
    const int chunk = (n + blockDim.x - 1) / blockDim.x;
    const int c0 = min(n, (int)threadIdx.x * chunk), c1 = min(n, c0 + chunk);
    const bool reg = REG && chunk <= TOPK_REG;
    constexpr int NR = REG ? TOPK_REG : 1;
    u32 kr[NR];
    if (reg) {
#pragma unroll
        for (int j = 0; j < NR; ++j) kr[j] = c0 + j < c1 ? fkey(scores[c0 + j]) : 0u;
    }
    u32 prefix = 0, need = (u32)k;  // rank still to find among keys matching prefix
    for (int pass = 0; pass < 4; ++pass) {
        const int shift = 24 - 8 * pass;
        const u32 mask = pass == 0 ? 0u : (0xffffffffu << (32 - 8 * pass));
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        if (reg) {
#pragma unroll
            for (int j = 0; j < NR; ++j)
                if (c0 + j < c1 && (kr[j] & mask) == prefix)
                    atomicAdd(&hist[(kr[j] >> shift) & 0xff], 1u);
        } else if (REG) {
            // Past TOPK_REG keys a thread: the plain loop, without its unrolling (the
            // register path already holds 64 registers under the 1024-thread bound).
#pragma unroll 1
            for (int c = threadIdx.x; c < n; c += blockDim.x) {
                const u32 key = fkey(scores[c]);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xff], 1u);
            }
        } else {
#pragma unroll 4
            for (int c = threadIdx.x; c < n; c += blockDim.x) {
                const u32 key = fkey(scores[c]);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xff], 1u);
            }
        }
        __syncthreads();
        if (threadIdx.x < WARP) topk_pick_digit(hist, prefix, need, shift, &sel_prefix, &sel_need);
        __syncthreads();
        prefix = sel_prefix;
        need = sel_need;
        __syncthreads();
    }
    // prefix = the k-th largest key; keep every larger key and the first `need` equal
    // ones. Each thread owns a contiguous chunk, so ascending order falls out of the scan.
    const u32 kth = prefix;
    int gt = 0, eq = 0;
    if (reg) {
#pragma unroll
        for (int j = 0; j < NR; ++j)
            if (c0 + j < c1) {
                gt += kr[j] > kth;
                eq += kr[j] == kth;
            }
    } else {
        for (int c = c0; c < c1; ++c) {
            const u32 key = fkey(scores[c]);
            gt += key > kth;
            eq += key == kth;
        }
    }
    const int eq_before = block_exclusive_scan(eq, red, nullptr);
    const int eq_take = max(0, min(eq, (int)need - eq_before));
    int out = block_exclusive_scan(gt + eq_take, red, nullptr);
    int eq_left = eq_take;
    if (reg) {
#pragma unroll
        for (int j = 0; j < NR; ++j)
            if (c0 + j < c1 && (kr[j] > kth || (kr[j] == kth && eq_left-- > 0))) sel[out++] = c0 + j;
    } else {
        for (int c = c0; c < c1; ++c) {
            const u32 key = fkey(scores[c]);
            if (key > kth || (key == kth && eq_left-- > 0)) sel[out++] = c;
        }
    }
}

#define TOPK_PARAMS \
    const Step *step, const float *scores, int scores_stride, int ratio, int k, i32 *sel
#define TOPK_ARGS step, scores, scores_stride, ratio, k, sel
KERNEL_PAIR(__launch_bounds__(1024), topk_select, topk_select_rg, topk_select_body, TOPK_PARAMS,
            TOPK_ARGS)
