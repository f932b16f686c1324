// The routed-expert GEMMs of a prefill chunk on fp16 warpgroup MMA (variant `exp_f16`):
// IQ2_XXS and Q2_K stacks over a route plan, sm_90a only.
//
// Why: the int8 expert GEMM (mm_exp_*, matmul.cu) decodes its weights straight into
// mma.m16n8k32 fragments, but an IQ2_XXS value scaled by its sub-block (up to 43 · 31)
// does not fit int8, so every mma's int32 result is scaled and summed by 4 IMAD — ~15.6
// instructions an mma with the grid decode, and the kernel runs at ~200 TOP/s. Here each
// weight is decoded once a block to fp16 with every scale folded in, straight into the A
// registers of `wgmma.m64n64k16` (A from registers, B from shared memory), so the tensor
// cores sum the whole k in f32 with no epilogue but the token scale. A row's 32-value
// sub-span has only a few distinct values — IQ2_XXS ±c·{8, 25, 43} with c = d·(2ls+1)/8,
// Q2_K q·d·sc − dmin·m for q = 0..3 — so those are computed in f32 and rounded to fp16
// once each, and every value is one byte permute out of them (IQ2_XXS: the grid stored
// as permute selectors, then the sign by xor): one fp16 rounding a weight, one an
// activation (q8act_to_f16's), where the int8 path rounds neither but sums the same terms.
//
// Cost (SASS, a 128-k stage of a warp, 16 rows × 64 pairs): ~390 instructions, ~365 with
// the quad-shared values (`_qs`); a 2,048-token launch on the H200 went 1,046 → 775 µs
// (IQ2_XXS) and ~1,000 → 732 µs (Q2_K): ~27% of the dense fp16 rate, bound by the
// decode's issue and latency, not the tensor cores (NOTES session 21).
//
// The k order: a thread's A registers of one 32-value sub-span hold values 8t..8t+7 of
// its rows (t = lane mod 4: one 8-value IQ2_XXS grid entry, one Q2_K byte run), where the
// fragment layout wants k = 2t, 2t+1, 2t+8, 2t+9 of two k16 steps. A sum over k does not
// care about order, so the activations are written in the matching order instead
// (q8act_to_f16_perm): logical position L of a 32-span holds value
// 8·((L mod 8)/2) + 4·(L/16) + 2·((L/8) mod 2) + L mod 2.
//
// Block: 2 warpgroups × 64 weight rows of one expert, up to 64 (token, expert) pairs (a
// work item of the plan). Stages of 128 k: the pairs' fp16 rows (two 64-k tiles of
// 128-byte rows in the 128-byte swizzle, as mm_f16_wg_128x128) and the weight rows'
// quant bytes, XF_STAGES deep; wgmma of stage s runs while stage s+1 is decoded (two
// register sets of A), so a stage's buffer is refilled two stages later.

#define XF_STAGES 4
#define XF_PAIRS 64
#define XF_BBYTES (XF_PAIRS * 128 * 2)
#define XF_COPIES 8

// Quant bytes of a stage (after the B tiles; a multiple of 1,024 so stages stay aligned):
// IQ2_XXS 128 rows × 32 qs bytes + 128 f32 scales d; Q2_K 128 × 32 qs + 128 × 8 scale
// bytes + 128 × (d, dmin).
template <int F>
__host__ __device__ constexpr int xf_abytes() {
    return F == EXP_F_IQ2 ? 5120 : 6144;
}
template <int F>
__host__ __device__ constexpr int xf_stage() {
    return XF_BBYTES + xf_abytes<F>();
}

// Activations for the fp16 expert GEMM: row t's `cols` int8 values (one f32 scale per
// 32) to fp16 q·(d/s_t) as q8act_to_f16, each 32-span in the fragment order above.
extern "C" __global__ void __launch_bounds__(256) q8act_to_f16_perm(const i8* __restrict__ q,
                                                                    const float* __restrict__ d,
                                                                    u16* __restrict__ out,
                                                                    float* __restrict__ tscale,
                                                                    int cols) {
    q8act_to_f16_row<true>(q, d, out, tscale, cols);
}

// d += A·B, A (64 × 16 fp16) from registers in the mma.m16n8k16 layout (warp w of the
// warpgroup: rows 16w..), B (16 × 64) from shared memory.
__device__ __forceinline__ void xf_mma(float (&d)[32], const u32 (&a)[4], u64 db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, "
        "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
          "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
          "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
#else
    __trap();
#endif
}

// Keeps registers that an in-flight wgmma reads (or writes) live and unmoved until here.
__device__ __forceinline__ void xf_keep(u32 (&a)[8][4]) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}
__device__ __forceinline__ void xf_keep(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void xf_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void xf_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}


// fp16 pair {lo, hi} of two floats, each rounded once.
__device__ __forceinline__ u32 xf_pack(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Bytes of {a, b} picked by the four selector nibbles sel[15:0] (PTX prmt: the upper
// half of sel is ignored and, with no nibble's msb set, no sign replication — where
// __byte_perm masks every selector with 0x7777 first).
__device__ __forceinline__ u32 xf_prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// The IQ2_XXS grid as byte selectors: entry e's pair q (values 2q, 2q+1) is the 16-bit
// __byte_perm selector that picks their fp16 values out of {c·8, c·25 | c·43, 0} (the
// grid's three magnitudes, 2 bytes each: code 0, 1, 2 at bytes 0, 2, 4).
__device__ __forceinline__ u64 xf_grid_sel(u64 gv) {
    u64 o = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 b = (u32)(gv >> (8 * i)) & 255;
        const u64 code = b == 8 ? 0 : (b == 25 ? 1 : 2);
        // Value i is half i & 1 of pair i / 2: nibbles 2(i&1), 2(i&1)+1 of its selector.
        o |= ((2 * code) | ((2 * code + 1) << 4)) << (16 * (i / 2) + 8 * (i & 1));
    }
    return o;
}

// Q2_K sub-block sb (of the stage's 8) of a row: its four values q·d·sc − dmin·m,
// q = 0..3, as fp16 pairs {q 0, 1}, {q 2, 3}.
__device__ __forceinline__ void xf_q2k_values(const u8* aq, int row, int sb, u32& v0, u32& v1) {
    const u32 sc = aq[128 * 32 + row * 8 + sb];
    const u32 dm = reinterpret_cast<const u32*>(aq + 128 * 40)[row];
    const float ds = h2f((u16)(dm & 0xffff)) * (float)(sc & 15);
    const float mn = h2f((u16)(dm >> 16)) * (float)(sc >> 4);
    v0 = xf_pack(-mn, ds - mn);
    v1 = xf_pack(2.0f * ds - mn, 3.0f * ds - mn);
}

// A quarter of the stage's per-row values for the lane's rows r, r + 8 (quad lane t):
// IQ2_XXS sub-span t's {8c, 25c | 43c, 0}; Q2_K sub-blocks t and 4 + t.
template <int F>
__device__ __forceinline__ void xf_quad_values(const u8* aq, int r, int lane, u32 (&qv)[2][4]) {
    const int t = lane & 3;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = r + 8 * hh;
        if (F == EXP_F_IQ2) {
            const u32 aux = *reinterpret_cast<const u32*>(aq + row * 32 + 8 * t + 4);
            const float c =
                reinterpret_cast<const float*>(aq + 128 * 32)[row] * (float)(2 * (aux >> 28) + 1);
            qv[hh][0] = xf_pack(8.0f * c, 25.0f * c);
            qv[hh][1] = xf_pack(43.0f * c, 0.0f);
        } else {
            xf_q2k_values(aq, row, t, qv[hh][0], qv[hh][1]);
            xf_q2k_values(aq, row, 4 + t, qv[hh][2], qv[hh][3]);
        }
    }
}

// Decodes sub-span j (32 values) of the stage for the lane's rows r, r + 8 (block-local)
// into A registers of k16 steps 2j, 2j+1. Each value is one byte permute out of a row's
// few possible fp16 values, each computed in f32 and rounded once: IQ2_XXS ±c·{8, 25,
// 43} (c = d·(2ls+1)/8; the sign by xor), Q2_K q·d·sc − dmin·m for q = 0..3.
// With QS, a row's few values come from the lane of its quad that formed them
// (xf_quad_values: each lane forms a quarter of the stage's, the shuffle hands them out)
// instead of each of the quad's 4 lanes forming the same ones.
template <int F, bool QS>
__device__ __forceinline__ void xf_decode(const u8* aq, const u64* sel64, int r, int j,
                                          int lane, const u32 (&qv)[2][4], u32 (&a)[8][4]) {
    const int t = lane & 3;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = r + 8 * hh;
        u32 sel[4], v0, v1;
        u32 sign = 0;
        if (F == EXP_F_IQ2) {
            const uint2 v = *reinterpret_cast<const uint2*>(aq + row * 32 + 8 * j);
            if (QS) {
                v0 = __shfl_sync(0xffffffffu, qv[hh][0], (lane & ~3) | j);
                v1 = __shfl_sync(0xffffffffu, qv[hh][1], (lane & ~3) | j);
            } else {
                const float c = reinterpret_cast<const float*>(aq + 128 * 32)[row] *
                                (float)(2 * (v.y >> 28) + 1);
                v0 = xf_pack(8.0f * c, 25.0f * c);
                v1 = xf_pack(43.0f * c, 0.0f);
            }
            // Grid index = byte t of v.x; this lane's copy of the entry.
            const u64 sl = sel64[xf_prmt(v.x, 0u, 0x4440u | t) * XF_COPIES + (lane & (XF_COPIES - 1))];
            sel[0] = (u32)sl;
            sel[1] = (u32)sl >> 16;
            sel[2] = (u32)(sl >> 32);
            sel[3] = (u32)(sl >> 48);
            const u32 s = (v.y >> (7 * t)) & 127;
            sign = s | ((__popc(s) & 1) << 7);
        } else {
            const uint2 v = *reinterpret_cast<const uint2*>(aq + row * 32 + 8 * t);
            if (QS) {
                // Sub-block 2j + t/2 is register j/2 of quad lane 2(j mod 2) + t/2.
                const int src = (lane & ~3) | (2 * (j & 1) + (t >> 1));
                v0 = __shfl_sync(0xffffffffu, qv[hh][2 * (j >> 1)], src);
                v1 = __shfl_sync(0xffffffffu, qv[hh][2 * (j >> 1) + 1], src);
            } else {
                xf_q2k_values(aq, row, 2 * j + (t >> 1), v0, v1);
            }
            // Quant q (0..3) → selector nibbles 2q, 2q + 1: q·0x22 + 0x10 per byte.
            const u32 x0 = (v.x >> (2 * j)) & 0x03030303u, x1 = (v.y >> (2 * j)) & 0x03030303u;
            sel[0] = (x0 & 0x0303u) * 0x22u + 0x1010u;
            sel[1] = ((x0 >> 16) & 0x0303u) * 0x22u + 0x1010u;
            sel[2] = (x1 & 0x0303u) * 0x22u + 0x1010u;
            sel[3] = ((x1 >> 16) & 0x0303u) * 0x22u + 0x1010u;
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            u32 o = xf_prmt(v0, v1, sel[q]);
            if (F == EXP_F_IQ2) {
                // Sign bits 2q, 2q+1 to the halves' sign bits 15, 31 (one multiply: the
                // two shifted copies of the 8 bits do not overlap).
                const u32 k = (1u << (15 - 2 * q)) + (1u << (30 - 2 * q));
                o ^= (sign * k) & 0x80008000u;
            }
            a[2 * j + (q >> 1)][hh + 2 * (q & 1)] = o;
        }
    }
}

// Plan mode only: block y = work item {expert, first pair, pairs ≤ 64}; pair p reads fp16
// activation row p / k_div (x_tok halves apart, scale tscale[row]) and writes
// y[p·y_tok + row]. rows % 128 == 0 and cols % 256 == 0 (the launcher checks).
template <int F, bool QS>
__device__ __forceinline__ void xf_body(const u8* __restrict__ w0, const u8* __restrict__ w1,
                                        const u8* __restrict__ w2, i64 mat0, i64 mat1,
                                        i64 mat2, const u64* __restrict__ grid_g,
                                        const u16* __restrict__ x16,
                                        const float* __restrict__ tscale, float* __restrict__ y,
                                        int rows, int cols, const int4* __restrict__ items,
                                        const i32* __restrict__ n_items,
                                        const i32* __restrict__ pairs, int k_div, i64 x_tok,
                                        i64 y_tok) {
    constexpr int STAGE = xf_stage<F>();
    extern __shared__ __align__(16) u8 xf_smem[];
    __shared__ i64 s_xoff[XF_PAIRS], s_yoff[XF_PAIRS];
    __shared__ float s_ts[XF_PAIRS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, w4 = warp & 3, g = lane >> 2, t = lane & 3;
    if ((int)blockIdx.y >= *n_items) return;
    const int4 it = items[blockIdx.y];
    const int e = it.x, len = min(XF_PAIRS, it.z);
    if (tid < XF_PAIRS) {
        i64 xo = 0, yo = -1;
        float ts = 0.0f;
        if (tid < len) {
            const int p = pairs[it.y + tid];
            const int row = p / k_div;
            xo = (i64)row * x_tok;
            yo = (i64)p * y_tok;
            ts = tscale[row];
        }
        s_xoff[tid] = xo;
        s_yoff[tid] = yo;
        s_ts[tid] = ts;
    }
    // Stages (and the swizzle, a function of the address) start at a 1,024-byte boundary.
    const u32 raw = mm_smem(xf_smem);
    const u32 sbase = (raw + 1023u) & ~1023u;
    u8* const sgen = xf_smem + (sbase - raw);
    u64* const sel64 = reinterpret_cast<u64*>(sgen + XF_STAGES * STAGE);
    if (F == EXP_F_IQ2) {
        const u64 sl = xf_grid_sel(grid_g[tid]);
#pragma unroll
        for (int c = 0; c < XF_COPIES; ++c) sel64[tid * XF_COPIES + c] = sl;
    }
    __syncthreads();

    const int row0 = blockIdx.x * 128;
    const int nb = cols / 256, nst = cols / 128;
    w0 += e * mat0;
    w1 += e * mat1;
    w2 += e * mat2;

    // Stage s (k = 128s..) into buffer s mod XF_STAGES. Every address is a per-thread
    // base set up once plus the stage's offset. IQ2_XXS scales are 2-byte values: fetched
    // into `dn` by a plain load and stored by store_d after the decode.
    // B: 16-byte chunk kc = tid mod 16 of pair rows tid/16 + 16u (u < 4), at the same
    // swizzled column in every row (the rows are ≡ tid/16 mod 8).
    const int kc = tid & 15, pr0 = tid >> 4;
    const u32 bdst = (u32)((kc >> 3) * 8192 + pr0 * 128 + (((kc & 7) ^ (pr0 & 7)) << 4));
    // A: 16-byte chunk tid mod 2 of weight row tid/2's 32 quant bytes of the stage.
    const u8* aq_src = w0 + (i64)(row0 + (tid >> 1)) * nb * 64 + 16 * (tid & 1);
    const u32 aq_dst = XF_BBYTES + (u32)(tid * 16);
    // Per-row scales (threads < 128: row tid).
    const i64 rblk = (i64)(row0 + (tid & 127)) * nb;
    auto load = [&](int s, u16& dn) {
        const u32 st = sbase + (u32)((s % XF_STAGES) * STAGE);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            // Pair slots past the item's read row 0 with zero fill (the source is not read).
            const int pr = pr0 + 16 * u;
            mm_cp16(st + bdst + (u32)(u * 2048), x16 + s_xoff[pr] + (i64)s * 128 + kc * 8, pr < len);
        }
        mm_cp16(st + aq_dst, aq_src + (i64)s * 32, true);
        if (tid < 128) {
            const i64 blk = rblk + (s >> 1);
            if (F == EXP_F_IQ2) {
                dn = reinterpret_cast<const u16*>(w1)[blk];
            } else {
                const u32 aq = st + XF_BBYTES;
                mm_cp8(aq + 128 * 32 + tid * 8, w1 + blk * 16 + (s & 1) * 8, true);
                mm_cp4(aq + 128 * 40 + tid * 4, w2 + blk * 4, true);
            }
        }
    };
    auto store_d = [&](int s, u16 dn) {
        if (F == EXP_F_IQ2 && tid < 128)
            reinterpret_cast<float*>(sgen + (s % XF_STAGES) * STAGE + XF_BBYTES + 128 * 32)[tid] =
                h2f(dn) * 0.125f;
    };

    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
    u32 a0[8][4], a1[8][4];
    const int r = wg * 64 + w4 * 16 + g;

    u16 dn = 0;
#pragma unroll
    for (int s = 0; s < XF_STAGES - 2; ++s) {
        if (s < nst) {
            load(s, dn);
            store_d(s, dn);
        }
        mm_commit();
    }
    // One stage: wait for its bytes, refill the buffer of stage s − 2 (its wgmmas are
    // done: each warpgroup waited for them in step s − 1, before this barrier), decode
    // into `a`, issue its 8 wgmmas, then wait for those of stage s − 1 (`ap`'s).
    auto step = [&](int s, u32 (&a)[8][4], u32 (&ap)[8][4]) {
        asm volatile("cp.async.wait_group %0;" ::"n"(XF_STAGES - 3) : "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        const int sn = s + XF_STAGES - 2;
        if (sn < nst) load(sn, dn);
        mm_commit();
        const u32 st = sbase + (u32)((s % XF_STAGES) * STAGE);
        const u8* aq = sgen + (s % XF_STAGES) * STAGE + XF_BBYTES;
        u32 qv[2][4] = {};
        if (QS) xf_quad_values<F>(aq, r, lane, qv);
#pragma unroll
        for (int j = 0; j < 4; ++j) xf_decode<F, QS>(aq, sel64, r, j, lane, qv, a);
        xf_keep(a);
        xf_keep(acc);
        mw_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) xf_mma(acc, a[kk], mw_desc(st + (kk >> 2) * 8192 + (kk & 3) * 32));
        xf_commit();
        xf_wait<1>();
        xf_keep(ap);
        xf_keep(acc);
        if (sn < nst) store_d(sn, dn);
    };
    for (int s = 0; s < nst; s += 2) {
        step(s, a0, a1);
        step(s + 1, a1, a0);
    }
    xf_wait<0>();
    xf_keep(acc);
    asm volatile("cp.async.wait_group 0;" ::: "memory");

    // acc[4j + 0/1] = (row r, pairs 8j + 2t, +1), acc[4j + 2/3] = (row r + 8, same pairs).
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int n = 8 * j + 2 * t + h;
            if (n >= len) continue;
            const float s = s_ts[n];
            float* yp = y + s_yoff[n] + row0 + r;
            yp[0] = acc[4 * j + h] * s;
            yp[8] = acc[4 * j + 2 + h] * s;
        }
    }
}

#define XF_KERNEL(NAME, F, QS)                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(                                 \
        const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,        \
        i64 mat0, i64 mat1, i64 mat2, const u64* __restrict__ grid_g,                           \
        const u16* __restrict__ x16, const float* __restrict__ tscale, float* __restrict__ y,   \
        int rows, int cols, const int4* __restrict__ items, const i32* __restrict__ n_items,    \
        const i32* __restrict__ pairs, int k_div, i64 x_tok, i64 y_tok) {                       \
        PDL_WAIT();                                                                             \
        xf_body<F, QS>(w0, w1, w2, mat0, mat1, mat2, grid_g, x16, tscale, y, rows, cols, items, \
                       n_items, pairs, k_div, x_tok, y_tok);                                    \
    }
XF_KERNEL(mm_exp_f16_iq2_xxs, EXP_F_IQ2, false)
XF_KERNEL(mm_exp_f16_q2_k, EXP_F_Q2K, false)
XF_KERNEL(mm_exp_f16_iq2_xxs_qs, EXP_F_IQ2, true)
XF_KERNEL(mm_exp_f16_q2_k_qs, EXP_F_Q2K, true)
