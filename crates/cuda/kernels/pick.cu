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

// grid: `PICK_BLOCKS` (src/pick.rs) blocks of PICK_THREADS. `scratch`: a counter (0
// between launches) and {best, index, nan} per block. Each block takes a contiguous share of float4s;
// the last block to finish (the counter) reduces the shares in block order and
// writes the pick. One block over the whole row took 16.7 µs (one SM's L2 reads).
extern "C" __global__ void __launch_bounds__(PICK_THREADS) greedy_pick(
    int* step, const float* __restrict__ logits, int n, int skip, int* ring, int* scratch) {
    PDL_WAIT();
    float best = -INFINITY;
    int bi = 0x7fffffff, nan = 0;
    const int n4 = n / 4;
    const int per = (n4 + gridDim.x - 1) / gridDim.x;
    const int j0 = blockIdx.x * per, j1 = min(n4, j0 + per);
    const float4* l4 = reinterpret_cast<const float4*>(logits);
    for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
        const float4 q = l4[j];
        pick_see(q.x, 4 * j, skip, best, bi, nan);
        pick_see(q.y, 4 * j + 1, skip, best, bi, nan);
        pick_see(q.z, 4 * j + 2, skip, best, bi, nan);
        pick_see(q.w, 4 * j + 3, skip, best, bi, nan);
    }
    if (blockIdx.x == gridDim.x - 1) {
        for (int i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) {
            pick_see(logits[i], i, skip, best, bi, nan);
        }
    }
    pick_block(best, bi, nan);
    if (threadIdx.x >= WARP) return;
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
    if (__shfl_sync(0xffffffffu, done, 0) != gridDim.x - 1) return;
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
    if (lane != 0) return;
    *count = 0;
    // A row with no candidate (n = 1 and skip = 0) picks token 0.
    const int token = bi == 0x7fffffff ? 0 : bi;
    const int pos = step[0];
    int* slot = ring + 2 * (pos & 3);
    slot[0] = token;
    slot[1] = nan;
    step[0] = pos + 1;
    step[1] = token;
}
