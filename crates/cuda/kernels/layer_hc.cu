// ---- HC bridge (variant `hc_bridge`): one sublayer's hc_post, then the next sublayer's
// hc_mix and hc_pre (with its RMS norm and Q8_0 form), in one launch per token.
//
// Between two sublayers a decode token ran three dependent launches (hc_post_pl, hc_mix_pl,
// hc_pre_pl: ~10 µs with their gaps, 86 times a token) whose work is a few hundred KB of
// L2 traffic. Here the grid's blocks each take HB_T columns of the streams, in HB_GROUPS
// groups of HB_T threads that each take HB_KG of the mix rows: hc_post for the columns
// (bit-identical to hc_post_pl: the same roundings in the same order; every group forms
// it, the first writes it), then the block's share of the 24 mix dots and of the sum of
// squares; the last block to finish (an atomic count a token, which that block resets
// for the next launch) adds the blocks' shares in block order, writes the mix (hc_comb
// reads it) and runs hc_pre on the whole token with all its HB_GROUPS·HB_T threads
// (with HB_T threads that tail took ~6 µs: most of the launch).
// Deterministic, but the mix sums run in another order than hc_mix_pl's single-block
// tree, so the mix and what follows it agree with the three-launch chain to rounding, not
// bit for bit (the selftest's `hc_bridge` line).
//
// Shapes: n_hc ≤ HB_HC, n_mix ≤ HB_MIX, n_embd a multiple of 32 and ≤ 4·HB_GROUPS·HB_T·
// HB_VEC; the
// launcher checks them. part_buf holds HB_SLOTS floats per block and token, counters one
// u32 per token, zero before the first launch. (HB_*: ds4_consts.h.)

// A weight of the mix matrix as raw bits, loaded ahead of the PDL wait (asm volatile
// keeps the load there; no kernel writes the weights). The 16-bit loads land in 32-bit
// registers, so nothing uses a value before every load is out (a conversion right after
// each load waited for it: 96 DRAM round trips in a row).
__device__ __forceinline__ u32 hb_weight_raw(const void* fn, int fn_type, i64 i) {
    u32 v;
    if (fn_type == WT_F32) {
        asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(reinterpret_cast<const float*>(fn) + i));
    } else {
        asm volatile("ld.global.nc.u16 %0, [%1];" : "=r"(v) : "l"(reinterpret_cast<const u16*>(fn) + i));
    }
    return v;
}

__device__ __forceinline__ float hb_weight(u32 raw, int fn_type) {
    if (fn_type == WT_F32) return __uint_as_float(raw);
    return fn_type == WT_F16 ? h2f((u16)raw) : __uint_as_float(raw << 16);
}

#define HC_BRIDGE_PARAMS                                                                      \
    const float *h, const float *out, const float *parts, int n_parts, const float *hcp,       \
        int n_hc, int n_embd, float *h_out, const void *fn, int fn_type, int n_mix,            \
        float mix_eps, float *mix, const float *scale, const float *base, float hc_eps,        \
        float *y, const void *norm_w, int norm_type, float norm_eps, float *norm_out, i8 *q,  \
        float *d, float *part_buf, u32 *counters, int flags

extern "C" __global__ void __launch_bounds__(HB_GROUPS * HB_T, 1) hc_bridge(HC_BRIDGE_PARAMS) {
    constexpr int NT = HB_GROUPS * HB_T;
    const int t = threadIdx.x, nb = gridDim.x, tok = blockIdx.y;
    const int post_on = flags & 1, probe = flags >> 1;  // probe bits: timings only
    const int grp = t / HB_T, col = blockIdx.x * HB_T + t % HB_T;
    const bool on = col < n_embd;
    const i64 nn = (i64)n_hc * n_embd;
    // This thread's mix rows grp·HB_KG + r.
    u32 wraw[HB_KG][HB_HC];
#pragma unroll
    for (int r = 0; r < HB_KG; ++r)
#pragma unroll
        for (int j = 0; j < HB_HC; ++j) {
            const int k = grp * HB_KG + r;
            wraw[r][j] = on && k < n_mix && j < n_hc && !(probe & 1)
                             ? hb_weight_raw(fn, fn_type, (i64)k * nn + (i64)j * n_embd + col)
                             : 0u;
        }
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    // Without post_on (a sublayer start with no hc_post before it: the first layer, a
    // split's first stage layer) the streams are `h` as they are (h_out is h).
    hc_post_rows(tok, n_hc, n_embd, n_parts, h, h_out, out, parts, hcp);
    mix += (i64)tok * n_mix;
    float post[HB_HC], comb[HB_HC][HB_HC];
    if (post_on) hc_post_coefs(hcp, n_hc, post, comb);

    // hc_post_pl's value for this column, in its order.
    float hn[HB_HC];
#pragma unroll
    for (int j = 0; j < HB_HC; ++j) hn[j] = 0.f;
    if (on && !post_on) {
#pragma unroll
        for (int j = 0; j < HB_HC; ++j)
            if (j < n_hc) hn[j] = h[(i64)j * n_embd + col];
    } else if (on) {
        float o = out[col], pv[HC_POST_PARTS], hv[HB_HC];
#pragma unroll
        for (int k = 0; k < HC_POST_PARTS; ++k)
            if (parts && k < n_parts) pv[k] = parts[(i64)k * n_embd + col];
#pragma unroll
        for (int i = 0; i < HB_HC; ++i)
            if (i < n_hc) hv[i] = h[(i64)i * n_embd + col];
        if (parts) {
            float acc = 0.f;
#pragma unroll
            for (int k = 0; k < HC_POST_PARTS; ++k)
                if (k < n_parts) acc += pv[k];
            for (int k = HC_POST_PARTS; k < n_parts; ++k) acc += parts[(i64)k * n_embd + col];
            o = acc + o;
        }
#pragma unroll
        for (int j = 0; j < HB_HC; ++j)
            if (j < n_hc) {
                hn[j] = hc_post_stream(o, j, post, comb, hv, n_hc);
                if (grp == 0) h_out[(i64)j * n_embd + col] = hn[j];
            }
    }

    // This block's share of the mix dots (slot k) and of the sum of squares (slot
    // HB_MIX, group 0): per thread in stream order, the warps' butterflies, then the
    // group's warps in order.
    constexpr int WG = HB_T / WARP;  // warps a group
    __shared__ float red[HB_GROUPS * WG][HB_KG + 1];
    __shared__ float tot[HB_MIX + 1];
    __shared__ int last;
    const int lane = t % WARP, wid = t / WARP;
    {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < HB_HC; ++j) ss = fmaf(hn[j], hn[j], ss);
        ss = warp_sum(ss);
        if (lane == 0) red[wid][HB_KG] = ss;
    }
#pragma unroll
    for (int r = 0; r < HB_KG; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < HB_HC; ++j) dot = fmaf(hb_weight(wraw[r][j], fn_type), hn[j], dot);
        dot = warp_sum(dot);
        if (lane == 0) red[wid][r] = dot;
    }
    if (probe & 4) return;
    __syncthreads();
    float* part = part_buf + ((i64)tok * nb + blockIdx.x) * HB_SLOTS;
    if (t <= HB_MIX) {
        // slot t: rows of group t / HB_KG (the sum of squares: group 0's).
        const int g = t < HB_MIX ? t / HB_KG : 0, r = t < HB_MIX ? t % HB_KG : HB_KG;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < WG; ++i) s += red[g * WG + i][r];
        __stcg(part + t, s);
    }
    // The last block of the token: the barrier orders the block's stores before thread
    // 0's count, whose acq_rel at GPU scope publishes them (release) and, for the last
    // block, makes every other block's visible to it (acquire); its reads then go to
    // the L2 (ld.cg). (A __threadfence is a sequentially consistent fence and an L1
    // invalidation on top, twice a block.)
    __syncthreads();
    if (t == 0) {
        u32 prev;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(prev)
                     : "l"(counters + tok)
                     : "memory");
        last = prev == (u32)(nb - 1);
    }
    __syncthreads();
    if (!last) return;
    if (t == 0) counters[tok] = 0;  // ready for the next launch (a graph replays it)
    if (probe & 2) return;
    // hc_pre's and the norm's loads go out now, beside the shares' and the streams'.
    const float s0 = scale[0];
    float bv[HB_HC];
#pragma unroll
    for (int i = 0; i < HB_HC; ++i) bv[i] = i < n_hc ? base[i] : 0.f;
    float nw[HB_VEC][4];
    float4 hv2[HB_VEC][HB_HC];
#pragma unroll
    for (int p = 0; p < HB_VEC; ++p) {
        const int i0 = 4 * (t + p * NT);
#pragma unroll
        for (int k = 0; k < 4; ++k) nw[p][k] = norm_w && i0 + k < n_embd ? ldw(norm_w, norm_type, i0 + k) : 1.f;
#pragma unroll
        for (int i = 0; i < HB_HC; ++i)
            if (i < n_hc && i0 < n_embd)
                hv2[p][i] = __ldcg(reinterpret_cast<const float4*>(h_out + (i64)i * n_embd + i0));
    }
    // The mix: the blocks' shares in block order (all loads out before the sum).
    if (t <= HB_MIX) {
        const float* p0 = part_buf + (i64)tok * nb * HB_SLOTS + t;
        constexpr int NB_MAX = HB_GROUPS * HB_VEC * 4;  // nb ≤ n_embd / HB_T
        float sh[NB_MAX];
#pragma unroll
        for (int b = 0; b < NB_MAX; ++b) sh[b] = b < nb ? __ldcg(p0 + (i64)b * HB_SLOTS) : 0.f;
        float s = 0.f;
#pragma unroll
        for (int b = 0; b < NB_MAX; ++b)
            if (b < nb) s += sh[b];
        tot[t] = s;
    }
    __syncthreads();
    const float f = 1.0f / sqrtf(tot[HB_MIX] / (float)nn + mix_eps);
    if (t < n_mix) mix[t] = tot[t] * f;

    // hc_pre on the whole token: thread t owns values 4t…4t+3 (+ 4·NT·p), 8 threads a
    // Q8_0 block.
    float pre[HB_HC];
#pragma unroll
    for (int i = 0; i < HB_HC; ++i) pre[i] = i < n_hc ? sigmoidf_(tot[i] * f * s0 + bv[i]) + hc_eps : 0.f;
    y += (i64)tok * n_embd;
    float v[HB_VEC][4];
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < HB_VEC; ++p) {
        const int i0 = 4 * (t + p * NT);
        float a[4] = {0.f, 0.f, 0.f, 0.f};
        if (i0 < n_embd) {
#pragma unroll
            for (int i = 0; i < HB_HC; ++i) {
                if (i < n_hc) {
                    const float4 hv = hv2[p][i];
                    a[0] += pre[i] * hv.x;
                    a[1] += pre[i] * hv.y;
                    a[2] += pre[i] * hv.z;
                    a[3] += pre[i] * hv.w;
                }
            }
            if (y) *reinterpret_cast<float4*>(y + i0) = make_float4(a[0], a[1], a[2], a[3]);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[p][k] = a[k];
            ss += a[k] * a[k];
        }
    }
    if (norm_out == nullptr) return;
    __shared__ float red2[32];
    ss = block_sum(ss, red2);
    const float sc = 1.0f / sqrtf(ss / (float)n_embd + norm_eps);
    norm_out += (i64)tok * n_embd;
    if (q != nullptr) {
        q += (i64)tok * n_embd;
        d += (i64)tok * (n_embd / 32);
    }
#pragma unroll
    for (int p = 0; p < HB_VEC; ++p) {
        const int i0 = 4 * (t + p * NT);
        const bool in = i0 < n_embd;
        float o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            o[k] = v[p][k] * sc;
            if (in && norm_w) o[k] = o[k] * nw[p][k];
        }
        if (in) *reinterpret_cast<float4*>(norm_out + i0) = make_float4(o[0], o[1], o[2], o[3]);
        if (q != nullptr) quant_block32_x4(o, in, q + i0, d + i0 / 32);
    }
}
