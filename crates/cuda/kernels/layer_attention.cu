// Decode sink attention (model-spec.md §5.2): split over chunks of rows with an online
// softmax, then combined (the sink in the denominator). AttRows is shared with the
// tensor-core prefill attention in mma_attention.cu, which the build places after this.
// Helpers are in layer.cu, which the build places first.
#include "common.cuh"

// The rows token t attends, in order: its raw window (oldest first, ring slot
// p % raw_cap), then its compressed rows — all of them, or the top-k selection `sel[t]`
// once there are more than top_k. Shared by attention_split and attention_prefill_mma.
struct AttRows {
    int pos, n_raw, total;
    bool masked;
    const i32* st;

    __device__ AttRows(const Step* step, int t, int window, int ratio, const i32* sel,
                       int top_k) {
        pos = step[t].pos;
        n_raw = min(pos + 1, window);
        const int n_comp_all = ratio > 0 ? (pos + 1) / ratio : 0;
        masked = sel != nullptr && n_comp_all > top_k;
        st = sel + (i64)t * top_k;
        total = n_raw + (masked ? top_k : n_comp_all);
    }

    // Row r < total of `hd` values (f32, or the fp16 copies of attention_prefill_mma_h).
    template <typename T>
    __device__ __forceinline__ const T* row(int r, const T* ring, int raw_cap, const T* comp,
                                            int hd) const {
        if (r < n_raw) return ring + (i64)((pos - n_raw + 1 + r) % raw_cap) * hd;
        const int ci = masked ? st[r - n_raw] : r - n_raw;
        return comp + (i64)ci * hd;
    }
};

// ---- Split sink attention (flash-decoding): K = V = the stored row, shared by every
// head (MQA). Block (chunk c, head group, token t) walks rows [c·rows_per_chunk, …) of
// the token's row list (raw window oldest first, then the compressed rows or their
// top-k selection) once with an online softmax; warp w owns head group·8 + w and a lane
// holds dims {4l..4l+3} + 128·j, so each row is loaded once per warp and used for both
// the score and the weighted sum. rows_per_chunk = 0 divides the rows evenly. Partials: acc [t][h][c][hd], (max, sum) [t][h][c].
// With a single chunk the block finishes the softmax itself (sink included) and
// writes the output directly. hd must be a multiple of 4 (≤ 512).
//
// STAGED (attention_split_staged, decode): the block first copies up to
// ATT_STAGE_ROWS of its rows into shared memory with cp.async — every load in flight at
// once, one memory round trip per batch instead of one per ATT_ROWS_PER_STEP rows — and
// its warps read them there. Same steps, same sums: bit-identical to the plain kernel.
// EARLY (attention_split_early, `att_early`): as STAGED, but the first batch's copies
// are issued before the query is loaded and normalised, and the query's RoPE
// frequencies are loaded before the PDL wait: the row loads overlap the query's chain
// (q → norm → RoPE table) instead of following it. Same values, same sums.
#define ATT_HEADS_PER_BLOCK 8
#define ATT_ROWS_PER_STEP 4
// (ATT_STAGE_ROWS: ds4_consts.h.)
#define ATT_SPLIT_PARAMS                                                                   \
    const Step *step, const float *q, const float *ring, int raw_cap, int window,           \
        const float *comp, int ratio, const i32 *sel, int top_k, const float *sinks,        \
        int heads, int hd, float scale, int rows_per_chunk, float *part_acc, float *part_ml, \
        float *out, int q_norm, float q_eps, RopeP q_rope, const u64 *kvt, const int *window_at
#define ATT_SPLIT_ARGS                                                                     \
    step, q, ring, raw_cap, window, comp, ratio, sel, top_k, sinks, heads, hd, scale,       \
        rows_per_chunk, part_acc, part_ml, out, q_norm, q_eps, q_rope, kvt, window_at

__device__ __forceinline__ void att_cp16(void* smem, const void* src) {
    const u32 d = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
}

template <bool STAGED, bool EARLY>
__device__ __forceinline__ void attention_split_body(ATT_SPLIT_PARAMS) {
    static_assert(STAGED || !EARLY, "EARLY stages");
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    // EARLY: the RoPE frequencies of this lane's query tail dims (a table no kernel
    // writes), two per 4-value part: fr[j][e / 2] for dims 128·j + 4·lane + e, e ∈ {0, 2}.
    float fr[EARLY ? 4 : 1][2];
    if (EARLY && q_norm) {
        const int tail = hd - q_rope.rope_dim;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int d0 = 128 * j + 4 * lane;
#pragma unroll
            for (int e = 0; e < 4; e += 2)
                fr[EARLY ? j : 0][e / 2] =
                    d0 + e < hd && d0 + e >= tail ? q_rope.freqs[(d0 + e - tail) / 2] : 0.f;
        }
    }
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const int c = blockIdx.x;
    const int n_chunks = gridDim.x;
    const int t = blockIdx.z;
    const int h = blockIdx.y * ATT_HEADS_PER_BLOCK + wid;
    // A batched step over several sessions: token t's own ring and rows (kvt).
    ring = kvt_ptr(kvt, t, KVT_RING, ring);
    comp = kvt_ptr(kvt, t, KVT_COMP, comp);
    raw_cap = kvt_raw_cap(kvt, t, raw_cap);
    // window_at: the window as a device value (the MTP block's ring count, which grows
    // after a prompt: one captured draft serves every count). Written before the
    // launch's graph by a copy on its stream, so readable before or after the PDL wait.
    if (window_at != nullptr) window = min(window, *window_at);
    const AttRows rows(step, t, window, ratio, sel, top_k);
    const int total = rows.total;
    // rows_per_chunk 0: split this token's rows evenly over the chunks (decode: every
    // chunk gets a few rows whatever the context, so no block walks a long dependent
    // chain of row loads).
    const int rpc = rows_per_chunk > 0 ? rows_per_chunk : (total + n_chunks - 1) / n_chunks;
    const int r0 = min(total, c * rpc), r1 = min(total, r0 + rpc);
    // STAGED: every warp takes part in the copies and barriers, heads or not.
    if (!STAGED && h >= heads) return;
    const bool live = h < heads;
    extern __shared__ float4 att_stage[];  // STAGED: ATT_STAGE_ROWS rows of hd floats
    // Issues the copies of rows [rb, min(r1, rb + ATT_STAGE_ROWS)) into att_stage.
    auto stage = [&](int rb) {
        const int re = min(r1, rb + ATT_STAGE_ROWS);
        const int q4 = hd / 4, n4 = (re - rb) * q4;
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            const int rr = i / q4;
            att_cp16(&att_stage[i], rows.row(rb + rr, ring, raw_cap, comp, hd) + 4 * (i - rr * q4));
        }
    };
    if (EARLY && r0 < r1) stage(r0);
    // Lane part j holds dims 128·j + 4·lane … + 3 when they exist (hd ≤ 512).
    const int njl = (hd - 4 * lane + 127) / 128;
    float qv[16], acc[16];
    const float* qh = q + ((i64)t * heads + (live ? h : 0)) * hd;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (j < njl) {
            const float4 a = *reinterpret_cast<const float4*>(qh + 128 * j + 4 * lane);
            qv[4 * j] = a.x;
            qv[4 * j + 1] = a.y;
            qv[4 * j + 2] = a.z;
            qv[4 * j + 3] = a.w;
        } else {
            qv[4 * j] = qv[4 * j + 1] = qv[4 * j + 2] = qv[4 * j + 3] = 0.f;
        }
    }
    // q_norm: head_norm_rope's work on this warp's head, in registers (decode: one
    // launch less between the query projection and the attention; every chunk redoes
    // it, 512 values per head). RoPE pairs sit in one lane's 4 values (the tail starts
    // at an even dim).
    if (q_norm) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) ss += qv[i] * qv[i];
        ss = warp_sum(ss);
        const float sc = 1.0f / sqrtf(ss / (float)hd + q_eps);
        const float pos = (float)step[t].pos;
        const int tail = hd - q_rope.rope_dim;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) qv[4 * j + e] *= sc;
            const int d0 = 128 * j + 4 * lane;
            if (j < njl && d0 + 3 >= tail) {
#pragma unroll
                for (int e = 0; e < 4; e += 2)
                    if (d0 + e >= tail) {
                        if (EARLY)
                            rope_pair_f(qv[4 * j + e], qv[4 * j + e + 1],
                                        fr[EARLY ? j : 0][e / 2], pos, false);
                        else
                            rope_pair(qv[4 * j + e], qv[4 * j + e + 1], (d0 + e - tail) / 2,
                                      pos, q_rope, false);
                    }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) qv[i] *= scale;
#pragma unroll
    for (int i = 0; i < 16; ++i) acc[i] = 0.f;
    float m = -3.0e38f, l = 0.f;
    // Four rows per step: their loads and reductions overlap, and the running max and
    // the accumulator are rescaled once per step.
    for (int rb = r0; rb < r1; rb += ATT_STAGE_ROWS) {
    const int re = min(r1, rb + ATT_STAGE_ROWS);
    if (STAGED) {
        if (!EARLY || rb != r0) {
            __syncthreads();  // the previous batch has been read
            stage(rb);
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
    }
    for (int r = rb; r < re; r += ATT_ROWS_PER_STEP) {
        float v[ATT_ROWS_PER_STEP][16];
        float d[ATT_ROWS_PER_STEP];
#pragma unroll
        for (int u = 0; u < ATT_ROWS_PER_STEP; ++u) {
            const int ru = r + u;
            const float* row =
                ru < r1 ? (STAGED ? reinterpret_cast<const float*>(att_stage) + (i64)(ru - rb) * hd
                                  : rows.row(ru, ring, raw_cap, comp, hd))
                        : nullptr;
            d[u] = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (row && j < njl) {
                    const float4 b = *reinterpret_cast<const float4*>(row + 128 * j + 4 * lane);
                    v[u][4 * j] = b.x;
                    v[u][4 * j + 1] = b.y;
                    v[u][4 * j + 2] = b.z;
                    v[u][4 * j + 3] = b.w;
                } else {
                    v[u][4 * j] = v[u][4 * j + 1] = v[u][4 * j + 2] = v[u][4 * j + 3] = 0.f;
                }
                d[u] += qv[4 * j] * v[u][4 * j] + qv[4 * j + 1] * v[u][4 * j + 1] +
                        qv[4 * j + 2] * v[u][4 * j + 2] + qv[4 * j + 3] * v[u][4 * j + 3];
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int u = 0; u < ATT_ROWS_PER_STEP; ++u)
                d[u] += __shfl_xor_sync(0xffffffffu, d[u], o);
        float mn = m;
#pragma unroll
        for (int u = 0; u < ATT_ROWS_PER_STEP; ++u)
            if (r + u < r1) mn = fmaxf(mn, d[u]);
        const float corr = expf(m - mn);
        float p[ATT_ROWS_PER_STEP];
        l *= corr;
#pragma unroll
        for (int u = 0; u < ATT_ROWS_PER_STEP; ++u) {
            p[u] = r + u < r1 ? expf(d[u] - mn) : 0.f;
            l += p[u];
        }
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            float a = acc[j] * corr;
#pragma unroll
            for (int u = 0; u < ATT_ROWS_PER_STEP; ++u) a += p[u] * v[u][j];
            acc[j] = a;
        }
        m = mn;
    }
    }
    if (!live) return;
    PDL_TRIGGER();
    if (n_chunks == 1) {
        // Finish here: the sink joins the denominator only.
        const float sk = sinks[h];
        const float mm = fmaxf(m, sk);
        const float den = l * expf(m - mm) + expf(sk - mm);
        const float f = expf(m - mm) / den;
        float* o = out + ((i64)t * heads + h) * hd;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (j < njl) {
                float4 a;
                a.x = acc[4 * j] * f;
                a.y = acc[4 * j + 1] * f;
                a.z = acc[4 * j + 2] * f;
                a.w = acc[4 * j + 3] * f;
                *reinterpret_cast<float4*>(o + 128 * j + 4 * lane) = a;
            }
        }
        return;
    }
    const i64 pi = ((i64)t * heads + h) * n_chunks + c;
    float* pa = part_acc + pi * hd;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (j < njl) {
            float4 a;
            a.x = acc[4 * j];
            a.y = acc[4 * j + 1];
            a.z = acc[4 * j + 2];
            a.w = acc[4 * j + 3];
            *reinterpret_cast<float4*>(pa + 128 * j + 4 * lane) = a;
        }
    }
    if (lane == 0) {
        part_ml[2 * pi] = r0 < r1 ? m : -3.0e38f;
        part_ml[2 * pi + 1] = r0 < r1 ? l : 0.f;
    }
}

extern "C" __global__ void __launch_bounds__(256) attention_split(ATT_SPLIT_PARAMS) {
    attention_split_body<false, false>(ATT_SPLIT_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) attention_split_staged(ATT_SPLIT_PARAMS) {
    attention_split_body<true, false>(ATT_SPLIT_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) attention_split_early(ATT_SPLIT_PARAMS) {
    attention_split_body<true, true>(ATT_SPLIT_ARGS);
}

// Combines the chunks of attention_split: block (h, t), the sink in the denominator.
// The first warp turns the chunks' (max, sum) into one weight per chunk (in shared
// memory, n_chunks ≤ ATT_MAX_CHUNKS) while the other threads already load their first
// chunks; thread i owns dims 4i…4i+3 (hd ≤ 512) and sums them over the chunks in order
// with ATT_COMBINE_UNROLL loads in flight (one dependent L2 round trip per chunk made
// this kernel as slow as the attention itself). With rope set, the epilogue applies the
// inverse RoPE of the tail (rope_tail's arithmetic) and, with q set, writes the Q8_0
// form of the output (8 threads per block of 32; hd a multiple of 32).
// PRELOAD (attention_combine_pl, `combine_pl`): every chunk's load in flight at once
// (32, the decode split; the plain kernel waits for 4 batches of 8 in turn), the RoPE
// frequencies (a table no kernel writes) before the PDL wait and the position right
// after it, not at the end of the chain. Same sums in the same order.
#define ATT_MAX_CHUNKS 128
#define ATT_COMBINE_UNROLL 8
#define ATT_COMBINE_UNROLL_PL 32
#define ATT_COMBINE_PARAMS                                                                   \
    const float *part_acc, const float *part_ml, const float *sinks, int heads, int hd,      \
        int n_chunks, float *out, const Step *step, RopeP rope, int rope_on, i8 *q, float *qd
#define ATT_COMBINE_ARGS \
    part_acc, part_ml, sinks, heads, hd, n_chunks, out, step, rope, rope_on, q, qd
template <bool PRELOAD>
__device__ __forceinline__ void attention_combine_body(ATT_COMBINE_PARAMS) {
    constexpr int UNROLL = PRELOAD ? ATT_COMBINE_UNROLL_PL : ATT_COMBINE_UNROLL;
    const int i0 = 4 * threadIdx.x;
    const bool on = i0 < hd;
    const int tail0 = hd - rope.rope_dim;
    const bool rot = rope_on && on && i0 >= tail0;
    float fq[2] = {0.f, 0.f};
    if (PRELOAD && rot) {
        fq[0] = rope.freqs[(i0 - tail0) / 2];
        fq[1] = rope.freqs[(i0 - tail0) / 2 + 1];
    }
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float wc[ATT_MAX_CHUNKS];
    const int h = blockIdx.x, t = blockIdx.y;
    const i64 base = ((i64)t * heads + h) * n_chunks;
    const float* pa = part_acc + base * hd + (on ? i0 : 0);
    float4 a[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
        if (on && u < n_chunks) a[u] = ldx4(pa + (i64)u * hd);
    const float pos_pl = PRELOAD && rot ? (float)step[t].pos : 0.f;
    if (threadIdx.x < WARP) {
        const int lane = threadIdx.x;
        const float sk = sinks[h];
        float mm = sk;
        for (int c = lane; c < n_chunks; c += WARP) mm = fmaxf(mm, part_ml[2 * (base + c)]);
        mm = warp_max(mm);
        float den = 0.f;
        for (int c = lane; c < n_chunks; c += WARP) {
            const float l = part_ml[2 * (base + c) + 1];
            const float e = l > 0.f ? expf(part_ml[2 * (base + c)] - mm) : 0.f;
            wc[c] = e;
            den += l * e;
        }
        den = warp_sum(den) + expf(sk - mm);
        const float inv = 1.f / den;
        for (int c = lane; c < n_chunks; c += WARP) wc[c] *= inv;
    }
    __syncthreads();
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c0 = 0; c0 < n_chunks; c0 += UNROLL) {
        if (c0 > 0) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (on && c0 + u < n_chunks) a[u] = ldx4(pa + (i64)(c0 + u) * hd);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (c0 + u >= n_chunks) break;
            const float w = wc[c0 + u];
            if (w != 0.f) {
                s[0] += a[u].x * w;
                s[1] += a[u].y * w;
                s[2] += a[u].z * w;
                s[3] += a[u].w * w;
            }
        }
    }
    if (rot) {
        if (PRELOAD) {
            rope_pair_f(s[0], s[1], fq[0], pos_pl, true);
            rope_pair_f(s[2], s[3], fq[1], pos_pl, true);
        } else {
            const int k = (i0 - tail0) / 2;
            const float pos = (float)step[t].pos;
            rope_pair(s[0], s[1], k, pos, rope, true);
            rope_pair(s[2], s[3], k + 1, pos, rope, true);
        }
    }
    const i64 o = ((i64)t * heads + h) * hd + i0;
    if (on) *reinterpret_cast<float4*>(out + o) = make_float4(s[0], s[1], s[2], s[3]);
    if (q == nullptr) return;
    quant_block32_x4(s, on, q + o, qd + o / 32);
}

KERNEL_PAIR(__launch_bounds__(128), attention_combine, attention_combine_pl,
            attention_combine_body, ATT_COMBINE_PARAMS, ATT_COMBINE_ARGS)
