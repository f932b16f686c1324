// The MoE block's small kernels (model-spec.md §5.6): the router, SwiGLU and the row
// repeat of the batched path. The expert products are in matvec_q8act.cu / matmul.cu.
// Helpers are in layer.cu, which the build places first.
#include "common.cuh"

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
KERNEL_PAIR(__launch_bounds__(512), router, router_wide, router_body, ROUTER_PARAMS, ROUTER_ARGS)
extern "C" __global__ void __launch_bounds__(512) router_split(ROUTER_PARAMS) {
    router_body<true, true>(ROUTER_ARGS);
}

// ---- SwiGLU with the asymmetric clamp, scaled by the routing weight (1 without one):
// one value, as every swiglu kernel computes it (swiglu_q8, swiglu_q8k, swiglu_q8k_w).
__device__ __forceinline__ float swiglu_of(float gate, float up, float wt, float clamp) {
    const float g = fminf(gate, clamp);
    const float u = fminf(fmaxf(up, -clamp), clamp);
    return g * sigmoidf_(g) * u * wt;
}

// gu holds gate rows then up rows: [2][n_sel][n].
extern "C" __global__ void swiglu(const float* gate, const float* up, const float* weights,
                                  int n, int n_sel, float clamp, float* mid) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < n * n_sel; i += blockDim.x * gridDim.x)
        mid[i] = swiglu_of(gate[i], up[i], weights ? weights[i / n] : 1.f, clamp);
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
