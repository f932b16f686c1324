// The lightning indexer of a decode step in one launch (`idx_step`): the query
// (indexer_q_warp), the scores (indexer_scores_sp) and the top-k (topk_select_rg) of
// each token, which the plain path runs as three launches. At 2k context those three
// were ~33 µs of an indexed layer's ~60 µs critical path (session 32's trace): the
// scores ran on ⌈rows / 64⌉ = 9 SMs, and every launch waited for the one before.
//
// The blocks run in clusters of 8: each block turns 8 of the token's 64 raw queries
// (the q_b product) into the indexer's queries — RoPE, Hadamard, FP4, the same
// operations in the same order as indexer_q_warp, so the same bits — and writes them
// into the shared memory of all 8 blocks of its cluster. Then each block scores tiles
// of the compressed rows (16 rows up to IXS_NARROW_MAX live rows, 64 past them) over a
// grid-stride loop, and the last block to finish runs the top-k over the token's
// scores. Nothing is written back to the queries.
// (One block doing all 64 heads itself took ~3 µs of the launch's ~12 at 2k.)
//
// The sums are indexer_scores' own: each (row, head) dot product is one fused
// multiply-add chain over k = 0…dim−1, each row's four-head group is summed in head
// order, and the sixteen groups in group order; so the scores and the selection equal
// the three-launch path's bit for bit (gpu-selftest checks it).
//
// Shape: 64 heads × 128 dims (the Flash indexer), 256 threads. gridDim.y = tokens
// (the engine launches it for one decode token; the kernel also takes several, and a
// batched step's rows with `kvt`). `done` holds one counter per token, zero between
// launches: the last block resets it.
#include "common.cuh"

#define IXS_HEADS 64
#define IXS_DIM 128
// IXS_ROWS (a wide tile: thread (rg, g) has rows rg + 16i, heads 4g + j), IXS_NARROW_MAX
// (live rows up to which tiles are 16 rows, one a thread), IXS_CLUSTER (blocks a
// cluster: each transforms 8 of the 64 heads), IXS_LD (the row stride of the staged
// queries and rows, floats) and IXS_SMEM: ds4_consts.h, shared with the launcher.
#define IXS_THREADS 256
#define IXS_KEYS 32            // keys a thread holds in registers during the top-k
static_assert(IXS_KEYS * IXS_THREADS * 33 / 32 <= IXS_HEADS * IXS_LD, "top-k staging fits in qs");
static_assert(IXS_SMEM == (IXS_HEADS + IXS_ROWS) * IXS_LD * 4, "dynamic shared memory: queries + tile");
static_assert(IXS_HEADS == 8 * IXS_CLUSTER, "a cluster block transforms 8 heads, one a warp");

// pow2_ceil_log2 for x ≥ 2^−126 (normal or +∞: the FP4 scale's amax / 6 always is),
// without its subnormal branch: 2^c, c = ⌈log2 x⌉ from the bits, ldexpf(1, c)'s value.
__device__ __forceinline__ float pow2_ceil_log2_n(float x) {
    const u32 b = __float_as_uint(x);
    const int c = (int)((b >> 23) & 0xff) - 127 + ((b & 0x7fffffu) != 0);
    return c >= 128 ? __uint_as_float(0x7f800000u) : __uint_as_float((u32)(c + 127) << 23);
}
// 1 / s for s = 2^c, c ∈ [−126, 128]: exact, so x · pow2_inv(s) is x / s bit for bit
// (both the exact quotient, rounded once; s = ∞ gives 0 as x / ∞ does).
__device__ __forceinline__ float pow2_inv(float s) {
    const int e = (int)((__float_as_uint(s) >> 23) & 0xff);  // 1 … 255
    return e == 255 ? 0.f : e == 254 ? __uint_as_float(0x00400000u) : __uint_as_float((u32)(254 - e) << 23);
}
// e2m1_round for a ∈ [0, 6] (fminf(|x| / s, 6) never is NaN) as a sum of its steps
// (each step's threshold and side as in e2m1_round; the sums are exact): no branches.
__device__ __forceinline__ float e2m1_round_sum(float a) {
    return 0.5f * (float)(a > 0.25f) + 0.5f * (float)(a >= 0.75f) + 0.5f * (float)(a > 1.25f) +
           0.5f * (float)(a >= 1.75f) + (float)(a > 2.5f) + (float)(a >= 3.5f) + 2.f * (float)(a > 5.f);
}

// The top-k of the n scores at `scores` (global, written by other blocks of this grid)
// into sel (ascending index, ties at the k-th value to the lowest indices): the same
// selection as topk_select_body, by one 256-thread block. Keys stay in registers up to
// IXS_KEYS a thread (n ≤ 8,192: contexts up to 32k at ratio 4), else each pass reads
// them again.
__device__ __forceinline__ void ixs_topk(const float* scores, int n, int k, i32* sel, float* stage) {
    __shared__ u32 hist[256];
    __shared__ u32 sel_prefix, sel_need;
    __shared__ int red[32];
    const int tid = threadIdx.x;
    const int chunk = (n + IXS_THREADS - 1) / IXS_THREADS;
    const int c0 = min(n, tid * chunk), c1 = min(n, c0 + chunk);
    const bool reg = chunk <= IXS_KEYS;
    u32 kr[IXS_KEYS];
    if (reg) {
        // Coalesced from L2 into shared memory (a thread's contiguous chunk read straight
        // from global memory touches a sector a key), one pad a 32 so the chunks' reads
        // below fall in distinct banks. Plain loads: this block has not read the scores
        // before (no stale L1 line), and the fence and counter order the other blocks'
        // stores before them (the last-block pattern).
#pragma unroll
        for (int j = 0; j < IXS_KEYS; ++j) {  // every load in flight before the first store
            const int c = tid + j * IXS_THREADS;
            kr[j] = c < n ? __float_as_uint(scores[c]) : 0u;
        }
#pragma unroll
        for (int j = 0; j < IXS_KEYS; ++j) {
            const int c = tid + j * IXS_THREADS;
            if (c < n) stage[c + c / 32] = __uint_as_float(kr[j]);
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < IXS_KEYS; ++j) {
            const int c = c0 + j;
            kr[j] = c < c1 ? fkey(stage[c + c / 32]) : 0u;
        }
    }
    u32 prefix = 0, need = (u32)k;
    for (int pass = 0; pass < 4; ++pass) {
        const int shift = 24 - 8 * pass;
        const u32 mask = pass == 0 ? 0u : (0xffffffffu << (32 - 8 * pass));
        hist[tid] = 0;
        __syncthreads();
        if (reg) {
#pragma unroll
            for (int j = 0; j < IXS_KEYS; ++j) {
                if (j >= chunk) break;  // uniform: every thread has the same chunk
                if (c0 + j < c1 && (kr[j] & mask) == prefix) atomicAdd(&hist[(kr[j] >> shift) & 0xff], 1u);
            }
        } else {
            for (int c = tid; c < n; c += IXS_THREADS) {
                const u32 key = fkey(__ldcg(scores + c));
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xff], 1u);
            }
        }
        __syncthreads();
        // (A block scan over 2,048 digits of 11 bits, three passes, was slower at 525
        // rows and not faster at 8,192.)
        if (tid < WARP) topk_pick_digit(hist, prefix, need, shift, &sel_prefix, &sel_need);
        __syncthreads();
        prefix = sel_prefix;
        need = sel_need;
        __syncthreads();
    }
    // prefix = the k-th largest key: every larger key and the first `need` equal ones,
    // in index order (each thread owns a contiguous chunk).
    const u32 kth = prefix;
    int gt = 0, eq = 0;
    if (reg) {
#pragma unroll
        for (int j = 0; j < IXS_KEYS; ++j)
            if (c0 + j < c1) {
                gt += kr[j] > kth;
                eq += kr[j] == kth;
            }
    } else {
        for (int c = c0; c < c1; ++c) {
            const u32 key = fkey(__ldcg(scores + c));
            gt += key > kth;
            eq += key == kth;
        }
    }
    // One scan of both counts (equal keys above, larger keys below 16 bits; n ≤ 65,535
    // is checked by the launcher): a thread's first index is the larger keys before it
    // plus the equal ones taken before it, min(equal before, need).
    const int both = block_exclusive_scan((eq << 16) | gt, red, nullptr);
    const int eq_before = both >> 16, gt_before = both & 0xffff;
    const int eq_take = max(0, min(eq, (int)need - eq_before));
    int out = gt_before + min(eq_before, (int)need);
    // The selection goes to shared memory first (the stage is free: the keys are in
    // registers), then to `sel` in coalesced stores: a thread's own run of indices
    // written straight out was a scattered store a key.
    int* list = reinterpret_cast<int*>(stage);
    int eq_left = eq_take;
    if (reg) {
#pragma unroll
        for (int j = 0; j < IXS_KEYS; ++j)
            if (c0 + j < c1 && (kr[j] > kth || (kr[j] == kth && eq_left-- > 0))) list[out++] = c0 + j;
    } else {
        for (int c = c0; c < c1; ++c) {
            const u32 key = fkey(__ldcg(scores + c));
            if (key > kth || (key == kth && eq_left-- > 0)) list[out++] = c;
        }
    }
    __syncthreads();
    for (int i = tid; i < k; i += IXS_THREADS) sel[i] = list[i];
}

// One tile of 16·RPT scores: the rows `v` (2·RPT float4 a thread: row f / 32, k-quad
// f % 32 of piece f = tid + 256u) into ks, then thread (rg, g) the dot products of rows
// rg + 16i (i < RPT) with heads 4g + j, one fused multiply-add chain over k each; each
// row's group sum in head order, and the 16 groups summed in order by the tile's first
// threads. Shared-memory loads bound it (a warp's float4 load takes 4 cycles, even a
// broadcast): RPT = 4 loads 8 float4 a k-quad for 64 products a thread, RPT = 1 loads
// 5 for 16 but spreads a few rows over 4× the blocks (NOTES session 33). Rows rg + 16i
// (not 4rg + i) keep a warp's row loads in distinct banks.
template <int RPT>
__device__ __forceinline__ void ixs_tile(int c0, int n, const float4* v, const float* qs, float* ks,
                                         float* red, const float* ws, float* scores) {
    constexpr int ROWS = 16 * RPT, PIECES = 2 * RPT;
    const int tid = threadIdx.x, rg = tid % 16, g = tid / 16;
    __syncthreads();  // the queries are staged; the last tile's ks and red are read
#pragma unroll
    for (int u = 0; u < PIECES; ++u) {
        const int f = tid + u * IXS_THREADS, rr = f / 32, kq = f % 32;
        *reinterpret_cast<float4*>(ks + rr * IXS_LD + 4 * kq) = v[u];
    }
    __syncthreads();
    float acc[RPT][4];
#pragma unroll
    for (int i = 0; i < RPT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
#pragma unroll 4
    for (int kq = 0; kq < IXS_DIM / 4; ++kq) {
        float4 a[RPT], b[4];
#pragma unroll
        for (int i = 0; i < RPT; ++i) a[i] = *reinterpret_cast<const float4*>(ks + (rg + 16 * i) * IXS_LD + 4 * kq);
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = *reinterpret_cast<const float4*>(qs + (4 * g + j) * IXS_LD + 4 * kq);
#pragma unroll
        for (int i = 0; i < RPT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc[i][j] = __fmaf_rn(a[i].x, b[j].x, acc[i][j]);
                acc[i][j] = __fmaf_rn(a[i].y, b[j].y, acc[i][j]);
                acc[i][j] = __fmaf_rn(a[i].z, b[j].z, acc[i][j]);
                acc[i][j] = __fmaf_rn(a[i].w, b[j].w, acc[i][j]);
            }
    }
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        float p = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) p = __fmaf_rn(fmaxf(acc[i][j], 0.f), ws[4 * g + j], p);
        red[g * ROWS + rg + 16 * i] = p;
    }
    __syncthreads();
    if (tid < ROWS && c0 + tid < n) {
        float sum = 0.f;
        for (int gg = 0; gg < 16; ++gg) sum += red[gg * ROWS + tid];
        scores[c0 + tid] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(IXS_THREADS) __cluster_dims__(IXS_CLUSTER, 1, 1)
    indexer_step(const Step* step, const float* index_rows, const float* q_raw, RopeP rope,
                 const float* wt, float wscale, int ratio, int top_k, float* scores,
                 int scores_stride, i32* sel, u32* done, const u64* kvt) {
    extern __shared__ __align__(16) float ixs_smem[];
    float* qs = ixs_smem;                   // [IXS_HEADS][IXS_LD]: qs[h][k]
    float* ks = ixs_smem + IXS_HEADS * IXS_LD;  // [IXS_ROWS][IXS_LD]: ks[row][k]
    __shared__ float red[16 * IXS_ROWS];                    // [head group][row]
    __shared__ float ws[IXS_HEADS];
    __shared__ int last;
    const int tid = threadIdx.x, lane = tid % WARP, wid = tid / WARP;
    const int t = blockIdx.y;
    // The RoPE frequencies of the lane's two pairs (dims 4l…4l+3), loaded before the wait.
    const int nope = IXS_DIM - rope.rope_dim, e0 = 4 * lane;
    float fq[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 2; ++j)
        if (e0 + 2 * j >= nope) fq[j] = rope.freqs[(e0 + 2 * j - nope) / 2];
    PDL_WAIT();
    PDL_TRIGGER();  // the attention's grid may launch; it waits for this one's end
    const int n = (step[t].pos + 1) / ratio;
    if (n <= top_k) return;  // every row is attended: sel untouched
    index_rows = kvt_ptr(kvt, t, KVT_INDEX, index_rows);
    q_raw += (i64)t * IXS_HEADS * IXS_DIM;
    scores += (i64)t * scores_stride;
    const float pos = (float)step[t].pos;

    // ---- The queries: warp w of cluster block b transforms head 8b + w, lane l
    // holding dims 4l…4l+3: indexer_q_warp's operations in its order (RoPE, Hadamard
    // strides 1 and 2 in the lane and 4…64 across lanes, × 1/√128, FP4 over 8 lanes),
    // so its values. Every load (the head, the first tile's rows) is issued before the
    // first use, and the FP4 steps are branch-free (pow2_ceil_log2_n, pow2_inv,
    // e2m1_round_sum): with indexer_q_warp's helpers a warp doing 8 heads ran each
    // value as a chain of branches, ~13 µs.
    u32 rank;  // this block's place in its cluster: warp w transforms head 8·rank + w
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    constexpr int HW = IXS_HEADS / (IXS_THREADS / WARP) / IXS_CLUSTER;  // heads a warp
    float4 xv[HW];
#pragma unroll
    for (int i = 0; i < HW; ++i) xv[i] = ldx4(q_raw + (i64)(8 * (rank + IXS_CLUSTER * i) + wid) * IXS_DIM + e0);
    // Past IXS_NARROW_MAX live rows, 64-row tiles; below, 16-row tiles over more blocks.
    const bool wide = n > IXS_NARROW_MAX;
    const int tile_rows = wide ? IXS_ROWS : 16, pieces = tile_rows / 8;
    const int tiles = (n + tile_rows - 1) / tile_rows;
    // The rows of the block's first tile, in flight during the queries' work.
    float4 kv[IXS_ROWS / 8];
#pragma unroll
    for (int u = 0; u < IXS_ROWS / 8; ++u) {
        const int f = tid + u * IXS_THREADS, rr = f / 32, kq = f % 32;
        const int c = blockIdx.x * tile_rows + rr;
        kv[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (u < pieces && c < n) kv[u] = ldx4(index_rows + (i64)c * IXS_DIM + 4 * kq);
    }
    if (tid < IXS_HEADS) ws[tid] = wt[(i64)t * IXS_HEADS + tid] * wscale;
    // The lane's two rotations (rope_pair_f's angle and values), the same for every head.
    float rc[2], rs[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float th = pos * fq[j];
        rc[j] = cosf(th);
        rs[j] = sinf(th);
    }
#pragma unroll
    for (int i = 0; i < HW; ++i) {
        float x[4] = {xv[i].x, xv[i].y, xv[i].z, xv[i].w};
#pragma unroll
        for (int j = 0; j < 2; ++j)
            if (e0 + 2 * j >= nope) {
                const float a = x[2 * j], b = x[2 * j + 1];
                x[2 * j] = a * rc[j] - b * rs[j];
                x[2 * j + 1] = a * rs[j] + b * rc[j];
            }
        hadamard128_lane(x, lane);
        float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        amax = fmaxf(amax, 7.052966104933725e-38f);
        const float s4 = pow2_ceil_log2_n(__fdiv_rn(amax, 6.f));
        const float inv = pow2_inv(s4);
        float y[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) y[j] = copysignf(e2m1_round_sum(fminf(fabsf(x[j]) * inv, 6.f)) * s4, x[j]);
        // Into the queries of every block of the cluster (distributed shared memory).
        const u32 at = (u32)__cvta_generic_to_shared(qs + (8 * (rank + IXS_CLUSTER * i) + wid) * IXS_LD + e0);
#pragma unroll
        for (int b = 0; b < IXS_CLUSTER; ++b) {
            u32 ra;
            asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(at), "r"(b));
            asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(ra), "f"(y[0]), "f"(y[1]),
                         "f"(y[2]), "f"(y[3])
                         : "memory");
        }
    }
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    // ---- The scores, a tile at a time (the first one's rows already loaded).
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        if (tile != (int)blockIdx.x) {
#pragma unroll
            for (int u = 0; u < IXS_ROWS / 8; ++u) {
                const int f = tid + u * IXS_THREADS, rr = f / 32, kq = f % 32;
                const int c = tile * tile_rows + rr;
                kv[u] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (u < pieces && c < n) kv[u] = ldx4(index_rows + (i64)c * IXS_DIM + 4 * kq);
            }
        }
        if (wide)
            ixs_tile<4>(tile * tile_rows, n, kv, qs, ks, red, ws, scores);
        else
            ixs_tile<1>(tile * tile_rows, n, kv, qs, ks, red, ws, scores);
    }

    // ---- The last block to finish selects.
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(done + t, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (tid == 0) done[t] = 0;  // for the next launch (a later kernel boundary orders it)
    ixs_topk(scores, n, top_k, sel + (i64)t * top_k, qs);  // the queries' space is free
}
