// The sampled pick of a decode token on the device (engine: `Session::sample_run`,
// cuda/state/pick.rs): temperature, top-k, top-p and min-p as the host's sampler
// defines them in integer weights (engine `sampling/fixed.rs`), so that the device
// picks the host's token for the same logits and uniform draw, bit for bit, and a
// sampled decode runs one token ahead of the host as the greedy one does.
//
// Two launches end the token's graph:
//   sample_max  — pick_grid's first maximum (and NaN flag) of the logits: the row's
//                 maximum `mx` and the fallback token;
//   sample_pick — every block weighs its share (W = round(e^((l − mx)/T) · 2^46)) and
//                 appends the tokens that can count to an unsorted list of
//                 {key, W} (key = descending logit, then id); the last block to finish
//                 runs the filters and the draw on the list as radix selections:
//                 "the first key whose running count / weight exceeds a target" in
//                 seven passes of 7 bits over the 49-bit keys. Integer sums do not
//                 depend on their order, so the unsorted list gives the sorted walk's
//                 answers.
// The draw u of the token at `pos` is the host's (slot pos % 4 of the mapped ring,
// written before the launch): the sampler's stream stays on the host.
#include "common.cuh"

// Weights: the top token's, and the log-weight below which a token weighs nothing.
#define SAMPLE_ONE (1ull << 46)
#define SAMPLE_X_FLOOR (-40.0)
// Slots of the sample ring (src/sample.rs SAMPLE_SLOTS): {u lo, u hi, token, nan}.
#define SAMPLE_SLOTS 4
// List entries the last block copies to shared memory (past that it reads the list
// in global memory: flat logits at a high temperature).
#define SAMPLE_SMEM 1024

// e^x for x in [−40, 0]: fixed.rs `exp_fixed`, operation for operation, rounded
// additions and multiplications only (no contraction into fused multiply-adds).
__device__ __forceinline__ double sample_exp(double x) {
    const double kf = __dsub_rn(
        __dadd_rn(__dmul_rn(x, __longlong_as_double(0x3ff71547652b82fell)), 6755399441055744.0),
        6755399441055744.0);
    const double r = __dsub_rn(__dsub_rn(x, __dmul_rn(kf, __longlong_as_double(0x3fe62e42fee00000ll))),
                               __dmul_rn(kf, __longlong_as_double(0x3dea39ef35793c76ll)));
    const long long c[14] = {
        0x3de6124613a86d09ll, 0x3e21eed8eff8d898ll, 0x3e5ae64567f544e4ll, 0x3e927e4fb7789f5cll,
        0x3ec71de3a556c734ll, 0x3efa01a01a01a01all, 0x3f2a01a01a01a01all, 0x3f56c16c16c16c17ll,
        0x3f81111111111111ll, 0x3fa5555555555555ll, 0x3fc5555555555555ll, 0x3fe0000000000000ll,
        0x3ff0000000000000ll, 0x3ff0000000000000ll};
    double p = __longlong_as_double(c[0]);
#pragma unroll
    for (int i = 1; i < 14; ++i) p = __dadd_rn(__dmul_rn(p, r), __longlong_as_double(c[i]));
    const long long k = (long long)kf;
    return __dmul_rn(p, __longlong_as_double((1023ll + k) << 52));
}

// fixed.rs `weight`.
__device__ __forceinline__ unsigned long long sample_weight(float l, float mx, double t) {
    const double x = l == mx ? 0.0 : __ddiv_rn(__dsub_rn((double)l, (double)mx), t);
    if (!(x >= SAMPLE_X_FLOOR)) return 0ull;
    return __double2ull_rz(__dadd_rn(__dmul_rn(sample_exp(x), (double)SAMPLE_ONE), 0.5));
}

// fixed.rs `order_key` packed: (descending logit) << 17 | id.
__device__ __forceinline__ unsigned long long sample_key(float l, int id) {
    const unsigned b = __float_as_uint(l);
    const unsigned ord = (b >> 31) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)(~ord) << 17) | (unsigned long long)id;
}

// The settings, in the ring's first words (written by the host before a run):
// {t (f64), top_p (f64, 1 = off), w_min (u64), top_k, unused}.
struct SampleParams {
    double t, top_p, u;
    unsigned long long w_min;
    int top_k;
};
#define SAMPLE_SLOT0 8  // ring words before the slots

// `res` (device memory, 16 words): {argmax, nan, mx bits, unused, then as 64-bit words
// t, top_p, w_min, u, then top_k}. sample_max's first thread copies the settings and
// the draw there from the mapped ring before its PDL wait (one PCIe round trip beside
// the head's product): every thread of sample_pick reading the mapped words itself
// cost milliseconds.
__device__ __forceinline__ SampleParams sample_params(const int* res) {
    const long long* p = reinterpret_cast<const long long*>(res + 4);
    SampleParams s;
    s.t = __longlong_as_double(p[0]);
    s.top_p = __longlong_as_double(p[1]);
    s.w_min = (unsigned long long)p[2];
    s.u = __longlong_as_double(p[3]);
    s.top_k = res[12];
    return s;
}

// The row's first maximum (pick_grid) into res: {token, nan, mx bits}, and the
// settings and the draw of the token at step[0] from the mapped `ring` (see
// sample_params).
extern "C" __global__ void __launch_bounds__(PICK_THREADS) sample_max(
    const float* __restrict__ logits, int n, const int* step, const int* ring, int* scratch,
    int* res) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        // The step buffer and the ring are not written inside the token's graph
        // before its pick.
        const int pos = step[0];
        const volatile long long* r = reinterpret_cast<const volatile long long*>(ring);
        const volatile long long* slot = reinterpret_cast<const volatile long long*>(
            ring + SAMPLE_SLOT0 + 4 * (pos & (SAMPLE_SLOTS - 1)));
        long long* p = reinterpret_cast<long long*>(res + 4);
        p[0] = r[0];
        p[1] = r[1];
        p[2] = r[2];
        p[3] = slot[0];
        res[12] = reinterpret_cast<const volatile int*>(ring)[6];
    }
    PDL_WAIT();
    int token, nan;
    if (!pick_grid(logits, n, -1, scratch, token, nan)) return;
    res[0] = token;
    res[1] = nan;
    res[2] = __float_as_int(logits[token]);
}

// An entry of the list: key and weight (global, or the last block's shared copy).
struct SampleList {
    const unsigned long long *key, *w;
    bool shared;
    __device__ __forceinline__ void get(int j, unsigned long long& k, unsigned long long& v) const {
        if (shared) {
            k = key[j];
            v = w[j];
        } else {
            k = __ldcg(key + j);
            v = __ldcg(w + j);
        }
    }
};

#define SAMPLE_THREADS 1024
#define SAMPLE_DIGIT 11  // bits a radix pass
#define SAMPLE_BINS (1 << SAMPLE_DIGIT)
#define SAMPLE_BINS_PER_THREAD (SAMPLE_BINS / SAMPLE_THREADS)

// A u64 sum over the block into every thread (`red`: 32 words of shared memory).
__device__ __forceinline__ unsigned long long sample_block_sum(unsigned long long s,
                                                               unsigned long long* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    __syncthreads();
    if (lane == 0) red[wid] = s;
    __syncthreads();
    s = 0;
    for (int i = 0; i < (int)(blockDim.x / WARP); ++i) s += red[i];
    __syncthreads();
    return s;
}

// hist[bin] += v as two 32-bit shared-memory atomics and a carry (exact modulo 2^64):
// a 64-bit shared atomic add is a compare-and-swap loop on sm_90 (ATOMS.CAST.SPIN.64),
// which a thousand threads on one bin turned into milliseconds.
__device__ __forceinline__ void sample_hist_add(unsigned long long* hist, int bin,
                                                unsigned long long v) {
    unsigned* h = reinterpret_cast<unsigned*>(hist + bin);
    const unsigned lo = (unsigned)v;
    unsigned hi = (unsigned)(v >> 32);
    const unsigned old = atomicAdd(&h[0], lo);
    if (old + lo < old) ++hi;
    if (hi) atomicAdd(&h[1], hi);
}

// Σ of the weights of the entries with key ≤ limit and weight ≥ wmin, into every thread.
__device__ __forceinline__ unsigned long long sample_sum(const SampleList& L, int n,
                                                         unsigned long long limit,
                                                         unsigned long long wmin,
                                                         unsigned long long* red) {
    unsigned long long s = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        unsigned long long k, v;
        L.get(j, k, v);
        if (k <= limit && v >= wmin) s += v;
    }
    return sample_block_sum(s, red);
}

// The smallest key K among the entries with key ≤ limit and weight ≥ wmin such that
// the entries up to K (key order) count more than `target` — by number (`by_count`)
// or weight. Keys are taken relative to the list's least key `kmin` (the row's first
// maximum), and only the `nb` bits that the list's keys span are looked at: MSB-first
// radix passes of SAMPLE_DIGIT bits, each a histogram of the entries that match the
// digits found so far; the bin where the running total crosses the target is the next
// digit. A thread adds runs of equal bins into one shared-memory atomic (the first
// passes see mostly one bin). `hist`: SAMPLE_BINS words, `bc`: 2.
__device__ unsigned long long sample_select(const SampleList& L, int n, unsigned long long kmin,
                                            int nb, unsigned long long limit,
                                            unsigned long long wmin, bool by_count,
                                            unsigned long long target, unsigned long long* hist,
                                            unsigned long long* bc) {
    unsigned long long prefix = 0;
    for (int hi = nb; hi > 0; hi -= SAMPLE_DIGIT) {
        const int shift = max(hi - SAMPLE_DIGIT, 0);
        const unsigned long long mask = (1ull << (hi - shift)) - 1;
        for (int i = threadIdx.x; i < SAMPLE_BINS; i += blockDim.x) hist[i] = 0;
        if (threadIdx.x == 0) {
            bc[0] = 0;  // (no crossing: cannot happen for a target below the total)
            bc[1] = 0;
        }
        __syncthreads();
        int bin = -1;
        unsigned long long run = 0;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            unsigned long long k, v;
            L.get(j, k, v);
            const unsigned long long r = k - kmin;
            if (k <= limit && v >= wmin && (r >> hi) == (prefix >> hi)) {
                const int b = (int)((r >> shift) & mask);
                if (b != bin) {
                    if (run) sample_hist_add(hist, bin, run);
                    bin = b;
                    run = 0;
                }
                run += by_count ? 1ull : v;
            }
        }
        // The last runs: a warp whose lanes all hold one bin adds once (the first
        // passes, where the entries share their top digits).
        const unsigned same = __match_any_sync(0xffffffffu, run ? bin : -1);
        if (same == 0xffffffffu) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) run += __shfl_xor_sync(0xffffffffu, run, o);
            if (threadIdx.x % WARP == 0 && run) sample_hist_add(hist, bin, run);
        } else if (run) {
            sample_hist_add(hist, bin, run);
        }
        __syncthreads();
        // Each thread's SAMPLE_BINS_PER_THREAD consecutive bins, an exclusive scan of
        // their sums over the block.
        unsigned long long h[SAMPLE_BINS_PER_THREAD], own = 0;
#pragma unroll
        for (int i = 0; i < SAMPLE_BINS_PER_THREAD; ++i) {
            h[i] = hist[SAMPLE_BINS_PER_THREAD * threadIdx.x + i];
            own += h[i];
        }
        const int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
        unsigned long long incl = own;
#pragma unroll
        for (int o = 1; o < WARP; o <<= 1) {
            const unsigned long long up = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += up;
        }
        __shared__ unsigned long long wsum[32];
        if (lane == WARP - 1) wsum[wid] = incl;
        __syncthreads();
        unsigned long long before = incl - own;
        for (int w = 0; w < wid; ++w) before += wsum[w];
        if (before <= target && target < before + own) {
#pragma unroll
            for (int i = 0; i < SAMPLE_BINS_PER_THREAD; ++i) {
                if (target < before + h[i]) {
                    bc[0] = SAMPLE_BINS_PER_THREAD * threadIdx.x + i;
                    bc[1] = before;
                    break;
                }
                before += h[i];
            }
        }
        __syncthreads();
        target -= bc[1];
        prefix |= bc[0] << shift;
        __syncthreads();
    }
    return kmin + prefix;
}

// The sampled pick (grid: PICK_BLOCKS blocks of SAMPLE_THREADS) into the step buffer
// ({pos, token} → {pos + 1, pick}) and ring slot pos % 4 ({u, token, nan}).
// `res`: sample_max's {argmax, nan, mx}; `cnt`: {entries, finished blocks} (0 between
// launches); `acc`: {the entries' total weight, their least key, their largest key}
// ({0, ~0, 0} between launches); both reset here. `keys`, `ws`: the list (n entries
// at most).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_pick(
    int* step, const float* __restrict__ logits, int n, int* ring, const int* res,
    unsigned* cnt, unsigned long long* acc, unsigned long long* keys, unsigned long long* ws) {
    PDL_WAIT();
    const SampleParams P = sample_params(res);
    const float mx = __int_as_float(res[2]);
    const bool top_p = P.top_p < 1.0;
    // Without top-p nothing under min-p can count; top-p needs the top-k set's total.
    const unsigned long long least = top_p ? 1ull : P.w_min;
    const int lane = threadIdx.x % WARP;
    const int per = (n + gridDim.x - 1) / gridDim.x;
    const int i0 = blockIdx.x * per, i1 = min(n, i0 + per);
    unsigned long long wsum = 0, kmin = ~0ull, kmax = 0;
    for (int b = i0; b < i1; b += blockDim.x) {
        const int i = b + threadIdx.x;
        unsigned long long w = 0, key = 0;
        if (i < i1) {
            const float l = logits[i];
            w = sample_weight(l, mx, P.t);
            key = sample_key(l, i);
        }
        const bool keep = w >= least && w > 0;
        // One atomic a warp for its entries.
        const unsigned m = __ballot_sync(0xffffffffu, keep);
        if (m == 0) continue;
        unsigned base = 0;
        if (lane == __ffs(m) - 1) base = atomicAdd(&cnt[0], (unsigned)__popc(m));
        base = __shfl_sync(0xffffffffu, base, __ffs(m) - 1);
        if (keep) {
            const unsigned at = base + __popc(m & ((1u << lane) - 1));
            keys[at] = key;
            ws[at] = w;
            wsum += w;
            kmin = min(kmin, key);
            kmax = max(kmax, key);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wsum += __shfl_xor_sync(0xffffffffu, wsum, o);
        kmin = min(kmin, __shfl_xor_sync(0xffffffffu, kmin, o));
        kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, o));
    }
    if (lane == 0 && wsum > 0) {
        atomicAdd(&acc[0], wsum);
        atomicMin(&acc[1], kmin);
        atomicMax(&acc[2], kmax);
    }
    // The last block to finish runs the selections on the whole list.
    __shared__ unsigned last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&cnt[1], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int count = (int)*reinterpret_cast<volatile unsigned*>(&cnt[0]);
    const unsigned long long z_all = __ldcg(&acc[0]), k0 = __ldcg(&acc[1]), k1 = __ldcg(&acc[2]);
    __shared__ unsigned long long sk[SAMPLE_SMEM], sw[SAMPLE_SMEM], hist[SAMPLE_BINS], bc[2],
        red[32];
    SampleList L{keys, ws, false};
    if (count <= SAMPLE_SMEM) {
        for (int j = threadIdx.x; j < count; j += blockDim.x) {
            sk[j] = __ldcg(keys + j);
            sw[j] = __ldcg(ws + j);
        }
        __syncthreads();
        L = SampleList{sk, sw, true};
    }
    // The bits the list's keys span above the least.
    const int nb = count > 0 ? 64 - __clzll(k1 - k0) : 0;
    const unsigned long long all = ~0ull;
    unsigned long long limit = all;
    if (P.top_k > 0 && count > P.top_k)
        limit = sample_select(L, count, k0, nb, all, least, true,
                              (unsigned long long)(P.top_k - 1), hist, bc);
    if (top_p) {
        // The top-k set's total: every entry's when top-k cut nothing.
        const unsigned long long zk = limit == all ? z_all : sample_sum(L, count, limit, 1ull, red);
        if (zk > 0) {
            const double need = fmax(ceil(__dmul_rn(P.top_p, __ull2double_rn(zk))), 1.0);
            limit = sample_select(L, count, k0, nb, limit, 1ull, false,
                                  __double2ull_rz(need) - 1ull, hist, bc);
        }
    }
    // The kept total: every entry's when nothing cut the list (its entries are then
    // those of weight ≥ w_min).
    const unsigned long long z =
        limit == all && least == P.w_min ? z_all : sample_sum(L, count, limit, P.w_min, red);
    int token = res[0];
    if (z > 0) {
        unsigned long long target = __double2ull_rz(__dmul_rn(P.u, __ull2double_rn(z)));
        if (target > z - 1) target = z - 1;
        const unsigned long long k =
            sample_select(L, count, k0, nb, limit, P.w_min, false, target, hist, bc);
        const int id = (int)(k & 0x1ffffull);
        if (id < n) token = id;
    }
    if (threadIdx.x != 0) return;
    const int pos = step[0];
    volatile int* slot = ring + SAMPLE_SLOT0 + 4 * (pos & (SAMPLE_SLOTS - 1));
    slot[2] = token;
    slot[3] = res[1];
    step[0] = pos + 1;
    step[1] = token;
    cnt[0] = 0;
    cnt[1] = 0;
    acc[0] = 0;
    acc[1] = ~0ull;
    acc[2] = 0;
}
