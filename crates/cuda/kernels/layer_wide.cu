// Element-wise kernels for many tokens at once (prefill chunks, multi-row and batched
// steps): one block per token, 16-byte loads, the token's RoPE angles computed once into
// shared memory instead of once per head. Their one-token forms (layer.cu) take one block
// per (row, token): a 2,048-token prefill chunk spent ~370 µs a layer in rope_tail +
// quantize_q8_32 on its attention output and 271 µs in head_norm_rope (H200,
// DS4_CUDA_PROFILE), against ~100 µs of memory traffic. build.rs concatenates the kernel
// files in name order, so this file follows layer.cu (RopeP, quant_block32_x4, hc_post_rows/_coefs/_stream,
// swiglu_of).
#include "common.cuh"

// Most RoPE pairs a token's table holds (the Flash tail: 32).
#define WIDE_ROPE_PAIRS 128

// The token's cos / sin per RoPE pair into cs (rope_pair_f's values: the same cosf and
// sinf of the same product), then a barrier.
__device__ __forceinline__ void wide_rope_table(float (&cs)[2][WIDE_ROPE_PAIRS], float pos,
                                                const RopeP& p, bool inverse) {
    for (int k = threadIdx.x; k < p.rope_dim / 2; k += blockDim.x) {
        const float th = pos * p.freqs[k];
        cs[0][k] = cosf(th);
        cs[1][k] = (inverse ? -1.f : 1.f) * sinf(th);
    }
    __syncthreads();
}

// rope_pair_f's rotation with the angle's cos and sin given. The same expression, but
// the compiler contracts a * c - b * s into an FMA one way or the other in each kernel
// it is inlined into, so the rotated values can differ from rope_tail's in the last bit
// (gpu-selftest compares them within BOUND_F32). Spelling every rounding out in both
// (__fmul_rn, __fsub_rn) made them agree but moved a tiny fixture's Exact batch-vs-token
// check (chunk 7) over its bound: some path's agreement rests on the contraction.
__device__ __forceinline__ void rope_rot(float& x0, float& x1, float c, float s) {
    const float a = x0, b = x1;
    x0 = a * c - b * s;
    x1 = a * s + b * c;
}

// The attention output's tail: inverse RoPE of the last rope_dim dims of each of the
// token's `heads` rows of hd (rope_tail), written back, then the whole token row to Q8_0
// (quantize_q8_32's rule, 8 threads a block of 32). One block per token (blockIdx.x),
// its row split over gridDim.y blocks when there are few tokens. The host checks
// hd % 32 == 0, heads · hd % 128 == 0 (a warp's 32 lanes take the same number of steps:
// quant_block32_x4 shuffles over all of them), rope_dim % 4 == 0, rope_dim / 2 <=
// WIDE_ROPE_PAIRS.
extern "C" __global__ void __launch_bounds__(512) rope_tail_q8(const Step* step, float* x,
        int hd, int heads, RopeP p, int inverse, i8* q, float* d) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float cs[2][WIDE_ROPE_PAIRS];
    const int t = blockIdx.x;
    wide_rope_table(cs, (float)step[t].pos, p, inverse != 0);
    const int n = heads * hd, tail = hd - p.rope_dim;
    x += (i64)t * n;
    q += (i64)t * n;
    d += (i64)t * (n / 32);
    for (int i0 = 4 * (blockIdx.y * blockDim.x + threadIdx.x); i0 < n;
         i0 += 4 * blockDim.x * gridDim.y) {
        float4 a = ldx4(x + i0);
        const int dh = i0 % hd;
        if (dh >= tail) {
            const int k = (dh - tail) / 2;
            rope_rot(a.x, a.y, cs[0][k], cs[1][k]);
            rope_rot(a.z, a.w, cs[0][k + 1], cs[1][k + 1]);
            *reinterpret_cast<float4*>(x + i0) = a;
        }
        const float v[4] = {a.x, a.y, a.z, a.w};
        quant_block32_x4(v, true, q + i0, d + i0 / 32);
    }
}

// head_norm_rope for the Flash head (hd = 512, a multiple of 128 up to 512 in general):
// one warp per head row, 16 values a lane (dims 128j + 4·lane + e), the sum of squares
// in decode's order (the attention's q_norm: a lane's 16 squares in (j, e) order, then
// warp_sum), so a token's queries norm to the same bits in every path; then RoPE on the
// tail from the token's table. One block per token (blockIdx.x), its warps over the heads
// (split over gridDim.y blocks when there are few tokens).
extern "C" __global__ void __launch_bounds__(512) head_norm_rope_t(const Step* step, float* x,
        int hd, int heads, float eps, RopeP p) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float cs[2][WIDE_ROPE_PAIRS];
    const int t = blockIdx.x;
    wide_rope_table(cs, (float)step[t].pos, p, false);
    const int lane = threadIdx.x % WARP, nj = hd / 128, tail = hd - p.rope_dim;
    const int wpb = blockDim.x / WARP;
    for (int h = blockIdx.y * wpb + threadIdx.x / WARP; h < heads; h += wpb * gridDim.y) {
        float* xr = x + ((i64)t * heads + h) * hd;
        float v[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (j < nj) {
                const float4 a = ldx4(xr + 128 * j + 4 * lane);
                v[j][0] = a.x;
                v[j][1] = a.y;
                v[j][2] = a.z;
                v[j][3] = a.w;
            } else {
                v[j][0] = v[j][1] = v[j][2] = v[j][3] = 0.f;
            }
        }
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) ss += v[j][e] * v[j][e];
        ss = warp_sum(ss);
        const float sc = 1.0f / sqrtf(ss / (float)hd + eps);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (j >= nj) continue;
#pragma unroll
            for (int e = 0; e < 4; ++e) v[j][e] *= sc;
            const int d0 = 128 * j + 4 * lane;
            if (d0 >= tail) {
                const int k = (d0 - tail) / 2;
                rope_rot(v[j][0], v[j][1], cs[0][k], cs[1][k]);
                rope_rot(v[j][2], v[j][3], cs[0][k + 1], cs[1][k + 1]);
            }
            *reinterpret_cast<float4*>(xr + d0) = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
        }
    }
}

// swiglu_q8k with one warp per 256 values (8 a lane: values 4·lane…+3 and 128 + 4·lane…+3)
// instead of a 256-thread block with two barriers. The same values (swiglu_of), the
// same winner of the Q8_K rule (largest |v|, the smallest index among ties: a total
// order, so the reduction order does not matter) and the same quantised bytes and
// scales. 8 warps a block; the host checks n % 256 == 0.
extern "C" __global__ void __launch_bounds__(256) swiglu_q8k_w(const float* gate,
        const float* up, const float* weights, int n, float clamp, float* mid, i8* q,
        float* d, i64 n_blocks) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const i64 blk = (i64)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (blk >= n_blocks) return;
    const int lane = threadIdx.x % WARP;
    const i64 base = blk * 256;
    float v[8];
    float best_a = -1.f, best_v = 0.f;
    int best_i = 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int o = 128 * h + 4 * lane;
        const float4 g4 = ldx4(gate + base + o), u4 = ldx4(up + base + o);
        const float gv[4] = {g4.x, g4.y, g4.z, g4.w}, uv[4] = {u4.x, u4.y, u4.z, u4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const i64 i = base + o + e;
            const float val = swiglu_of(gv[e], uv[e], weights ? weights[i / n] : 1.f, clamp);
            v[4 * h + e] = val;
            const float a = fabsf(val);
            if (a > best_a) {  // ascending indices: a tie keeps the smaller one
                best_a = a;
                best_v = val;
                best_i = o + e;
            }
        }
        *reinterpret_cast<float4*>(mid + base + o) =
            make_float4(v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]);
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        const float a2 = __shfl_xor_sync(0xffffffffu, best_a, m);
        const float v2 = __shfl_xor_sync(0xffffffffu, best_v, m);
        const int i2 = __shfl_xor_sync(0xffffffffu, best_i, m);
        if (a2 > best_a || (a2 == best_a && i2 < best_i)) {
            best_a = a2;
            best_v = v2;
            best_i = i2;
        }
    }
    const float mx = best_a == 0.f ? 0.f : best_v;
    const float iscale = mx == 0.f ? 0.f : -127.0f / mx;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        u32 packed = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qi = mx == 0.f ? 0 : max(-128, min(127, __float2int_rn(iscale * v[4 * h + e])));
            packed |= ((u32)qi & 0xffu) << (8 * e);
        }
        *reinterpret_cast<u32*>(q + base + 128 * h + 4 * lane) = packed;
    }
    if (lane < 8) d[blk * 8 + lane] = mx == 0.f ? 0.f : 1.0f / iscale;
}

// quantize_q8_32 with 4 values a thread (16-byte loads, 8 threads a block of 32: the
// one-value-a-lane kernel ran a 2,048-token chunk's 8,192-wide rows at ~0.9 TB/s). The
// same rule and bits (quant_block32_x4).
extern "C" __global__ void __launch_bounds__(256) quantize_q8_32x4(const float* __restrict__ x,
        i8* __restrict__ q, float* __restrict__ d, i64 n_blocks) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const i64 i0 = 4 * ((i64)blockIdx.x * blockDim.x + threadIdx.x);
    const bool on = i0 < n_blocks * 32;  // whole groups of 8 threads: a block of 32 is on or off
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (on) {
        const float4 a = ldx4(x + i0);
        v[0] = a.x;
        v[1] = a.y;
        v[2] = a.z;
        v[3] = a.w;
    }
    quant_block32_x4(v, on, q + i0, d + i0 / 32);
}

// hc_post_pl for many tokens: 4 consecutive values a thread (16-byte loads and stores),
// post and comb read once for 4 values instead of once a value. Per value the same sums
// in the same order (the parts in k order, then out; o·post then the comb FMAs).
extern "C" __global__ void __launch_bounds__(256) hc_post_x4(const float* h, const float* out,
        const float* parts, int n_parts, const float* hcp, int n_hc, int n_embd, float* h_out) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    hc_post_rows(blockIdx.y, n_hc, n_embd, n_parts, h, h_out, out, parts, hcp);
    if (n_hc > HC_MAX) return;  // the launcher checks n_hc
    float post[HC_MAX], comb[HC_MAX][HC_MAX];
    hc_post_coefs(hcp, n_hc, post, comb);
    for (int d = 4 * (threadIdx.x + blockIdx.x * blockDim.x); d < n_embd;
         d += 4 * blockDim.x * gridDim.x) {
        const float4 o4 = ldx4(out + d);
        float o[4] = {o4.x, o4.y, o4.z, o4.w};
        float hv[4][HC_MAX];  // value e of stream i
#pragma unroll
        for (int i = 0; i < HC_MAX; ++i) {
            if (i < n_hc) {
                const float4 a = ldx4(h + (i64)i * n_embd + d);
                hv[0][i] = a.x;
                hv[1][i] = a.y;
                hv[2][i] = a.z;
                hv[3][i] = a.w;
            }
        }
        if (parts) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
            for (int k = 0; k < n_parts; ++k) {
                const float4 p = ldx4(parts + (i64)k * n_embd + d);
                acc[0] += p.x;
                acc[1] += p.y;
                acc[2] += p.z;
                acc[3] += p.w;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) o[e] = acc[e] + o[e];
        }
#pragma unroll
        for (int j = 0; j < HC_MAX; ++j) {
            if (j >= n_hc) continue;
            float r[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) r[e] = hc_post_stream(o[e], j, post, comb, hv[e], n_hc);
            *reinterpret_cast<float4*>(h_out + (i64)j * n_embd + d) = make_float4(r[0], r[1], r[2], r[3]);
        }
    }
}
