// The non-matmul operations of a DeepSeek V4 layer (architecture.md §5). Every count
// that depends on the position (raw rows in the window, compressed rows, frontier
// slots) is derived from `step->pos` in device memory, so one token's launches can be
// captured in a CUDA graph and replayed. Per-token kernels take the token of a batch
// from blockIdx.y (decode: one token, gridDim.y = 1): `step` is then an array and the
// token's rows are found at the natural per-token strides.
#include "common.cuh"

#define NEG_INF_F (-1e30f)

struct Step {
    i32 pos;    // position of the token being decoded
    i32 token;  // its id
};

// Weight storage types of the small dense tensors (norms, fns, embedding rows).
#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2

__device__ __forceinline__ float ldw(const void* w, int type, i64 i) {
    if (type == WT_F16) return h2f(reinterpret_cast<const u16*>(w)[i]);
    if (type == WT_BF16) return __uint_as_float(((u32)reinterpret_cast<const u16*>(w)[i]) << 16);
    return reinterpret_cast<const float*>(w)[i];
}

// Block-wide sum (blockDim.x ≤ 1024, a multiple of 32). `red` holds ≥ 32 floats.
__device__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    const int nw = blockDim.x / WARP;
    v = threadIdx.x < nw ? red[threadIdx.x] : 0.f;
    if (wid == 0) v = warp_sum(v);
    if (threadIdx.x == 0) red[0] = v;
    __syncthreads();
    const float r = red[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float* red) {
    v = warp_max(v);
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    const int nw = blockDim.x / WARP;
    v = threadIdx.x < nw ? red[threadIdx.x] : -3.0e38f;
    if (wid == 0) v = warp_max(v);
    if (threadIdx.x == 0) red[0] = v;
    __syncthreads();
    const float r = red[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float sigmoidf_(float x) {
    return x >= 0.f ? 1.f / (1.f + expf(-x)) : expf(x) / (1.f + expf(x));
}

// The Q8_0 activation rule (quant_block32) over 8 consecutive threads of a warp that
// hold 4 consecutive values each (v; a block of 32 starts at a thread ≡ 0 mod 8): q
// points at the thread's 4 int8 values, d at its block's scale. Every thread of the warp
// calls it (the shuffles); threads with on = false hold no values and write nothing.
__device__ __forceinline__ void quant_block32_x4(const float v[4], bool on, i8* q, float* d) {
    float amax = on ? fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))) : 0.f;
#pragma unroll
    for (int m = 1; m < 8; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    u32 packed = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int qi = max(-128, min(127, __float2int_rn(v[k] * id)));
        packed |= ((u32)qi & 0xffu) << (8 * k);
    }
    if (on) {
        *reinterpret_cast<u32*>(q) = packed;
        if ((threadIdx.x & 7) == 0) *d = dd;
    }
}

// ---- embedding: every HC stream starts as the token's embedding row.
extern "C" __global__ void embed(const Step* step, const void* table, int type, int n_embd,
                                 int n_hc, float* h) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const i64 row = (i64)step[blockIdx.y].token * n_embd;
    h += (i64)blockIdx.y * n_hc * n_embd;
    for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < n_embd; i += blockDim.x * gridDim.x) {
        float v;
        if (type == 8) {  // Q8_0 rows: 34-byte blocks
            const u8* b = reinterpret_cast<const u8*>(table) + (row + i) / 32 * 34;
            v = h2f((u16)(b[0] | (b[1] << 8))) * (float)(i8)b[2 + (row + i) % 32];
        } else {
            v = ldw(table, type, row + i);
        }
        for (int s = 0; s < n_hc; ++s) h[(i64)s * n_embd + i] = v;
    }
}

// ---- hyper-connection mixer: mix[k] = rms_scale(H) · (fn_k · H), one block per k.
// One step of the vector path: 8 values of H (a, b) against 8 weights.
__device__ __forceinline__ void hc_mix_step(const float4 a, const float4 b, const float (&wv)[8],
                                            float& ss, float& dot) {
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        ss += v[j] * v[j];
        dot += wv[j] * v[j];
    }
}

// The raw bytes of a step's 8 weights at element `at` (F16: one 16-byte word; F32: two).
__device__ __forceinline__ void hc_mix_load(const void* fn, int fn_type, i64 at, uint4 (&raw)[2]) {
    if (fn_type == WT_F16) {
        raw[0] = *reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(fn) + at);
    } else {
        const float* wr = reinterpret_cast<const float*>(fn) + at;
        raw[0] = *reinterpret_cast<const uint4*>(wr);
        raw[1] = *reinterpret_cast<const uint4*>(wr + 4);
    }
}

// Those bytes as 8 floats.
__device__ __forceinline__ void hc_mix_unpack(int fn_type, const uint4 (&raw)[2], float (&wv)[8]) {
    if (fn_type == WT_F16) {
        const u32 ww[4] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            wv[2 * j] = h2f((u16)(ww[j] & 0xffff));
            wv[2 * j + 1] = h2f((u16)(ww[j] >> 16));
        }
    } else {
        const u32 c[8] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w,
                          raw[1].x, raw[1].y, raw[1].z, raw[1].w};
#pragma unroll
        for (int j = 0; j < 8; ++j) wv[j] = __uint_as_float(c[j]);
    }
}

// The 8 weights of a step at element i of row k (F16 or F32).
__device__ __forceinline__ void hc_mix_weights(const void* fn, int fn_type, i64 at, float (&wv)[8]) {
    uint4 raw[2];
    hc_mix_load(fn, fn_type, at, raw);
    hc_mix_unpack(fn_type, raw, wv);
}

// PRELOAD (hc_mix_pl, `hc_preload`): the first HC_MIX_PRE steps' loads are all issued
// before any is used (decode: n = 16,384 is exactly two steps of 1,024 threads), the
// weights of those steps (no kernel writes them) before the PDL wait, and the two block
// sums share their barriers (same trees: the same bits).
#define HC_MIX_PRE 2
template <bool PRELOAD>
__device__ __forceinline__ void hc_mix_body(const float* h, int n, const void* fn, int fn_type,
                                            float eps, float* mix) {
    const int k = blockIdx.x;
    h += (i64)blockIdx.y * n;
    mix += (i64)blockIdx.y * gridDim.x;
    const bool vec = (fn_type == WT_F16 || fn_type == WT_F32) && n % 8 == 0 &&
                     (reinterpret_cast<size_t>(h) & 15) == 0 &&
                     (reinterpret_cast<size_t>(fn) & 15) == 0;
    // Raw words: every load goes out before any is converted.
    uint4 wraw[PRELOAD ? HC_MIX_PRE : 1][2];
    if (PRELOAD && vec) {
#pragma unroll
        for (int u = 0; u < HC_MIX_PRE; ++u) {
            const int iu = threadIdx.x * 8 + u * blockDim.x * 8;
            if (iu < n) hc_mix_load(fn, fn_type, (i64)k * n + iu, wraw[PRELOAD ? u : 0]);
        }
    }
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float red[32], red2[32];
    float ss = 0.f, dot = 0.f;
    if (vec) {
        // 8 values per thread and step with 16-byte loads: the loop is a chain of
        // dependent L2 round trips, so fewer, wider steps (decode latency).
        int i = threadIdx.x * 8;
        if (PRELOAD) {
            float4 a[HC_MIX_PRE], b[HC_MIX_PRE];
#pragma unroll
            for (int u = 0; u < HC_MIX_PRE; ++u) {
                const int iu = i + u * blockDim.x * 8;
                if (iu < n) {
                    a[u] = *reinterpret_cast<const float4*>(h + iu);
                    b[u] = *reinterpret_cast<const float4*>(h + iu + 4);
                }
            }
#pragma unroll
            for (int u = 0; u < HC_MIX_PRE; ++u) {
                if (i + u * blockDim.x * 8 < n) {
                    float wv[8];
                    hc_mix_unpack(fn_type, wraw[PRELOAD ? u : 0], wv);
                    hc_mix_step(a[u], b[u], wv, ss, dot);
                }
            }
            i += HC_MIX_PRE * blockDim.x * 8;
        }
        for (; i < n; i += blockDim.x * 8) {
            const float4 a = *reinterpret_cast<const float4*>(h + i);
            const float4 b = *reinterpret_cast<const float4*>(h + i + 4);
            float wv[8];
            hc_mix_weights(fn, fn_type, (i64)k * n + i, wv);
            hc_mix_step(a, b, wv, ss, dot);
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float v = h[i];
            ss += v * v;
            dot += ldw(fn, fn_type, (i64)k * n + i) * v;
        }
    }
    if (!PRELOAD) {
        ss = block_sum(ss, red);
        dot = block_sum(dot, red);
        if (threadIdx.x == 0) mix[k] = dot * (1.0f / sqrtf(ss / (float)n + eps));
        return;
    }
    // block_sum's tree for both values at once.
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    if (lane == 0) {
        red[wid] = ss;
        red2[wid] = dot;
    }
    __syncthreads();
    if (wid == 0) {
        const int nw = blockDim.x / WARP;
        ss = warp_sum(lane < nw ? red[lane] : 0.f);
        dot = warp_sum(lane < nw ? red2[lane] : 0.f);
        if (lane == 0) mix[k] = dot * (1.0f / sqrtf(ss / (float)n + eps));
    }
}

extern "C" __global__ void __launch_bounds__(1024) hc_mix(const float* h, int n, const void* fn,
                                                          int fn_type, float eps, float* mix) {
    hc_mix_body<false>(h, n, fn, fn_type, eps, mix);
}
extern "C" __global__ void __launch_bounds__(1024) hc_mix_pl(const float* h, int n,
                                                             const void* fn, int fn_type,
                                                             float eps, float* mix) {
    hc_mix_body<true>(h, n, fn, fn_type, eps, mix);
}

// ---- HC mix of a batch, second half: `mix` holds the raw dots fn_k · h_t (a GEMM);
// block t scales its n_out values by the RMS factor of h_t.
extern "C" __global__ void __launch_bounds__(256) hc_mix_scale(const float* h, int n,
                                                               float eps, float* mix, int n_out) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float red[32];
    h += (i64)blockIdx.x * n;
    mix += (i64)blockIdx.x * n_out;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += h[i] * h[i];
    ss = block_sum(ss, red);
    const float f = 1.0f / sqrtf(ss / (float)n + eps);
    if (threadIdx.x < n_out) mix[threadIdx.x] *= f;
}

// ---- HC post and comb: hcp receives post (n_hc) then comb (n_hc², Sinkhorn-
// normalised). Only hc_post reads them, so the engine runs this beside the sublayer
// (a side lane) instead of in hc_pre: Sinkhorn's serial chain was most of a decode
// token's hc_pre time. One warp per token (blockIdx.x · 8 + warp), one lane per element
// of the comb matrix (n_hc ≤ 5), in registers: row and column sums gather the other
// lanes' values with shuffles, in the same order as the CPU.
extern "C" __global__ void __launch_bounds__(256) hc_comb(const float* mix, const float* scale,
        const float* base, int n_hc, int iters, float eps, float* hcp, int n_tok) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const int tok = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (tok >= n_tok) return;
    const int t = threadIdx.x % WARP;
    const int nn = n_hc * n_hc;
    mix += (i64)tok * (2 + n_hc) * n_hc;
    hcp += (i64)tok * (n_hc + nn);
    const int i = t < nn ? t / n_hc : 0, j = t < nn ? t % n_hc : 0;
    if (t < n_hc) hcp[t] = 2.f * sigmoidf_(mix[n_hc + t] * scale[1] + base[n_hc + t]);
    float c = t < nn ? mix[2 * n_hc + t] * scale[2] + base[2 * n_hc + t] : 0.f;
    float mx = __shfl_sync(0xffffffffu, c, i * n_hc);
    for (int k = 1; k < n_hc; ++k) mx = fmaxf(mx, __shfl_sync(0xffffffffu, c, i * n_hc + k));
    c = t < nn ? expf(c - mx) : 0.f;
    float sum = 0.f;
    for (int k = 0; k < n_hc; ++k) sum += __shfl_sync(0xffffffffu, c, i * n_hc + k);
    c = c * (1.f / sum) + eps;
    for (int it = 0; it < iters; ++it) {
        if (it > 0) {
            sum = 0.f;
            for (int k = 0; k < n_hc; ++k) sum += __shfl_sync(0xffffffffu, c, i * n_hc + k);
            c = c * (1.f / (sum + eps));
        }
        sum = 0.f;
        for (int k = 0; k < n_hc; ++k) sum += __shfl_sync(0xffffffffu, c, k * n_hc + j);
        c = c * (1.f / (sum + eps));
    }
    if (t < nn) hcp[n_hc + t] = c;
}

// ---- HC pre: the sublayer input y = Σ_i pre_i·H_i with pre = σ(mix·scale₀ + base) +
// eps; with norm_out set, the sublayer's RMS norm follows in the same block: norm_out =
// rmsnorm(y)·norm_w and, with q set, its Q8_0 form (q, d). One block per token (y);
// thread t owns values 4t…4t+3 (+ 4·blockDim·p, p < HC_PRE_VEC) and keeps them in
// registers from the loads of H to the quantised store: a decode token's hc_pre is a
// chain of L2 round trips, so it makes one pass (8 threads form a Q8_0 block).
// n_embd is a multiple of 32, at most 4·HC_PRE_VEC·blockDim; blockDim is 1024 for
// n_embd ≥ 1024, else 256 (rmsnorm's sum order).
#define HC_PRE_VEC 2
#define HC_MAX 5
#define HC_PRE_PARAMS                                                                     \
    const float *h, const float *mix, const float *scale, const float *base, int n_hc,     \
        int n_embd, float eps, float *y, const void *norm_w, int norm_type, float norm_eps, \
        float *norm_out, i8 *q, float *d
#define HC_PRE_ARGS \
    h, mix, scale, base, n_hc, n_embd, eps, y, norm_w, norm_type, norm_eps, norm_out, q, d
// PRELOAD (hc_pre_pl, `hc_preload`): every load of H is issued before the first store
// (y may alias h for all the compiler knows, so the plain kernel's second pass waits for
// the first one's stores: two L2 round trips instead of one). Same sums.
template <bool PRELOAD>
__device__ __forceinline__ void hc_pre_body(HC_PRE_PARAMS) {
    // PRELOAD: the norm weights (never written by a kernel) are loaded before the PDL
    // wait; the plain kernel loads them after the block's reduction, one more L2 round
    // trip at the end of the chain.
    float nw[PRELOAD ? HC_PRE_VEC : 1][4];
    if (PRELOAD && norm_w) {
#pragma unroll
        for (int p = 0; p < HC_PRE_VEC; ++p) {
            const int i0 = 4 * (threadIdx.x + p * blockDim.x);
#pragma unroll
            for (int k = 0; k < 4; ++k)
                nw[PRELOAD ? p : 0][k] = i0 < n_embd ? ldw(norm_w, norm_type, i0 + k) : 0.f;
        }
    }
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float red[32];
    __shared__ __align__(16) float ys[HC_PRE_VEC * 4 * 1024];
    const int t = threadIdx.x;
    h += (i64)blockIdx.y * n_hc * n_embd;
    mix += (i64)blockIdx.y * (2 + n_hc) * n_hc;
    y += (i64)blockIdx.y * n_embd;
    // PRELOAD: the first pass's stream loads (all of them at n_embd ≤ 4·blockDim; at
    // most HC_PRE_PL = the model's 4 streams) are issued first, as they do not depend
    // on the mix, then every mix and base load before the first sigmoid (the plain loop
    // waits for each stream's pair in turn: a chain of n_hc round trips before H).
    constexpr int HC_PRE_PL = 4;
    const bool pl = PRELOAD && n_hc <= HC_PRE_PL;
    float4 h0[PRELOAD ? HC_PRE_PL : 1];
    if (pl) {
#pragma unroll
        for (int i = 0; i < HC_PRE_PL; ++i)
            if (4 * t < n_embd && i < n_hc) h0[PRELOAD ? i : 0] = ldx4(h + (i64)i * n_embd + 4 * t);
    }
    float pre[HC_MAX];
    if (PRELOAD) {
        float mv[HC_MAX], bv[HC_MAX];
        const float s0 = scale[0];
#pragma unroll
        for (int i = 0; i < HC_MAX; ++i)
            if (i < n_hc) {
                mv[i] = mix[i];
                bv[i] = base[i];
            }
#pragma unroll
        for (int i = 0; i < HC_MAX; ++i)
            pre[i] = i < n_hc ? sigmoidf_(mv[i] * s0 + bv[i]) + eps : 0.f;
    } else {
#pragma unroll
        for (int i = 0; i < HC_MAX; ++i)
            pre[i] = i < n_hc ? sigmoidf_(mix[i] * scale[0] + base[i]) + eps : 0.f;
    }
    float v[HC_PRE_VEC][4];
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < HC_PRE_VEC; ++p) {
        const int i0 = 4 * (t + p * blockDim.x);
        float a[4] = {0.f, 0.f, 0.f, 0.f};
        if (i0 < n_embd) {
            float4 hv[HC_MAX];
#pragma unroll
            for (int i = 0; i < HC_MAX; ++i)
                if (i < n_hc)
                    hv[i] = pl && p == 0 && i < HC_PRE_PL ? h0[PRELOAD && i < HC_PRE_PL ? i : 0]
                                                          : ldx4(h + (i64)i * n_embd + i0);
#pragma unroll
            for (int i = 0; i < HC_MAX; ++i) {
                if (i < n_hc) {
                    a[0] += pre[i] * hv[i].x;
                    a[1] += pre[i] * hv[i].y;
                    a[2] += pre[i] * hv[i].z;
                    a[3] += pre[i] * hv[i].w;
                }
            }
            *reinterpret_cast<float4*>(y + i0) = make_float4(a[0], a[1], a[2], a[3]);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) v[p][k] = a[k];
        // PRELOAD: one 16-byte store (4 wavefronts a warp) where four scalar stores at
        // a 4-word lane stride were 4-way bank conflicts (16 wavefronts a warp, ~1K
        // shared-memory cycles for a 1024-thread block).
        if (i0 < n_embd) {
            if (PRELOAD) {
                *reinterpret_cast<float4*>(ys + i0) = make_float4(a[0], a[1], a[2], a[3]);
            } else {
#pragma unroll
                for (int k = 0; k < 4; ++k) ys[i0 + k] = a[k];
            }
        }
    }
    if (norm_out == nullptr) return;
    __syncthreads();
    // The sum of squares in rmsnorm's order (thread t of nt adds y[t], y[t + nt], …), so
    // the norm is bit-identical to the rmsnorm kernel's: a different order moves the
    // near-ties of routing and top-k selection between the batched and decode paths.
    const int nt = n_embd >= 1024 ? 1024 : 256;
    if (t < nt)
        for (int i = t; i < n_embd; i += nt) ss += ys[i] * ys[i];
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)n_embd + norm_eps);
    norm_out += (i64)blockIdx.y * n_embd;
    if (q != nullptr) {
        q += (i64)blockIdx.y * n_embd;
        d += (i64)blockIdx.y * (n_embd / 32);
    }
#pragma unroll
    for (int p = 0; p < HC_PRE_VEC; ++p) {
        const int i0 = 4 * (t + p * blockDim.x);
        const bool on = i0 < n_embd;
        float o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            o[k] = v[p][k] * sc;
            if (on && norm_w) o[k] = o[k] * (PRELOAD ? nw[PRELOAD ? p : 0][k] : ldw(norm_w, norm_type, i0 + k));
        }
        if (on) *reinterpret_cast<float4*>(norm_out + i0) = make_float4(o[0], o[1], o[2], o[3]);
        if (q == nullptr) continue;
        quant_block32_x4(o, on, q + i0, d + i0 / 32);
    }
}

extern "C" __global__ void __launch_bounds__(1024) hc_pre(HC_PRE_PARAMS) {
    hc_pre_body<false>(HC_PRE_ARGS);
}
extern "C" __global__ void __launch_bounds__(1024) hc_pre_pl(HC_PRE_PARAMS) {
    hc_pre_body<true>(HC_PRE_ARGS);
}

// ---- HC post: H'_j = out·post_j + Σ_i comb[i][j]·H_i.
// With `parts` (n_parts rows of n_embd per token), the sublayer output is their sum
// plus `out` (the routed experts in order k, then the shared expert).
// PRELOAD (hc_post_pl, `hc_preload`): out, the first HC_POST_PARTS parts, the streams
// and post/comb are all loaded before the first store (h_out may alias them for all the
// compiler knows, so the plain kernel reloads after each store). Same sums, and the
// same roundings: unrolled, o·post + comb·H may contract either product into the FMA
// (the first hc_post_pl fused o·post and failed its bit-identity check), so both
// kernels spell the multiply and the FMAs out.
#define HC_POST_PARTS 8
template <bool PRELOAD>
__device__ __forceinline__ void hc_post_body(const float* h, const float* out,
                                             const float* parts, int n_parts, const float* hcp,
                                             int n_hc, int n_embd, float* h_out) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    h += (i64)blockIdx.y * n_hc * n_embd;
    h_out += (i64)blockIdx.y * n_hc * n_embd;
    out += (i64)blockIdx.y * n_embd;
    if (parts) parts += (i64)blockIdx.y * n_parts * n_embd;
    hcp += (i64)blockIdx.y * (n_hc + n_hc * n_hc);
    if (PRELOAD && n_hc > HC_MAX) return;  // the launcher checks n_hc
    constexpr int PM = PRELOAD ? HC_MAX : 1;
    float post[PM], comb[PM][PM];
    if (PRELOAD) {
#pragma unroll
        for (int i = 0; i < PM; ++i) {
            if (i < n_hc) post[i] = hcp[i];
#pragma unroll
            for (int j = 0; j < PM; ++j)
                if (i < n_hc && j < n_hc) comb[i][j] = hcp[n_hc + i * n_hc + j];
        }
    }
    for (int d = threadIdx.x + blockIdx.x * blockDim.x; d < n_embd; d += blockDim.x * gridDim.x) {
        float o = out[d];
        if (PRELOAD) {
            constexpr int PP = PRELOAD ? HC_POST_PARTS : 1;
            float pv[PP], hv[PM];
#pragma unroll
            for (int k = 0; k < PP; ++k)
                if (parts && k < n_parts) pv[k] = parts[(i64)k * n_embd + d];
#pragma unroll
            for (int i = 0; i < PM; ++i)
                if (i < n_hc) hv[i] = h[(i64)i * n_embd + d];
            if (parts) {
                float acc = 0.f;
#pragma unroll
                for (int k = 0; k < PP; ++k)
                    if (k < n_parts) acc += pv[k];
                for (int k = PP; k < n_parts; ++k) acc += parts[(i64)k * n_embd + d];
                o = acc + o;
            }
#pragma unroll
            for (int j = 0; j < PM; ++j) {
                if (j < n_hc) {
                    float acc = __fmul_rn(o, post[j]);
#pragma unroll
                    for (int i = 0; i < PM; ++i)
                        if (i < n_hc) acc = __fmaf_rn(comb[i][j], hv[i], acc);
                    h_out[(i64)j * n_embd + d] = acc;
                }
            }
        } else {
            if (parts) {
                float acc = 0.f;
                for (int k = 0; k < n_parts; ++k) acc += parts[(i64)k * n_embd + d];
                o = acc + o;
            }
            for (int j = 0; j < n_hc; ++j) {
                float acc = __fmul_rn(o, hcp[j]);
                for (int i = 0; i < n_hc; ++i)
                    acc = __fmaf_rn(hcp[n_hc + i * n_hc + j], h[(i64)i * n_embd + d], acc);
                h_out[(i64)j * n_embd + d] = acc;
            }
        }
    }
}

extern "C" __global__ void hc_post(const float* h, const float* out, const float* parts,
                                   int n_parts, const float* hcp, int n_hc, int n_embd,
                                   float* h_out) {
    hc_post_body<false>(h, out, parts, n_parts, hcp, n_hc, n_embd, h_out);
}
extern "C" __global__ void hc_post_pl(const float* h, const float* out, const float* parts,
                                      int n_parts, const float* hcp, int n_hc, int n_embd,
                                      float* h_out) {
    hc_post_body<true>(h, out, parts, n_parts, hcp, n_hc, n_embd, h_out);
}

// ---- RMS norm of `rows` vectors of n (one block each); w may be null (unweighted).
extern "C" __global__ void __launch_bounds__(1024) rmsnorm(const float* x, const void* w, int w_type,
                                                           int n, float eps, float* y) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float red[32];
    const float* xr = x + (i64)blockIdx.x * n;
    float* yr = y + (i64)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i] * sc;
        yr[i] = w ? v * ldw(w, w_type, i) : v;
    }
}

// ---- RoPE over the last rope_dim dims of each vector: interleaved pairs, angle =
// pos · freq[k] with the per-pair frequencies (YaRN-blended on compressed layers)
// computed once on the host, exactly as the CPU backend uses them.
struct RopeP {
    const float* freqs;  // rope_dim / 2 entries
    i32 rope_dim;
    i32 pad;
};

// One RoPE rotation with its frequency already loaded (kernels that fetch the table
// early); rope_pair is this with the table read.
__device__ __forceinline__ void rope_pair_f(float& x0, float& x1, float freq, float pos,
                                            bool inverse) {
    const float th = pos * freq;
    const float c = cosf(th), s = (inverse ? -1.f : 1.f) * sinf(th);
    const float a = x0, b = x1;
    x0 = a * c - b * s;
    x1 = a * s + b * c;
}
__device__ __forceinline__ void rope_pair(float& x0, float& x1, int k, float pos, const RopeP& p,
                                          bool inverse) {
    rope_pair_f(x0, x1, p.freqs[k], pos, inverse);
}

extern "C" __global__ void rope_tail(const Step* step, float* x, int stride, int pos_offset,
                                     RopeP p, int inverse) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    float* v = x + ((i64)blockIdx.y * gridDim.x + blockIdx.x) * stride + (stride - p.rope_dim);
    const float pos = (float)(step[blockIdx.y].pos + pos_offset);
    for (int k = threadIdx.x; k < p.rope_dim / 2; k += blockDim.x)
        rope_pair(v[2 * k], v[2 * k + 1], k, pos, p, inverse != 0);
}

// Unweighted RMS norm of each head row (stride floats; block (head, token)), then RoPE
// on its tail: rmsnorm + rope_tail in one launch, with the same arithmetic in the same
// order (launch with 256 threads, as rmsnorm uses for rows under 1024).
extern "C" __global__ void __launch_bounds__(256) head_norm_rope(const Step* step, float* x,
        int stride, float eps, RopeP p) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float red[32];
    float* xr = x + ((i64)blockIdx.y * gridDim.x + blockIdx.x) * stride;
    float ss = 0.f;
    for (int i = threadIdx.x; i < stride; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)stride + eps);
    for (int i = threadIdx.x; i < stride; i += blockDim.x) xr[i] = xr[i] * sc;
    __syncthreads();
    float* v = xr + (stride - p.rope_dim);
    const float pos = (float)step[blockIdx.y].pos;
    for (int k = threadIdx.x; k < p.rope_dim / 2; k += blockDim.x)
        rope_pair(v[2 * k], v[2 * k + 1], k, pos, p, false);
}

// ---- QAT simulations.
// FP8 E4M3 over blocks of 64: scale 2^ceil(log2(amax/448)), round to nearest E4M3
// (ties to even), back to f32. One warp per block of 64 (2 values per lane).
__device__ __forceinline__ float e4m3_round(float a) {  // a ≥ 0, a ≤ 448
    if (a < 0.015625f) return rintf(a * 512.f) * (1.f / 512.f);  // subnormal: quantum 2^-9
    u32 b = __float_as_uint(a);
    b = (b + 0x7ffffu + ((b >> 20) & 1u)) & ~0xfffffu;          // keep 3 mantissa bits, RNE
    return __uint_as_float(b);
}

// ceil(log2(x)) from the bits for a positive normal x, as the official kernels (and
// the CPU backend) compute block scales; ceilf(log2f(x)) can be off by one just above
// a power of two.
__device__ __forceinline__ float pow2_ceil_log2(float x) {
    const u32 b = __float_as_uint(x);
    const int e = (int)((b >> 23) & 0xff);
    const int c = e == 0 ? (int)ceilf(log2f(x)) : e - 127 + ((b & 0x7fffffu) != 0);
    return ldexpf(1.0f, c);
}

__device__ void fp8_block64(float* v, int lane) {
    float a = v[lane], b = v[lane + 32];
    float amax = warp_max(fmaxf(fabsf(a), fabsf(b)));
    amax = fmaxf(amax, 1e-4f);
    const float s = pow2_ceil_log2(amax / 448.f);
    float qa = fminf(fabsf(a) / s, 448.f), qb = fminf(fabsf(b) / s, 448.f);
    v[lane] = copysignf(e4m3_round(qa) * s, a);
    v[lane + 32] = copysignf(e4m3_round(qb) * s, b);
}

__device__ __forceinline__ float e2m1_round(float a) {  // a ≥ 0, a ≤ 6
    if (a <= 0.25f) return 0.f;
    if (a < 0.75f) return 0.5f;
    if (a <= 1.25f) return 1.f;
    if (a < 1.75f) return 1.5f;
    if (a <= 2.5f) return 2.f;
    if (a < 3.5f) return 3.f;
    if (a <= 5.f) return 4.f;
    return 6.f;
}

// FP4 E2M1 over blocks of 32: one warp per block, one value per lane.
__device__ void fp4_block32(float* v, int lane) {
    const float a = v[lane];
    float amax = warp_max(fabsf(a));
    amax = fmaxf(amax, 7.052966104933725e-38f);
    const float s = pow2_ceil_log2(amax / 6.f);
    const float q = fminf(fabsf(a) / s, 6.f);
    v[lane] = copysignf(e2m1_round(q) * s, a);
}

// In-place Walsh-Hadamard of n (power of two ≤ 1024) values in shared memory, by the
// whole block, then × 1/√n.
__device__ void hadamard_smem(float* v, int n) {
    for (int stride = 1; stride < n; stride <<= 1) {
        __syncthreads();
        for (int t = threadIdx.x; t < n / 2; t += blockDim.x) {
            const int base = (t / stride) * 2 * stride, i = t % stride;
            const float a = v[base + i], b = v[base + stride + i];
            v[base + i] = a + b;
            v[base + stride + i] = a - b;
        }
    }
    __syncthreads();
    const float sc = 1.0f / sqrtf((float)n);
    for (int t = threadIdx.x; t < n; t += blockDim.x) v[t] *= sc;
    __syncthreads();
}

// f32 → f16 → f32, as every stored KV row in the fast numerics.
__device__ __forceinline__ float f16r(float x) { return h2f(f2h(x)); }

// ---- The new raw KV row: rmsnorm(kv, kv_norm), RoPE, FP8 on the nope dims, (f16
// round), stored at ring slot pos % raw_cap. One block, blockDim.x ≥ 32.
extern "C" __global__ void __launch_bounds__(512) kv_finish(const Step* step, const float* kv,
        const void* norm_w, int norm_type, int hd, float eps, RopeP p, int f16_round,
        float* ring, int raw_cap) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float v[1024];
    __shared__ float red[32];
    step += blockIdx.y;
    kv += (i64)blockIdx.y * hd;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) ss += kv[i] * kv[i];
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)hd + eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) v[i] = kv[i] * sc * ldw(norm_w, norm_type, i);
    __syncthreads();
    const float pos = (float)step->pos;
    const int nope = hd - p.rope_dim;
    for (int k = threadIdx.x; k < p.rope_dim / 2; k += blockDim.x)
        rope_pair(v[nope + 2 * k], v[nope + 2 * k + 1], k, pos, p, false);
    __syncthreads();
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    for (int b = wid; b < nope / 64; b += blockDim.x / WARP) fp8_block64(v + b * 64, lane);
    __syncthreads();
    float* dst = ring + (i64)(step->pos % raw_cap) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = f16_round ? f16r(v[i]) : v[i];
}

// ---- Compressor step (§5.4). kvs holds the new kv (w floats) then the new gate score
// (w floats, APE not yet added). State: skv, ssc [L·r][w]. When (pos+1) % r == 0 the
// pooled row is normed, rotated (position pos+1−r) and QAT-simulated, then stored as
// row (pos+1)/r − 1 of `rows`. mode 0: main (FP8 on nope dims), 1: indexer
// (Hadamard + FP4). One block of ≥ d threads (d ≤ 1024).
extern "C" __global__ void __launch_bounds__(1024) compressor_step(const Step* step,
        const float* kvs, const void* ape, int ape_type, float* skv, float* ssc, int ratio,
        int lanes, int d, const void* norm_w, int norm_type, float eps, RopeP p, int mode,
        int f16_round, float* rows) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float v[1024];
    __shared__ float red[32];
    const int w = lanes * d;
    const int pos = step->pos;
    const int pm = pos % ratio;
    const int slot = lanes == 2 ? ratio + pm : pm;
    for (int j = threadIdx.x; j < w; j += blockDim.x) {
        skv[(i64)slot * w + j] = kvs[j];
        ssc[(i64)slot * w + j] = kvs[w + j] + ldw(ape, ape_type, (i64)pm * w + j);
    }
    if ((pos + 1) % ratio != 0) return;
    __syncthreads();
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float mx = NEG_INF_F;
        if (lanes == 2) {
            for (int i = 0; i < ratio; ++i) {
                mx = fmaxf(mx, ssc[(i64)i * w + j]);
                mx = fmaxf(mx, ssc[(i64)(ratio + i) * w + d + j]);
            }
        } else {
            for (int i = 0; i < ratio; ++i) mx = fmaxf(mx, ssc[(i64)i * w + j]);
        }
        float num = 0.f, den = 0.f;
        if (mx > -5e29f) {
            if (lanes == 2) {
                for (int i = 0; i < ratio; ++i) {
                    float e = expf(ssc[(i64)i * w + j] - mx);
                    num += e * skv[(i64)i * w + j];
                    den += e;
                    e = expf(ssc[(i64)(ratio + i) * w + d + j] - mx);
                    num += e * skv[(i64)(ratio + i) * w + d + j];
                    den += e;
                }
            } else {
                for (int i = 0; i < ratio; ++i) {
                    const float e = expf(ssc[(i64)i * w + j] - mx);
                    num += e * skv[(i64)i * w + j];
                    den += e;
                }
            }
        }
        v[j] = mx > -5e29f ? num / den : 0.f;
    }
    __syncthreads();
    float ss = 0.f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) ss += v[j] * v[j];
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) v[j] = v[j] * sc * ldw(norm_w, norm_type, j);
    __syncthreads();
    const int nope = d - p.rope_dim;
    const float rpos = (float)(pos + 1 - ratio);
    for (int k = threadIdx.x; k < p.rope_dim / 2; k += blockDim.x)
        rope_pair(v[nope + 2 * k], v[nope + 2 * k + 1], k, rpos, p, false);
    __syncthreads();
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    if (mode == 0) {
        for (int b = wid; b < nope / 64; b += blockDim.x / WARP) fp8_block64(v + b * 64, lane);
    } else {
        hadamard_smem(v, d);
        for (int b = wid; b < d / 32; b += blockDim.x / WARP) fp4_block32(v + b * 32, lane);
    }
    __syncthreads();
    float* dst = rows + (i64)((pos + 1) / ratio - 1) * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = f16_round ? f16r(v[j]) : v[j];
    if (lanes == 2) {
        // The current window becomes the "previous" lane of the next row.
        __syncthreads();
        for (int i = threadIdx.x; i < ratio * w; i += blockDim.x) {
            skv[i] = skv[(i64)ratio * w + i];
            ssc[i] = ssc[(i64)ratio * w + i];
        }
    }
}

// ---- Batched compressor (prefill): the same result as compressor_step run for each of
// the batch's tokens in order. kvs holds per token the kv (w floats) then the raw gate
// score (w floats); tokens are at positions p0 = step[0].pos … p0 + n_tok − 1.
//
// A value of position q < p0 comes from the frontier state as it was before the
// batch: with one lane, slot q % r; with two lanes, the current-window slots r + q % r
// when q is in the window open at p0, the previous-window slots q mod r otherwise.
struct CompVal {
    float kv, sc;
};

__device__ __forceinline__ CompVal comp_value(int q, int col, int p0, const float* kvs,
        const void* ape, int ape_type, const float* skv, const float* ssc, int ratio, int lanes,
        int w) {
    const int m = ((q % ratio) + ratio) % ratio;
    CompVal v;
    if (q >= p0) {
        const float* t = kvs + (i64)(q - p0) * 2 * w;
        v.kv = t[col];
        v.sc = t[w + col] + ldw(ape, ape_type, (i64)m * w + col);
    } else {
        int slot = m;
        if (lanes == 2) {
            const int qw = q >= 0 ? q / ratio : -1;
            if (qw == p0 / ratio) slot = ratio + m;
        }
        v.kv = skv[(i64)slot * w + col];
        v.sc = ssc[(i64)slot * w + col];
    }
    return v;
}

// One block per row completed inside the batch (blockIdx.x = row − p0 / r).
extern "C" __global__ void __launch_bounds__(1024) compressor_emit(const Step* step, int n_tok,
        const float* kvs, const void* ape, int ape_type, const float* skv, const float* ssc,
        int ratio, int lanes, int d, const void* norm_w, int norm_type, float eps, RopeP p,
        int mode, int f16_round, float* rows) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float v[1024];
    __shared__ float red[32];
    const int w = lanes * d;
    const int p0 = step[0].pos;
    const int row = p0 / ratio + blockIdx.x;
    if (row > (p0 + n_tok) / ratio - 1) return;
    const int base = row * ratio;  // first position of the row's window
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float mx = NEG_INF_F;
        for (int i = 0; i < ratio; ++i) {
            if (lanes == 2) {
                mx = fmaxf(mx, comp_value(base - ratio + i, j, p0, kvs, ape, ape_type, skv, ssc,
                                          ratio, lanes, w).sc);
                mx = fmaxf(mx, comp_value(base + i, d + j, p0, kvs, ape, ape_type, skv, ssc, ratio,
                                          lanes, w).sc);
            } else {
                mx = fmaxf(mx, comp_value(base + i, j, p0, kvs, ape, ape_type, skv, ssc, ratio,
                                          lanes, w).sc);
            }
        }
        float num = 0.f, den = 0.f;
        if (mx > -5e29f) {
            for (int i = 0; i < ratio; ++i) {
                if (lanes == 2) {
                    CompVal a = comp_value(base - ratio + i, j, p0, kvs, ape, ape_type, skv, ssc,
                                           ratio, lanes, w);
                    float e = expf(a.sc - mx);
                    num += e * a.kv;
                    den += e;
                    a = comp_value(base + i, d + j, p0, kvs, ape, ape_type, skv, ssc, ratio, lanes,
                                   w);
                    e = expf(a.sc - mx);
                    num += e * a.kv;
                    den += e;
                } else {
                    const CompVal a = comp_value(base + i, j, p0, kvs, ape, ape_type, skv, ssc,
                                                 ratio, lanes, w);
                    const float e = expf(a.sc - mx);
                    num += e * a.kv;
                    den += e;
                }
            }
        }
        v[j] = mx > -5e29f ? num / den : 0.f;
    }
    __syncthreads();
    float ss = 0.f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) ss += v[j] * v[j];
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) v[j] = v[j] * sc * ldw(norm_w, norm_type, j);
    __syncthreads();
    const int nope = d - p.rope_dim;
    for (int k = threadIdx.x; k < p.rope_dim / 2; k += blockDim.x)
        rope_pair(v[nope + 2 * k], v[nope + 2 * k + 1], k, (float)base, p, false);
    __syncthreads();
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    if (mode == 0) {
        for (int b = wid; b < nope / 64; b += blockDim.x / WARP) fp8_block64(v + b * 64, lane);
    } else {
        hadamard_smem(v, d);
        for (int b = wid; b < d / 32; b += blockDim.x / WARP) fp4_block32(v + b * 32, lane);
    }
    __syncthreads();
    float* dst = rows + (i64)row * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = f16_round ? f16r(v[j]) : v[j];
}

// The frontier state after the batch (run after compressor_emit, which reads the old
// one). One thread per (slot j < r, column): the current-window slot gets the latest
// position ≡ j (mod r) when it is in the batch; with two lanes the previous-window slot
// gets position R·r + j of the last row R completed in the batch, if any.
extern "C" __global__ void compressor_state(const Step* step, int n_tok, const float* kvs,
        const void* ape, int ape_type, float* skv, float* ssc, int ratio, int lanes, int d) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const int w = lanes * d;
    const int p0 = step[0].pos;
    const int last = p0 + n_tok - 1;
    for (i64 e = threadIdx.x + (i64)blockIdx.x * blockDim.x; e < (i64)ratio * w;
         e += (i64)blockDim.x * gridDim.x) {
        const int j = (int)(e / w), col = (int)(e % w);
        const int cur = lanes == 2 ? ratio + j : j;
        CompVal prev_v;
        const int r_last = (last + 1) / ratio - 1;
        const bool emitted = r_last >= p0 / ratio;
        if (lanes == 2 && emitted)
            prev_v = comp_value(r_last * ratio + j, col, p0, kvs, ape, ape_type, skv, ssc, ratio,
                                lanes, w);
        if (last >= j) {
            const int q = j + (last - j) / ratio * ratio;
            if (q >= p0) {
                const CompVal c =
                    comp_value(q, col, p0, kvs, ape, ape_type, skv, ssc, ratio, lanes, w);
                skv[(i64)cur * w + col] = c.kv;
                ssc[(i64)cur * w + col] = c.sc;
            }
        }
        if (lanes == 2 && emitted) {
            skv[(i64)j * w + col] = prev_v.kv;
            ssc[(i64)j * w + col] = prev_v.sc;
        }
    }
}

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

// ---- indexer_q with one warp per head (`idxq_warp`; dim = 128, an even RoPE start):
// lane l holds dims 4l…4l+3 in registers. The Hadamard's strides 1 and 2 pair values
// inside a lane, strides 4…64 pair lane l with lane l ^ (stride/4) by shuffle: every
// butterfly is the same a + b (lower) / a − b (upper) on the same operands, so the
// result is indexer_q's bit for bit, without its shared memory and 9 barriers (only 64
// of its 256 threads worked in each Hadamard stage). The FP4 block maximum runs over
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
    const float sc = 1.0f / sqrtf((float)DIM);
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] *= sc;
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
                                                    float* scores, int scores_stride) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
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
        const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = __fmaf_rn(av[i], bv[j], acc[i][j]);
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
        int dim, float wscale, int ratio, int top_k, float *scores, int scores_stride
#define IDX_ARGS step, index_rows, q, wt, heads, dim, wscale, ratio, top_k, scores, scores_stride
extern "C" __global__ void __launch_bounds__(256) indexer_scores(IDX_PARAMS) {
    indexer_scores_body<false>(IDX_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) indexer_scores_sp(IDX_PARAMS) {
    indexer_scores_body<true>(IDX_ARGS);
}

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
        if (threadIdx.x < WARP) {
            // The digit where the count from the top reaches `need`: lane l scans digits
            // 255 − 8l … 248 − 8l after a warp prefix sum of the lanes' totals (one
            // thread walking 256 digits was most of this kernel's time).
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
                sel_prefix = prefix | ((u32)digit << shift);
                sel_need = need - acc;
            }
        }
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
extern "C" __global__ void __launch_bounds__(1024) topk_select(TOPK_PARAMS) {
    topk_select_body<false>(step, scores, scores_stride, ratio, k, sel);
}
extern "C" __global__ void __launch_bounds__(1024) topk_select_rg(TOPK_PARAMS) {
    topk_select_body<true>(step, scores, scores_stride, ratio, k, sel);
}

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

    // Row r < total of `hd` floats.
    __device__ __forceinline__ const float* row(int r, const float* ring, int raw_cap,
                                                const float* comp, int hd) const {
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
#define ATT_STAGE_ROWS 32
#define ATT_SPLIT_PARAMS                                                                   \
    const Step *step, const float *q, const float *ring, int raw_cap, int window,           \
        const float *comp, int ratio, const i32 *sel, int top_k, const float *sinks,        \
        int heads, int hd, float scale, int rows_per_chunk, float *part_acc, float *part_ml, \
        float *out, int q_norm, float q_eps, RopeP q_rope
#define ATT_SPLIT_ARGS                                                                     \
    step, q, ring, raw_cap, window, comp, ratio, sel, top_k, sinks, heads, hd, scale,       \
        rows_per_chunk, part_acc, part_ml, out, q_norm, q_eps, q_rope

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
        const int k = (i0 - tail0) / 2;
        if (PRELOAD) {
            rope_pair_f(s[0], s[1], fq[0], pos_pl, true);
            rope_pair_f(s[2], s[3], fq[1], pos_pl, true);
        } else {
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

extern "C" __global__ void __launch_bounds__(128) attention_combine(ATT_COMBINE_PARAMS) {
    attention_combine_body<false>(ATT_COMBINE_ARGS);
}
extern "C" __global__ void __launch_bounds__(128) attention_combine_pl(ATT_COMBINE_PARAMS) {
    attention_combine_body<true>(ATT_COMBINE_ARGS);
}

// ---- MoE router (§5.6): probs = √softplus(logits); selection by the hash table or by
// top-k of probs + bias (largest first, ties to the lower index, as the CPU's strict >
// insertion); weights from the unbiased probs, normalised (floor 2^-14) and scaled.
// One block of 512 threads (n_expert ≤ 512).
// WIDE (router_wide, `router4`): the rank loop reads four keys per load; the same
// counts, so the same picks.
// SPLIT (router_split, `router_split`, with WIDE): the loop was issue-bound (~5
// instructions a key). Below the warp's own 32 experts every j < e, so a key counts
// when kj ≥ ke; above them every j > e, so when kj > ke (NaN compares false in both,
// as in the full test); only the own tile needs the full test. Counted in four float
// accumulators (exact: at most 512): FSET + FADD a key. The same ranks.
template <bool WIDE, bool SPLIT = false>
__device__ __forceinline__ void router_body(const Step* step, const float* logits,
        int n_expert, int k, const float* bias, const i32* tid2eid, float wscale, i32* ids,
        float* weights) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float probs[512];
    __shared__ __align__(16) float key[512];
    __shared__ int sel[64];
    step += blockIdx.x;
    logits += (i64)blockIdx.x * n_expert;
    ids += (i64)blockIdx.x * k;
    weights += (i64)blockIdx.x * k;
    const int e = threadIdx.x;
    if (e < n_expert) {
        const float x = logits[e];
        const float sp = x > 20.f ? x : (x < -20.f ? expf(x) : log1pf(expf(x)));
        probs[e] = sqrtf(sp);
        key[e] = probs[e] + (bias ? bias[e] : 0.f);
    }
    __syncthreads();
    if (tid2eid) {
        if (e < k) sel[e] = tid2eid[(i64)step->token * k + e];
    } else {
        // Expert e is the r-th pick, r = how many keys order before its own (larger, or
        // equal at a lower index): the same picks as k rounds of argmax with ties to the
        // lower index, in one parallel pass. sel starts as 0…k−1 so that it holds valid
        // experts even if NaN keys leave ranks unassigned.
        if (e < k) sel[e] = e;
        __syncthreads();
        if (e < n_expert) {
            const float ke = key[e];
            int r = 0;
            int j = 0;
            if (SPLIT && n_expert % 4 == 0) {
                const float4* k4 = reinterpret_cast<const float4*>(key);
                const int t0 = e / WARP * WARP, t1 = min(n_expert, t0 + WARP);
                float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
#pragma unroll 4
                for (int jj = 0; jj < t0; jj += 4) {
                    const float4 kv = k4[jj / 4];
                    c0 += kv.x >= ke ? 1.f : 0.f;
                    c1 += kv.y >= ke ? 1.f : 0.f;
                    c2 += kv.z >= ke ? 1.f : 0.f;
                    c3 += kv.w >= ke ? 1.f : 0.f;
                }
#pragma unroll 4
                for (int jj = t1; jj < n_expert; jj += 4) {
                    const float4 kv = k4[jj / 4];
                    c0 += kv.x > ke ? 1.f : 0.f;
                    c1 += kv.y > ke ? 1.f : 0.f;
                    c2 += kv.z > ke ? 1.f : 0.f;
                    c3 += kv.w > ke ? 1.f : 0.f;
                }
                r = (int)((c0 + c1) + (c2 + c3));
                for (int jj = t0; jj < t1; ++jj) {
                    const float kj = key[jj];
                    r += (kj > ke) | ((kj == ke) & (jj < e));
                }
                j = n_expert;  // done
            }
            if (WIDE && !SPLIT) {
                // Four keys per (broadcast) shared-memory load: the loop was bound by
                // one LDS per key and warp, 16 warps × 256 keys ≈ 2 µs.
                const float4* k4 = reinterpret_cast<const float4*>(key);
#pragma unroll 4
                for (; j + 4 <= n_expert; j += 4) {
                    const float4 kv = k4[j / 4];
                    r += (kv.x > ke) | ((kv.x == ke) & (j < e));
                    r += (kv.y > ke) | ((kv.y == ke) & (j + 1 < e));
                    r += (kv.z > ke) | ((kv.z == ke) & (j + 2 < e));
                    r += (kv.w > ke) | ((kv.w == ke) & (j + 3 < e));
                }
            }
#pragma unroll 8
            for (; j < n_expert; ++j) {
                const float kj = key[j];
                r += (kj > ke) | ((kj == ke) & (j < e));
            }
            if (r < k) sel[r] = e;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (int j = 0; j < k; ++j) s += probs[sel[j]];
        s = fmaxf(s, 6.103515625e-5f);
        for (int j = 0; j < k; ++j) {
            ids[j] = sel[j];
            weights[j] = probs[sel[j]] / s * wscale;
        }
    }
}

#define ROUTER_PARAMS                                                                   \
    const Step *step, const float *logits, int n_expert, int k, const float *bias,       \
        const i32 *tid2eid, float wscale, i32 *ids, float *weights
#define ROUTER_ARGS step, logits, n_expert, k, bias, tid2eid, wscale, ids, weights
extern "C" __global__ void __launch_bounds__(512) router(ROUTER_PARAMS) {
    router_body<false>(ROUTER_ARGS);
}
extern "C" __global__ void __launch_bounds__(512) router_wide(ROUTER_PARAMS) {
    router_body<true>(ROUTER_ARGS);
}
extern "C" __global__ void __launch_bounds__(512) router_split(ROUTER_PARAMS) {
    router_body<true, true>(ROUTER_ARGS);
}

// ---- SwiGLU with the asymmetric clamp, scaled by the routing weight (null: 1).
// gu holds gate rows then up rows: [2][n_sel][n].
extern "C" __global__ void swiglu(const float* gate, const float* up, const float* weights,
                                  int n, int n_sel, float clamp, float* mid) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < n * n_sel; i += blockDim.x * gridDim.x) {
        const float g = fminf(gate[i], clamp);
        const float u = fminf(fmaxf(up[i], -clamp), clamp);
        const float w = weights ? weights[i / n] : 1.f;
        mid[i] = g * sigmoidf_(g) * u * w;
    }
}

// ---- dst row blockIdx.y = src row blockIdx.y / k.
extern "C" __global__ void repeat_rows(const float* src, int width, int k, float* dst) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const float* s = src + (i64)(blockIdx.y / k) * width;
    float* d = dst + (i64)blockIdx.y * width;
    for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < width; i += blockDim.x * gridDim.x)
        d[i] = s[i];
}

// ---- Output head collapse: w_i = sigmoid(mix_i·scale + base_i) + eps, e = Σ w_i·H_i,
// then rmsnorm(e, output_norm). One block.
extern "C" __global__ void __launch_bounds__(1024) head_collapse(const float* h, const float* mix,
        const float* scale, const float* base, int n_hc, int n_embd, float hc_eps,
        const void* norm_w, int norm_type, float eps, float* tmp, float* x) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float red[32];
    __shared__ float wgt[8];
    if (threadIdx.x < n_hc) wgt[threadIdx.x] = sigmoidf_(mix[threadIdx.x] * scale[0] + base[threadIdx.x]) + hc_eps;
    __syncthreads();
    float ss = 0.f;
    for (int d = threadIdx.x; d < n_embd; d += blockDim.x) {
        float acc = 0.f;
        for (int i = 0; i < n_hc; ++i) acc += wgt[i] * h[(i64)i * n_embd + d];
        tmp[d] = acc;
        ss += acc * acc;
    }
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)n_embd + eps);
    for (int d = threadIdx.x; d < n_embd; d += blockDim.x) x[d] = tmp[d] * sc * ldw(norm_w, norm_type, d);
}
