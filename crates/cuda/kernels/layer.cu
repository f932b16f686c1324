// The non-matmul operations of a DeepSeek V4 layer (model-spec.md §5). Every count
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
// (WT_F32, WT_F16, WT_BF16: ds4_consts.h.)

__device__ __forceinline__ float ldw(const void* w, int type, i64 i) {
    if (type == WT_F16) return h2f(reinterpret_cast<const u16*>(w)[i]);
    if (type == WT_BF16) return __uint_as_float(((u32)reinterpret_cast<const u16*>(w)[i]) << 16);
    return reinterpret_cast<const float*>(w)[i];
}

// Block-wide reduction (blockDim.x ≤ 1024, a multiple of 32) with the warp reduction
// WARP_OP and its identity: each warp reduces, then warp 0 reduces the warp results.
// `red` holds ≥ 32 floats.
template <float (*WARP_OP)(float)>
__device__ __forceinline__ float block_reduce(float v, float* red, float identity) {
    v = WARP_OP(v);
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    const int nw = blockDim.x / WARP;
    v = threadIdx.x < nw ? red[threadIdx.x] : identity;
    if (wid == 0) v = WARP_OP(v);
    if (threadIdx.x == 0) red[0] = v;
    __syncthreads();
    const float r = red[0];
    __syncthreads();
    return r;
}

__device__ float block_sum(float v, float* red) { return block_reduce<warp_sum>(v, red, 0.f); }

__device__ float block_max(float v, float* red) {
    return block_reduce<warp_max>(v, red, -3.0e38f);
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

#define HC_MIX_PARAMS const float *h, int n, const void *fn, int fn_type, float eps, float *mix
#define HC_MIX_ARGS h, n, fn, fn_type, eps, mix
KERNEL_PAIR(__launch_bounds__(1024), hc_mix, hc_mix_pl, hc_mix_body, HC_MIX_PARAMS, HC_MIX_ARGS)

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
// (HC_PRE_VEC, HC_MAX: ds4_consts.h.)
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

KERNEL_PAIR(__launch_bounds__(1024), hc_pre, hc_pre_pl, hc_pre_body, HC_PRE_PARAMS, HC_PRE_ARGS)

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

// Token t's rows: its streams in and out, its sublayer output and parts, its post/comb.
__device__ __forceinline__ void hc_post_rows(i64 t, int n_hc, int n_embd, int n_parts,
                                             const float*& h, float*& h_out, const float*& out,
                                             const float*& parts, const float*& hcp) {
    h += t * n_hc * n_embd;
    h_out += t * n_hc * n_embd;
    out += t * n_embd;
    if (parts) parts += t * n_parts * n_embd;
    hcp += t * (n_hc + n_hc * n_hc);
}

// A token's post (n_hc) and comb (n_hc × n_hc) from hcp into registers (n_hc ≤ PM).
template <int PM>
__device__ __forceinline__ void hc_post_coefs(const float* hcp, int n_hc, float (&post)[PM],
                                              float (&comb)[PM][PM]) {
#pragma unroll
    for (int i = 0; i < PM; ++i) {
        if (i < n_hc) post[i] = hcp[i];
#pragma unroll
        for (int j = 0; j < PM; ++j)
            if (i < n_hc && j < n_hc) comb[i][j] = hcp[n_hc + i * n_hc + j];
    }
}

// Output stream j of one value: o·post_j, then comb[i][j]·H_i in i order, each rounding
// spelled out (see above).
template <int PM>
__device__ __forceinline__ float hc_post_stream(float o, int j, const float (&post)[PM],
                                                const float (&comb)[PM][PM],
                                                const float (&hv)[PM], int n_hc) {
    float acc = __fmul_rn(o, post[j]);
#pragma unroll
    for (int i = 0; i < PM; ++i)
        if (i < n_hc) acc = __fmaf_rn(comb[i][j], hv[i], acc);
    return acc;
}

// hc_post_pl's column d of one token (rows from hc_post_rows, coefficients from
// hc_post_coefs): every load first (out, the first HC_POST_PARTS parts, the streams),
// the sublayer output o = Σ parts (k ascending) + out, then each output stream, stored
// to h_out and returned in hn (hc_post_gram forms the next mix from it).
template <int PM>
__device__ __forceinline__ void hc_post_column(const float* h, const float* out,
                                               const float* parts, int n_parts, int n_hc,
                                               int n_embd, int d, const float (&post)[PM],
                                               const float (&comb)[PM][PM], float* h_out,
                                               float (&hn)[PM]) {
    float o = out[d];
    float pv[HC_POST_PARTS], hv[PM];
#pragma unroll
    for (int k = 0; k < HC_POST_PARTS; ++k)
        if (parts && k < n_parts) pv[k] = parts[(i64)k * n_embd + d];
#pragma unroll
    for (int i = 0; i < PM; ++i)
        if (i < n_hc) hv[i] = h[(i64)i * n_embd + d];
    if (parts) {
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < HC_POST_PARTS; ++k)
            if (k < n_parts) acc += pv[k];
        for (int k = HC_POST_PARTS; k < n_parts; ++k) acc += parts[(i64)k * n_embd + d];
        o = acc + o;
    }
#pragma unroll
    for (int j = 0; j < PM; ++j)
        if (j < n_hc) {
            hn[j] = hc_post_stream(o, j, post, comb, hv, n_hc);
            h_out[(i64)j * n_embd + d] = hn[j];
        }
}

template <bool PRELOAD>
__device__ __forceinline__ void hc_post_body(const float* h, const float* out,
                                             const float* parts, int n_parts, const float* hcp,
                                             int n_hc, int n_embd, float* h_out) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    hc_post_rows(blockIdx.y, n_hc, n_embd, n_parts, h, h_out, out, parts, hcp);
    if (PRELOAD && n_hc > HC_MAX) return;  // the launcher checks n_hc
    constexpr int PM = PRELOAD ? HC_MAX : 1;
    float post[PM], comb[PM][PM];
    if (PRELOAD) hc_post_coefs(hcp, n_hc, post, comb);
    for (int d = threadIdx.x + blockIdx.x * blockDim.x; d < n_embd; d += blockDim.x * gridDim.x) {
        if (PRELOAD) {
            float hn[PM];
            hc_post_column(h, out, parts, n_parts, n_hc, n_embd, d, post, comb, h_out, hn);
        } else {
            float o = out[d];
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

#define HC_POST_PARAMS                                                                     \
    const float *h, const float *out, const float *parts, int n_parts, const float *hcp, \
        int n_hc, int n_embd, float *h_out
#define HC_POST_ARGS h, out, parts, n_parts, hcp, n_hc, n_embd, h_out
KERNEL_PAIR(, hc_post, hc_post_pl, hc_post_body, HC_POST_PARAMS, HC_POST_ARGS)

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
