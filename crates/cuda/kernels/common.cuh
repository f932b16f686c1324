// Shared definitions of the ds4 CUDA kernels. Built with nvcc (ahead of time) or NVRTC
// (at run time), so it includes no system headers: fixed-width types and half
// conversions are spelled out here. build.rs puts ds4_consts.h before it (the include
// below is for editors; build.rs drops it).
#include "ds4_consts.h"

typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define WARP 32

// Programmatic dependent launch (decode graphs, see Gpu::end_capture): every kernel
// starts by waiting for its upstream grids to complete and their writes to be
// visible; without a programmatic edge this is a no-op.
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
// PDL_WAIT after loads issued ahead of it (the plain matrices' first weights): in its
// own basic block, behind a branch on `never` (a runtime value that is never nonzero,
// e.g. a row count < 0), because ptxas moves griddepcontrol.wait to the top of the block
// it sits in — above loads in that block, which then no longer overlap the previous
// kernel (the SASS of matvec_q8_0_q8_early, matvec_f16_early and the F16 token kernels
// had the wait first).
#define PDL_WAIT_AFTER_LOADS(never)                                                       \
    asm volatile(                                                                       \
        "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, %0, 0;\n\t@p bra.uni PDLW_SKIP;\n\t"        \
        "griddepcontrol.wait;\n\tPDLW_SKIP:\n\t}" ::"r"((int)(never))                       \
        : "memory")
// Lets the next grid launch (its blocks then wait in PDL_WAIT) once every block of this
// one has passed here or exited: called after a block's last load of weights.
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")

// The two entry points of one kernel body templated on a bool: NAME runs BODY<false>,
// VARIANT (the decode plan's alternative, picked by name at launch) BODY<true>. PARAMS
// and ARGS are macros spelling the parameter list and the argument list once.
#define KERNEL_PAIR(BOUNDS, NAME, VARIANT, BODY, PARAMS, ARGS)               \
    extern "C" __global__ void BOUNDS NAME(PARAMS) { BODY<false>(ARGS); }    \
    extern "C" __global__ void BOUNDS VARIANT(PARAMS) { BODY<true>(ARGS); }

// A batched step over several sessions passes a per-row KV table (ds4_consts.h,
// KVT_*): row t's buffer `field` from it, else the launch's own pointer (one session).
template <typename T>
__device__ __forceinline__ T* kvt_ptr(const u64* kvt, int t, int field, T* own) {
    return kvt ? reinterpret_cast<T*>(kvt[(i64)t * KVT_STRIDE + field]) : own;
}
__device__ __forceinline__ int kvt_raw_cap(const u64* kvt, int t, int own) {
    return kvt ? (int)kvt[(i64)t * KVT_STRIDE + KVT_RAW_CAP] : own;
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}

// tf32 with round-to-nearest (the hi part of a split operand: matmul_f32.cu,
// hc_mix_tc.cu).
__device__ __forceinline__ float mm_tf32(float v) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return __uint_as_float(r);
}

// c += A·B, m16n8k8 tf32 with f32 accumulators.
__device__ __forceinline__ void mm_mma_tf32(float (&c)[4], float a0, float a1, float a2,
                                            float a3, float b0, float b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)),
          "r"(__float_as_uint(a3)), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// The end of a 16-row warp tile of the step's tensor-core products (mma_tokens.cu,
// mma_tokens_f16.cu): lane (g, t)'s accumulators acc[tt][i] — row row0 + g (+ 8 for
// i ≥ 2), token 8·tt + 2t + (i & 1) — to y[tok · y_stride + row] for live rows and
// tokens; with the tile split over ks warps (this one split `split` of them), through
// `red` and the tile's first warp, which adds the splits in order.
template <int NT>
__device__ __forceinline__ void mma_tile_store(float (&red)[MMA_TOKENS_MAX_KS][16][8 * NT],
                                               const float (&acc)[NT][4], int row0, int rows,
                                               int n_tok, float* __restrict__ y, i64 y_stride,
                                               int ks, int split) {
    const int lane = threadIdx.x, w = threadIdx.y;
    const int g = lane >> 2, t = lane & 3;
    auto store = [&](int r, int tok, float v) {
        if (r < rows && tok < n_tok) y[tok * y_stride + r] = v;
    };
    if (ks == 1) {
#pragma unroll
        for (int tt = 0; tt < NT; ++tt) {
            const int t0 = 8 * tt + 2 * t;
            store(row0 + g, t0, acc[tt][0]);
            store(row0 + g, t0 + 1, acc[tt][1]);
            store(row0 + g + 8, t0, acc[tt][2]);
            store(row0 + g + 8, t0 + 1, acc[tt][3]);
        }
        return;
    }
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) {
        const int t0 = 8 * tt + 2 * t;
        red[w][g][t0] = acc[tt][0];
        red[w][g][t0 + 1] = acc[tt][1];
        red[w][g + 8][t0] = acc[tt][2];
        red[w][g + 8][t0 + 1] = acc[tt][3];
    }
    __syncthreads();
    if (split != 0) return;
    // 16 rows × 8·NT tokens.
    for (int i = lane; i < 16 * 8 * NT; i += WARP) {
        const int r = i / (8 * NT), tok = i % (8 * NT);
        float s = 0.f;
        for (int k = 0; k < ks; ++k) s += red[w + k][r][tok];
        store(row0 + r, tok, s);
    }
}

// c += A·B, mma.sync m16n8k16 with fp16 inputs and f32 accumulators (the prefill
// attention's and the fp16 GEMM's).
__device__ __forceinline__ void mma_f16_f32(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                            u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ACC[i][j] = FMA(a[i], b[j], ACC[i][j]) on a 4×4 register tile from the float4s A and
// B. A macro, not a function: the GEMM loops it sits in are scheduled as written.
#define FMA_OUTER4(ACC, A, B, FMA)                                                  \
    do {                                                                            \
        const float av_[4] = {(A).x, (A).y, (A).z, (A).w};                          \
        const float bv_[4] = {(B).x, (B).y, (B).z, (B).w};                          \
        _Pragma("unroll") for (int i_ = 0; i_ < 4; ++i_)                            \
            _Pragma("unroll") for (int j_ = 0; j_ < 4; ++j_)                        \
                ACC[i_][j_] = FMA(av_[i_], bv_[j_], ACC[i_][j_]);                   \
    } while (0)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// warp_sum of each of N values (N a power of two) for kernels that end with several
// sums a warp (rows a warp, tokens a row). The butterfly of warp_sum (xor 16, 8, 4, 2,
// 1), but at each of the first log2(N) levels a lane keeps half of its live values and
// trades the other half with its partner: N − 1 shuffles for the first levels, not 5N
// in all (two-token products of 4 rows: 9 instead of 40). Each total meets its partial
// sums in warp_sum's tree and float addition is commutative, so every total has
// warp_sum's bits. On return v[0 .. max(N / 32, 1)) hold the totals of values
// `first`, `first` + 1, …; the lanes that differ only in their low 32 / N bits hold
// the same totals (warp_sums_writer picks one of them).
// One level of warp_sums: L live values, partner at xor O (both compile-time, so
// every index is a register).
template <int N, int L, int O>
__device__ __forceinline__ void warp_sums_level(float (&v)[N], int& first) {
    if constexpr (O > 0) {
        if constexpr (L > 1) {
            const bool hi = (threadIdx.x & O) != 0;
#pragma unroll
            for (int i = 0; i < L / 2; ++i) {
                const float keep = hi ? v[i + L / 2] : v[i];
                const float send = hi ? v[i] : v[i + L / 2];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
            }
            if (hi) first += L / 2;
            warp_sums_level<N, L / 2, O / 2>(v, first);
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
            warp_sums_level<N, 1, O / 2>(v, first);
        }
    }
}
// The least power of two ≥ n (n ≥ 1), at compile time: warp_sums' padded width.
__host__ __device__ constexpr int pow2_ceil_ct(int n) { return n <= 1 ? 1 : 2 * pow2_ceil_ct((n + 1) / 2); }
template <int N>
__device__ __forceinline__ void warp_sums(float (&v)[N], int& first) {
    static_assert(N >= 1 && (N & (N - 1)) == 0, "warp_sums takes a power of two");
    first = 0;
    warp_sums_level<N, N, 16>(v, first);
}

// Whether this lane stores the totals warp_sums<N> left it (one lane of each group
// holding the same totals).
template <int N>
__device__ __forceinline__ bool warp_sums_writer() {
    constexpr int low = N >= WARP ? 1 : WARP / N;
    return (threadIdx.x % WARP) % low == 0;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// 16 bytes as four 32-bit words (the unit of every weight load).
struct __align__(16) W4 { u32 a, b, c, d; };

__device__ __forceinline__ W4 ld16(const void* p) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    W4 w; w.a = v.x; w.b = v.y; w.c = v.z; w.d = v.w;
    return w;
}

// 16 weight bytes read once per token: no L1 allocation, 256-byte L2 lines.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// Loads meant to run before PDL_WAIT (a plain matrix's first weights, streamed while
// the previous kernel drains). asm volatile keeps them ahead of the wait, itself asm
// volatile: plain loads, and ld_stream16's non-volatile asm, were sunk by the compiler
// below the wait to where their values are used (the SASS of matvec_q8_0_q8_early,
// matvec_f16_early, the F16 token kernels and matvec_q8_0_q8_mma16 had griddepcontrol
// .wait before their first weight load).
__device__ __forceinline__ uint4 ld_early16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_early8(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ld_early4(const void* p) {
    u32 v;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u16 ld_early2(const void* p) {
    u16 v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float4 ldx4(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}

// Signed dot of 4 packed int8 with 4 floats.
__device__ __forceinline__ float dot4_i8(u32 q, float4 x) {
    return (float)(i8)(q & 0xff) * x.x + (float)(i8)((q >> 8) & 0xff) * x.y +
           (float)(i8)((q >> 16) & 0xff) * x.z + (float)(i8)(q >> 24) * x.w;
}

// A matrix-vector launch: one warp per output row, ROWS_PER_BLOCK warps per block,
// blockIdx.y = which of the selected matrices (routed experts) to use.
// (ROWS_PER_BLOCK and the other numbers shared with Rust: ds4_consts.h.)

struct MatSel {
    const i32* ids;   // matrix index per blockIdx.y, or null for matrix 0
    i64 x_stride;     // input floats between consecutive blockIdx.y (0: shared input)
    i64 y_stride;     // output floats between consecutive blockIdx.y
};

__device__ __forceinline__ int sel_matrix(const MatSel& s) {
    return s.ids ? s.ids[blockIdx.y] : 0;
}

// The end of a split-K matvec row: `ks` consecutive warps of the block (threadIdx.y)
// share one row and each holds its lane partials in acc; the row sum goes to y[at] (when
// live). `red` holds a float per warp of the block. Every thread of the block calls it.
__device__ __forceinline__ void store_split_row(float acc, int ks, int split, bool live,
                                                float* y, i64 at, float* red) {
    acc = warp_sum(acc);
    if (ks == 1) {
        if (threadIdx.x == 0 && live) y[at] = acc;
        return;
    }
    if (threadIdx.x == 0) red[threadIdx.y] = acc;
    __syncthreads();
    if (threadIdx.x == 0 && split == 0 && live) {
        float s = 0.f;
        for (int i = 0; i < ks; ++i) s += red[threadIdx.y + i];
        y[at] = s;
    }
}

// The Q8_0 activation rule on one warp's block of 32 (lane i holds value i).
__device__ __forceinline__ void quant_block32(float v, i8* q, float* d) {
    const int lane = threadIdx.x % WARP;
    const float amax = warp_max(fabsf(v));
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    int qi = __float2int_rn(v * id);
    qi = max(-128, min(127, qi));
    q[lane] = (i8)qi;
    if (lane == 0) *d = dd;
}

// The Q8_K activation rule (quantize_q8_k32's, see there) on one block of 256 threads:
// thread t holds v == vals[t] and gets its int8 value; every thread gets the scale of
// the block's 32-value groups (0 for a block of zeros). vals is read only at the winning
// index, so a caller may pass its global input or a shared-memory copy.
__device__ __forceinline__ int quant_q8k_value256(float v, const float* vals, float& scale) {
    __shared__ float s_abs[8];
    __shared__ int s_idx[8];
    __shared__ float s_max;
    float a = fabsf(v);
    int idx = threadIdx.x;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float a2 = __shfl_xor_sync(0xffffffffu, a, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        if (a2 > a || (a2 == a && i2 < idx)) {
            a = a2;
            idx = i2;
        }
    }
    if (threadIdx.x % WARP == 0) {
        s_abs[threadIdx.x / WARP] = a;
        s_idx[threadIdx.x / WARP] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float ba = s_abs[0];
        int bi = s_idx[0];
        for (int w = 1; w < 8; ++w)
            if (s_abs[w] > ba || (s_abs[w] == ba && s_idx[w] < bi)) {
                ba = s_abs[w];
                bi = s_idx[w];
            }
        s_max = ba == 0.f ? 0.f : vals[bi];
    }
    __syncthreads();
    const float mx = s_max;
    if (mx == 0.f) {
        scale = 0.f;
        return 0;
    }
    const float iscale = -127.0f / mx;
    scale = 1.0f / iscale;
    return max(-128, min(127, __float2int_rn(iscale * v)));
}

// quant_q8k_value256 written out: thread t's value to q[base + t]; d[blockIdx.x * 8 +
// 0..8] get the scale once per 32 values.
__device__ __forceinline__ void quant_q8k_block256(float v, const float* vals, i64 base, i8* q,
                                                   float* d) {
    float scale;
    const int qi = quant_q8k_value256(v, vals, scale);
    q[base + threadIdx.x] = (i8)qi;
    if (threadIdx.x < 8) d[blockIdx.x * 8 + threadIdx.x] = scale;
}
