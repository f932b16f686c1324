// The layer's KV state (model-spec.md §5.2, §5.4): the new raw row of the sliding window
// and the compressors that fold rows into compressed KV, per decode token and batched.
// Helpers (Step, ldw, block sums, RoPE, the QAT roundings) are in layer.cu, which the
// build places first.
#include "common.cuh"

// y = rmsnorm(x) · norm_w over n values with the whole block (y may be x). `red` holds
// ≥ 32 floats; the caller publishes y with a barrier.
__device__ __forceinline__ void block_rmsnorm(const float* x, float* y, int n, const void* norm_w,
                                              int norm_type, float eps, float* red) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, red);
    const float sc = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i] * sc * ldw(norm_w, norm_type, i);
}

// ---- The new raw KV row: rmsnorm(kv, kv_norm), RoPE, FP8 on the nope dims, (f16
// round), stored at ring slot pos % raw_cap. One block, blockDim.x ≥ 32.
extern "C" __global__ void __launch_bounds__(512) kv_finish(const Step* step, const float* kv,
        const void* norm_w, int norm_type, int hd, float eps, RopeP p, int f16_round,
        float* ring, int raw_cap, const u64* kvt) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float v[1024];
    __shared__ float red[32];
    // A batched step over several sessions: this row's ring (kvt).
    ring = kvt_ptr(kvt, blockIdx.y, KVT_RING, ring);
    raw_cap = kvt_raw_cap(kvt, blockIdx.y, raw_cap);
    step += blockIdx.y;
    kv += (i64)blockIdx.y * hd;
    block_rmsnorm(kv, v, hd, norm_w, norm_type, eps, red);
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

// A pooled compressor row in v (shared, d values, written by this block) finished as
// both compressors store it: rmsnorm with norm_w, RoPE on the tail at rope_pos, the QAT
// simulation of the mode (0: FP8 on the nope dims, 1: Hadamard + FP4), (f16 round),
// stored at dst. Starts with the barrier that publishes v.
__device__ __forceinline__ void compressor_finish_row(float* v, float* red, int d,
        const void* norm_w, int norm_type, float eps, const RopeP& p, float rope_pos, int mode,
        int f16_round, float* dst) {
    __syncthreads();
    block_rmsnorm(v, v, d, norm_w, norm_type, eps, red);
    __syncthreads();
    const int nope = d - p.rope_dim;
    for (int k = threadIdx.x; k < p.rope_dim / 2; k += blockDim.x)
        rope_pair(v[nope + 2 * k], v[nope + 2 * k + 1], k, rope_pos, p, false);
    __syncthreads();
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    if (mode == 0) {
        for (int b = wid; b < nope / 64; b += blockDim.x / WARP) fp8_block64(v + b * 64, lane);
    } else {
        hadamard_smem(v, d);
        for (int b = wid; b < d / 32; b += blockDim.x / WARP) fp4_block32(v + b * 32, lane);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = f16_round ? f16r(v[j]) : v[j];
}

// A pooled value's inputs: the kv and its gate score (APE added).
struct CompVal {
    float kv, sc;
};

// Compressors whose row pools at most COMP_SMALL values (ratio 4 with two lanes: the
// main and the indexer compressor of the ratio-4 layers) load them all at once.
#define COMP_SMALL 8

// The softmax-pooled value of cv[0 … n) in the order of the generic loops below (two
// lanes: previous-window value i, then current-window value i, for i = 0 … ratio − 1):
// the max, then the exp-weighted sums in that order.
__device__ __forceinline__ float comp_pool(const CompVal (&cv)[COMP_SMALL], int n) {
    float mx = NEG_INF_F;
#pragma unroll
    for (int q = 0; q < COMP_SMALL; ++q)
        if (q < n) mx = fmaxf(mx, cv[q].sc);
    if (!(mx > -5e29f)) return 0.f;
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int q = 0; q < COMP_SMALL; ++q) {
        if (q < n) {
            const float e = expf(cv[q].sc - mx);
            num += e * cv[q].kv;
            den += e;
        }
    }
    return num / den;
}

// ---- Compressor step (§5.4). kvs holds the new kv (w floats) then the new gate score
// (w floats, APE not yet added). State: skv, ssc [L·r][w]. When (pos+1) % r == 0 the
// pooled row is normed, rotated (position pos+1−r) and QAT-simulated, then stored as
// row (pos+1)/r − 1 of `rows`. mode 0: main (FP8 on nope dims), 1: indexer
// (Hadamard + FP4). One block of ≥ d threads (d ≤ 1024) per token: one session's
// single token (gridDim.y = 1), or with `kvt` (a batched step over several sessions)
// token blockIdx.y of its own session, whose state (skv, ssc, rows) is at fields
// 0, 1, 2 of kvt (the caller offsets it to the main or the indexer compressor).
extern "C" __global__ void __launch_bounds__(1024) compressor_step(const Step* step,
        const float* kvs, const void* ape, int ape_type, float* skv, float* ssc, int ratio,
        int lanes, int d, const void* norm_w, int norm_type, float eps, RopeP p, int mode,
        int f16_round, float* rows, const u64* kvt) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float v[1024];
    __shared__ float red[32];
    const int w = lanes * d;
    const int t = blockIdx.y;
    step += t;
    kvs += (i64)t * 2 * w;
    skv = kvt_ptr(kvt, t, 0, skv);
    ssc = kvt_ptr(kvt, t, 1, ssc);
    rows = kvt_ptr(kvt, t, 2, rows);
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
        if (lanes * ratio <= COMP_SMALL) {
            // Every value of the row first (one memory round trip, not one per value),
            // then the generic loop's max and sums in its order.
            CompVal cv[COMP_SMALL];
#pragma unroll
            for (int q = 0; q < COMP_SMALL; ++q) {
                if (q < lanes * ratio) {
                    const int i = lanes == 2 ? q >> 1 : q;
                    const i64 at = (lanes == 2 && (q & 1)) ? (i64)(ratio + i) * w + d + j
                                                           : (i64)i * w + j;
                    cv[q].sc = ssc[at];
                    cv[q].kv = skv[at];
                }
            }
            v[j] = comp_pool(cv, lanes * ratio);
            continue;
        }
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
    compressor_finish_row(v, red, d, norm_w, norm_type, eps, p, (float)(pos + 1 - ratio), mode,
                          f16_round, rows + (i64)((pos + 1) / ratio - 1) * d);
    if (lanes == 2) {
        // The current window becomes the "previous" lane of the next row.
        // Four values a thread in flight before their stores (the source slots,
        // ratio · w and on, never overlap the destination).
        __syncthreads();
        const int n = ratio * w, step4 = 4 * blockDim.x;
        for (int i0 = threadIdx.x; i0 < n; i0 += step4) {
            float a[4], c[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = i0 + q * blockDim.x;
                if (i < n) {
                    a[q] = skv[(i64)n + i];
                    c[q] = ssc[(i64)n + i];
                }
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = i0 + q * blockDim.x;
                if (i < n) {
                    skv[i] = a[q];
                    ssc[i] = c[q];
                }
            }
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
        if (lanes * ratio <= COMP_SMALL) {
            // As compressor_step: every value first, then the same max and sums.
            CompVal cv[COMP_SMALL];
#pragma unroll
            for (int q = 0; q < COMP_SMALL; ++q) {
                if (q < lanes * ratio) {
                    const int i = lanes == 2 ? q >> 1 : q;
                    cv[q] = (lanes == 2 && (q & 1))
                                ? comp_value(base + i, d + j, p0, kvs, ape, ape_type, skv, ssc,
                                             ratio, lanes, w)
                                : comp_value(base - (lanes == 2 ? ratio : 0) + i, j, p0, kvs, ape,
                                             ape_type, skv, ssc, ratio, lanes, w);
                }
            }
            v[j] = comp_pool(cv, lanes * ratio);
            continue;
        }
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
    compressor_finish_row(v, red, d, norm_w, norm_type, eps, p, (float)base, mode, f16_round,
                          rows + (i64)row * d);
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
