#include "common.cuh"

// ---- Fused producers of quantised activations (decode launch count): each writes the
// f32 result and its Q8_0 (per 32) or Q8_K (per 256) form, bit-identical to running
// the plain kernel and then quantize_q8_32 / quantize_q8_k32.

// rmsnorm of one row per block (n a multiple of 32), then Q8_0.
// PRELOAD (rmsnorm_q8_pl, `norm_pl`): while n ≤ NORM_PL·blockDim, the weights (no
// kernel writes them) are loaded before the PDL wait and x stays in registers from the
// sum of squares to the quantised store; the plain kernel loads w and reloads x after
// the block's reduction (one more round trip at the end of the chain). Thread t's
// values t + u·blockDim are both the sum's order and the quantisation's warp blocks.
#define NORM_PL 4
template <bool PRELOAD>
__device__ __forceinline__ void rmsnorm_q8_body(const float* x, const void* w, int w_type, int n,
                                                float eps, float* y, i8* q, float* d) {
    constexpr int R = PRELOAD ? NORM_PL : 1;
    const bool pl = PRELOAD && n <= NORM_PL * (int)blockDim.x;
    float wv[R];
    if (pl && w) {
#pragma unroll
        for (int u = 0; u < R; ++u) {
            const int i = threadIdx.x + u * blockDim.x;
            wv[u] = i < n ? ldw(w, w_type, i) : 0.f;
        }
    }
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float red[32];
    const float* xr = x + (i64)blockIdx.x * n;
    float* yr = y + (i64)blockIdx.x * n;
    const int lane = threadIdx.x % WARP, nw = blockDim.x / WARP;
    if (pl) {
        float xv[R];
#pragma unroll
        for (int u = 0; u < R; ++u) {
            const int i = threadIdx.x + u * blockDim.x;
            xv[u] = i < n ? xr[i] : 0.f;
        }
        float ss = 0.f;
#pragma unroll
        for (int u = 0; u < R; ++u)
            if (threadIdx.x + u * blockDim.x < n) ss += xv[u] * xv[u];
        ss = block_sum(ss, red);
        const float sc = 1.0f / sqrtf(ss / (float)n + eps);
#pragma unroll
        for (int u = 0; u < R; ++u) {
            const int b = threadIdx.x / WARP + u * nw;  // warp-uniform
            if (b < n / 32) {
                const int i = b * 32 + lane;
                float v = xv[u] * sc;
                if (w) v = v * wv[u];
                yr[i] = v;
                quant_block32(v, q + (i64)blockIdx.x * n + b * 32, d + (i64)blockIdx.x * (n / 32) + b);
            }
        }
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)n + eps);
    for (int b = threadIdx.x / WARP; b < n / 32; b += nw) {
        const int i = b * 32 + lane;
        float v = xr[i] * sc;
        if (w) v = v * ldw(w, w_type, i);
        yr[i] = v;
        quant_block32(v, q + (i64)blockIdx.x * n + b * 32, d + (i64)blockIdx.x * (n / 32) + b);
    }
}

#define RMSNORM_Q8_PARAMS \
    const float *x, const void *w, int w_type, int n, float eps, float *y, i8 *q, float *d
#define RMSNORM_Q8_ARGS x, w, w_type, n, eps, y, q, d
KERNEL_PAIR(__launch_bounds__(1024), rmsnorm_q8, rmsnorm_q8_pl, rmsnorm_q8_body, RMSNORM_Q8_PARAMS,
            RMSNORM_Q8_ARGS)

__device__ __forceinline__ float swiglu_value(const float* gate, const float* up,
        const float* weights, int n, float clamp, i64 i) {
    return swiglu_of(gate[i], up[i], weights ? weights[i / n] : 1.f, clamp);
}

// swiglu (as `swiglu`) then Q8_0: one warp per 32 values of the n·n_sel.
extern "C" __global__ void swiglu_q8(const float* gate, const float* up, const float* weights,
        int n, int n_sel, float clamp, float* mid, i8* q, float* d) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const i64 b = (i64)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (b >= (i64)n * n_sel / 32) return;
    const i64 i = b * 32 + threadIdx.x % WARP;
    const float v = swiglu_value(gate, up, weights, n, clamp, i);
    mid[i] = v;
    quant_block32(v, q + b * 32, d + b);
}

// swiglu then Q8_K (the quantize_q8_k32 rule): one block of 256 threads per 256 values.
extern "C" __global__ void __launch_bounds__(256) swiglu_q8k(const float* gate,
        const float* up, const float* weights, int n, float clamp, float* mid, i8* q,
        float* d) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float vals[256];
    const i64 base = (i64)blockIdx.x * 256;
    const float v = swiglu_value(gate, up, weights, n, clamp, base + threadIdx.x);
    mid[base + threadIdx.x] = v;
    vals[threadIdx.x] = v;
    quant_q8k_block256(v, vals, base, q, d);
}
