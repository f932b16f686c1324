// The greedy pick of a decode token on the device (engine: `Session::greedy_run`,
// cuda/state/pick.rs `decode_pick`). It ends the token's graph: the first index of the
// largest of the `n` logits (index `skip` left out; -1: none), the same token the
// host's `argmax` / `argmax_skip` choose, and whether any logit is NaN (the host then
// refuses the token, as `check_logits` does). The pick feeds the next token without a
// round trip to the host: the kernel writes it into the step buffer as the next
// token's id, with the position advanced, and into slot `pos % 4` of a ring of
// {token, nan} pairs in mapped host memory, where the host reads it after the graph's
// event. The next graph can then be launched before this one ends.
#include "common.cuh"

// (best, index) against a candidate: larger value first, then the lower index. The
// first candidate of a thread is taken even at -inf (the host's argmax returns the
// first index of an all -inf row).
__device__ __forceinline__ void pick_take(float v, int i, float& best, int& bi) {
    if (bi == 0x7fffffff || v > best || (v == best && i < bi)) {
        best = v;
        bi = i;
    }
}

// A logit `v` at index `i` seen by one thread: NaN flagged, `skip` left out. A
// thread sees its indices in increasing order (the last block's tail past the last
// float4 comes after its float4s), so `v > best` keeps the first maximum.
__device__ __forceinline__ void pick_see(float v, int i, int skip, float& best, int& bi,
                                         int& nan) {
    if (v != v) {
        nan = 1;
    } else if (i != skip && (bi == 0x7fffffff || v > best)) {
        best = v;
        bi = i;
    }
}

// (best, index, nan) across a warp, into every lane: the larger value, ties to the
// lower index (a lane without a candidate holds index INT_MAX and loses every tie).
__device__ __forceinline__ void pick_warp(float& best, int& bi, int& nan) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        nan |= __shfl_xor_sync(0xffffffffu, nan, o);
        if (oi != 0x7fffffff) pick_take(ob, oi, best, bi);
    }
}

// (best, index, nan) of this block's share of the logits into the block's thread 0.
__device__ __forceinline__ void pick_block(float& best, int& bi, int& nan) {
    pick_warp(best, bi, nan);
    __shared__ float sb[32];
    __shared__ int si[32], sn[32];
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    if (lane == 0) {
        sb[wid] = best;
        si[wid] = bi;
        sn[wid] = nan;
    }
    __syncthreads();
    if (wid != 0) return;
    const int nw = blockDim.x / WARP;
    best = lane < nw ? sb[lane] : -INFINITY;
    bi = lane < nw ? si[lane] : 0x7fffffff;
    nan = lane < nw ? sn[lane] : 0;
    pick_warp(best, bi, nan);
}

#define PICK_THREADS 256

// The first maximum of the `n` logits (index `skip` left out; -1: none) and whether
// any is NaN, over a grid of `PICK_BLOCKS` (src/pick.rs) blocks of PICK_THREADS:
// each block scans a contiguous share of float4s (scalar loads where `logits` is not
// 16-byte aligned) and the last block to finish (the counter) merges the shares. One
// block over a whole 129k row took 16.7 µs (one SM's L2 reads). `scratch`: a counter
// (0 between launches, reset here) and {best, index, nan} per block. Returns true in
// one thread only, the last block's thread 0, with the result in `token` (0 when no
// value is left: n = 1 and skip = 0, or every value NaN) and `nan`.
__device__ __forceinline__ bool pick_grid(const float* __restrict__ logits, int n, int skip,
                                          int* scratch, int& token, int& nan) {
    float best = -INFINITY;
    int bi = 0x7fffffff;
    nan = 0;
    const int n4 = n / 4;
    const int per = (n4 + gridDim.x - 1) / gridDim.x;
    const int j0 = blockIdx.x * per, j1 = min(n4, j0 + per);
    if ((reinterpret_cast<unsigned long long>(logits) & 15) == 0) {
        const float4* l4 = reinterpret_cast<const float4*>(logits);
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
            const float4 q = l4[j];
            pick_see(q.x, 4 * j, skip, best, bi, nan);
            pick_see(q.y, 4 * j + 1, skip, best, bi, nan);
            pick_see(q.z, 4 * j + 2, skip, best, bi, nan);
            pick_see(q.w, 4 * j + 3, skip, best, bi, nan);
        }
    } else {
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
            for (int k = 0; k < 4; ++k) pick_see(logits[4 * j + k], 4 * j + k, skip, best, bi, nan);
        }
    }
    if (blockIdx.x == gridDim.x - 1) {
        for (int i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) {
            pick_see(logits[i], i, skip, best, bi, nan);
        }
    }
    pick_block(best, bi, nan);
    if (threadIdx.x >= WARP) return false;
    const int lane = threadIdx.x;
    unsigned* count = reinterpret_cast<unsigned*>(scratch);
    unsigned done = 0;
    if (lane == 0) {
        int* part = scratch + 1 + 3 * blockIdx.x;
        part[0] = __float_as_int(best);
        part[1] = bi;
        part[2] = nan;
        __threadfence();
        done = atomicAdd(count, 1u);
    }
    if (__shfl_sync(0xffffffffu, done, 0) != gridDim.x - 1) return false;
    // The last block's first warp: every share is written (each block fenced before
    // counting); the shares in any order (ties go to the lower index).
    __threadfence();
    best = -INFINITY;
    bi = 0x7fffffff;
    nan = 0;
    for (int b = lane; b < gridDim.x; b += WARP) {
        const volatile int* p = scratch + 1 + 3 * b;
        const int oi = p[1];
        nan |= p[2];
        if (oi != 0x7fffffff) pick_take(__int_as_float(p[0]), oi, best, bi);
    }
    pick_warp(best, bi, nan);
    if (lane != 0) return false;
    *count = 0;
    token = bi == 0x7fffffff ? 0 : bi;
    return true;
}

// The greedy pick of a decode token (pick_grid) into the step buffer `step`
// ({pos, token} -> {pos + 1, pick}) and slot pos % 4 of the mapped `ring`.
extern "C" __global__ void __launch_bounds__(PICK_THREADS) greedy_pick(
    int* step, const float* __restrict__ logits, int n, int skip, int* ring, int* scratch) {
    PDL_WAIT();
    int token, nan;
    if (!pick_grid(logits, n, skip, scratch, token, nan)) return;
    const int pos = step[0];
    int* slot = ring + 2 * (pos & 3);
    slot[0] = token;
    slot[1] = nan;
    step[0] = pos + 1;
    step[1] = token;
}

// ---------------------------------------------------------------------------------
// The picks of a greedy speculative cycle (engine: `Backend::greedy_cycle`,
// cuda/state/spec.rs): the MTP draft's pick chains the next draft and the verify
// step's row on the device; the verify step's rows are picked in one launch. Only a
// few integers reach the host (mapped memory), never the logits.

// A thread's top-2 state: the first maximum (best, bi) and the largest value at any
// other index (sec); the host's `top2_margin` is best − sec.
__device__ __forceinline__ void top2_see(float v, int i, float& best, int& bi, float& sec,
                                         int& nan) {
    if (v != v) {
        nan = 1;
    } else if (bi == 0x7fffffff) {
        best = v;
        bi = i;
    } else if (v > best) {
        sec = best;
        best = v;
        bi = i;
    } else {
        sec = fmaxf(sec, v);
    }
}

// Merges another state into this one (a tie goes to the lower index; the loser's best
// becomes a second value).
__device__ __forceinline__ void top2_take(float ob, int oi, float os, float& best, int& bi,
                                          float& sec) {
    if (oi == 0x7fffffff) return;
    if (bi == 0x7fffffff) {
        best = ob;
        bi = oi;
        sec = os;
    } else if (ob > best || (ob == best && oi < bi)) {
        sec = fmaxf(best, fmaxf(sec, os));
        best = ob;
        bi = oi;
    } else {
        sec = fmaxf(sec, fmaxf(ob, os));
    }
}

__device__ __forceinline__ void top2_warp(float& best, int& bi, float& sec, int& nan) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        const float os = __shfl_xor_sync(0xffffffffu, sec, o);
        nan |= __shfl_xor_sync(0xffffffffu, nan, o);
        top2_take(ob, oi, os, best, bi, sec);
    }
}

// Slots of the draft ring (src/pick.rs SPEC_SLOTS): a draft at position `pos` uses
// slot pos % 16 of {override, used, nan, margin bits}.
#define SPEC_SLOTS 16

// The pick of an MTP draft's logits (grid: PICK_BLOCKS blocks of PICK_THREADS).
// `step`: the draft's step buffer {pos, token}, advanced to {pos + 1, used} so that a
// chained draft runs on without the host; `vstep`: the verify step's records
// ({position, token} per row, row 0 at position vstep[0]), whose row for position
// pos + 1 gets `used`; `slots`: the mapped draft ring. `used` is the host's override
// (slot word 0, written before the launch) when ≥ 0, else the first maximum of the
// logits. `scratch`: a counter (0 between launches) and {best, index, second, nan}
// per block.
extern "C" __global__ void __launch_bounds__(PICK_THREADS) draft_pick(
    const float* __restrict__ logits, int n, int* step, int* vstep, int* slots, int* scratch) {
    PDL_WAIT();
    float best = -INFINITY, sec = -INFINITY;
    int bi = 0x7fffffff, nan = 0;
    const int n4 = n / 4;
    const int per = (n4 + gridDim.x - 1) / gridDim.x;
    const int j0 = blockIdx.x * per, j1 = min(n4, j0 + per);
    const float4* l4 = reinterpret_cast<const float4*>(logits);
    for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        const float4 q = l4[j];
        top2_see(q.x, 4 * j, best, bi, sec, nan);
        top2_see(q.y, 4 * j + 1, best, bi, sec, nan);
        top2_see(q.z, 4 * j + 2, best, bi, sec, nan);
        top2_see(q.w, 4 * j + 3, best, bi, sec, nan);
    }
    if (blockIdx.x == gridDim.x - 1) {
        for (int i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) {
            top2_see(logits[i], i, best, bi, sec, nan);
        }
    }
    top2_warp(best, bi, sec, nan);
    __shared__ float sb[32], ss[32];
    __shared__ int si[32], sn[32];
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    if (lane == 0) {
        sb[wid] = best;
        si[wid] = bi;
        ss[wid] = sec;
        sn[wid] = nan;
    }
    __syncthreads();
    if (wid != 0) return;
    const int nw = blockDim.x / WARP;
    best = lane < nw ? sb[lane] : -INFINITY;
    bi = lane < nw ? si[lane] : 0x7fffffff;
    sec = lane < nw ? ss[lane] : -INFINITY;
    nan = lane < nw ? sn[lane] : 0;
    top2_warp(best, bi, sec, nan);
    unsigned* count = reinterpret_cast<unsigned*>(scratch);
    unsigned done = 0;
    if (lane == 0) {
        int* part = scratch + 1 + 4 * blockIdx.x;
        part[0] = __float_as_int(best);
        part[1] = bi;
        part[2] = __float_as_int(sec);
        part[3] = nan;
        __threadfence();
        done = atomicAdd(count, 1u);
    }
    if (__shfl_sync(0xffffffffu, done, 0) != gridDim.x - 1) return;
    __threadfence();
    best = -INFINITY;
    sec = -INFINITY;
    bi = 0x7fffffff;
    nan = 0;
    for (int b = lane; b < gridDim.x; b += WARP) {
        const volatile int* p = scratch + 1 + 4 * b;
        nan |= p[3];
        top2_take(__int_as_float(p[0]), p[1], __int_as_float(p[2]), best, bi, sec);
    }
    top2_warp(best, bi, sec, nan);
    if (lane != 0) return;
    *count = 0;
    // The host's argmax: token 0 when every value is NaN; its top2_margin: +inf
    // without a second value.
    const int pick = bi == 0x7fffffff ? 0 : bi;
    const float margin = (bi == 0x7fffffff || sec == -INFINITY) ? INFINITY : best - sec;
    const int pos = step[0];
    volatile int* slot = slots + 4 * (pos & (SPEC_SLOTS - 1));
    const int ovr = slot[0];
    const int used = ovr >= 0 ? ovr : pick;
    slot[1] = used;
    slot[2] = nan;
    slot[3] = __float_as_int(margin);
    step[0] = pos + 1;
    step[1] = used;
    const int r = pos + 1 - vstep[0];
    if (r > 0 && r < SPEC_SLOTS) vstep[2 * r + 1] = used;
}

// The picks of a verify step's `rows` logits rows (`[rows][n]`; grid: PICK_BLOCKS ×
// rows blocks of PICK_THREADS): per row pick_grid's first maximum and NaN flag into
// out[2·row], out[2·row + 1] (mapped host memory). `scratch`: pick_grid's per row.
extern "C" __global__ void __launch_bounds__(PICK_THREADS) rows_pick(
    const float* __restrict__ logits, int n, int* out, int* scratch) {
    PDL_WAIT();
    const int row = blockIdx.y;
    int token, nan;
    if (!pick_grid(logits + (long long)row * n, n, -1, scratch + row * (1 + 3 * gridDim.x),
                   token, nan))
        return;
    volatile int* o = out + 2 * row;
    o[0] = token;
    o[1] = nan;
}
