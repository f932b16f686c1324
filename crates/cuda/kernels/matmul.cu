// Batched (prefill) matrix-matrix products on tensor cores (issue #6).
//
// * mm_q8_0_*: Q8_0 weights × int8 activations (one scale per 32), mma.sync m16n8k32 s8:
//   one k-step is one 32-block, so the int32 result of each mma is scaled by
//   (weight scale × activation scale) and accumulated in f32.
// * mm_exp_*: the same product for expert stacks (IQ2_XXS, Q2_K, Q4_K, Q8_0) over a
//   device-built route plan: a block takes 128 rows of one expert and up to 32 (_w: 64)
//   of its (token, expert) pairs, so each expert's weights are streamed once per 32 (64)
//   pairs.
//   The quantised weights are decoded in registers straight into the A fragments.
//   K-quant minimums use a second mma whose A operand is the sub-block minimum
//   broadcast over its values (Σ m·x exactly in int32).
// * mm_f32_*: f32 activations × F32/F16/BF16/Q8_0 weights, SIMT tiles, f32 accumulation
//   per 32-wide k-tile, then across tiles (no tensor cores: keeps f32 numerics).
// * route_plan_build: per-expert pair lists and the work items of the expert GEMM.
//
// Fragment layouts of mma.m16n8k32 (s8), g = lane / 4, t = lane % 4:
//   A (16×32, row major): a0 = row g, k 4t..4t+3; a1 = row g+8, same k; a2 = row g,
//   k 16+4t..; a3 = row g+8, k 16+4t..
//   B (32×8, stored as [n][k]): b0 = column g, k 4t..4t+3; b1 = column g, k 16+4t..
//   C (16×8): c0 = (g, 2t), c1 = (g, 2t+1), c2 = (g+8, 2t), c3 = (g+8, 2t+1).
// int32 → f32 without I2F: the accumulator starts at the bit pattern of 1.5·2^23, so the
// result read as a float is 1.5·2^23 + sum exactly for |sum| < 2^22 (every sum here is
// ≤ 32·128·128 = 2^19) and one FADD recovers the sum.
#include "common.cuh"

#define MM_MAGIC 0x4B400000
#define MM_MAGIC_F 12582912.0f

__device__ __forceinline__ float mm_f(int c) { return __int_as_float(c) - MM_MAGIC_F; }

__device__ __forceinline__ u32 mm_smem(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// cp.async with zero fill when !ok (the source is then not read).
__device__ __forceinline__ void mm_cp16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void mm_cp8(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src),
                 "r"(ok ? 8 : 0));
}
__device__ __forceinline__ void mm_cp4(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
                 "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void mm_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void mm_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

__device__ __forceinline__ void mm_ldsm4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c = MAGIC + A·B (int8, exact).
__device__ __forceinline__ void mm_mma(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                       u32 b1) {
    c[0] = c[1] = c[2] = c[3] = MM_MAGIC;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------------
// Dense Q8_0 × int8: block tile BM rows × BN tokens, k-tiles of 128 (4 blocks of 32),
// 8 warps as 4 (rows) × 2 (tokens), double-buffered cp.async. Shared memory per stage:
// A quants [BM][144] (16 bytes of padding: ldmatrix rows land on distinct banks), B quants
// [BN][144], A scales [BM][4] f16, B scales [4][BN] f32.
// Grid: x = token tiles (fastest: blocks sharing a weight tile run together), y = row
// tiles, z = groups.

#define MM_BK 128
#define MM_PITCH 144

template <int BM, int BN>
__device__ __forceinline__ void mm_q8_0_body(const i8* __restrict__ qs, const u16* __restrict__ dw,
                                             i64 mat_q, i64 mat_d, const i8* __restrict__ xq,
                                             const float* __restrict__ xd, float* __restrict__ y,
                                             int rows, int cols, int n_tok, i64 x_tok, i64 x_grp,
                                             i64 y_tok, i64 y_grp) {
    constexpr int WM = BM / 4, WN = BN / 2, MT = WM / 16, NT = WN / 8;
    constexpr int B_OFF = BM * MM_PITCH, SA_OFF = B_OFF + BN * MM_PITCH;
    constexpr int SB_OFF = SA_OFF + BM * 8, STAGE = SB_OFF + 4 * BN * 4;
    static_assert(NT % 2 == 0, "B fragments are loaded two n-tiles at a time");
    extern __shared__ __align__(16) u8 smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3, wn = warp >> 2, gq = lane >> 2, tq = lane & 3;
    const int grp = blockIdx.z;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    qs += grp * mat_q;
    dw += grp * mat_d;
    xq += grp * x_grp;
    xd += grp * (x_grp / 32);
    y += grp * y_grp;
    const int nb32 = cols / 32;
    const int nkt = (cols + MM_BK - 1) / MM_BK;
    const bool fast_scales = (cols % MM_BK) == 0;
    const u32 smem_s = mm_smem(smem);

    // A thread's loads of a k-tile: quant rows lr + 32j of A and B (16 bytes at column lc),
    // the scales of B's token sb_r. Their addresses and row checks are fixed over the k
    // loop, so they are set up once: recomputed for every load (with a branch around
    // each address) they were ~1,000 instructions of the loop's load code, as many as its
    // mma and scaling. The same bytes land in the same places.
    constexpr int A_IT = BM / 32, B_IT = BN / 32, SB_IT = BN / 64;
    static_assert(256 % BN == 0 && BM <= 256, "the scale loads' thread mapping");
    const int lr = tid >> 3, lc = 16 * (tid & 7);
    bool a_ok[A_IT], b_ok[B_IT];
#pragma unroll
    for (int j = 0; j < A_IT; ++j) a_ok[j] = m0 + lr + 32 * j < rows;
#pragma unroll
    for (int j = 0; j < B_IT; ++j) b_ok[j] = n0 + lr + 32 * j < n_tok;
    const i64 a_off = (i64)(m0 + lr) * cols + lc, b_off = (i64)(n0 + lr) * x_tok + lc;
    const u32 ab_dst = (u32)(lr * MM_PITCH + lc);
    const int sb_r = tid % BN;
    const bool sb_ok = n0 + sb_r < n_tok;
    const i64 sb_off = (i64)(n0 + sb_r) * (x_tok / 32);

    auto load = [&](int kt, int s) {
        const u32 st = smem_s + s * STAGE;
        const int k0 = kt * MM_BK;
        const bool kc_ok = k0 + lc < cols;
#pragma unroll
        for (int j = 0; j < A_IT; ++j) {
            const bool ok = a_ok[j] && kc_ok;
            mm_cp16(st + ab_dst + j * 32 * MM_PITCH, ok ? qs + a_off + (i64)j * 32 * cols + k0 : qs,
                    ok);
        }
#pragma unroll
        for (int j = 0; j < B_IT; ++j) {
            const bool ok = b_ok[j] && kc_ok;
            mm_cp16(st + B_OFF + ab_dst + j * 32 * MM_PITCH,
                    ok ? xq + b_off + (i64)j * 32 * x_tok + k0 : xq, ok);
        }
        if (fast_scales) {
            for (int r = tid; r < BM; r += 256) {
                const int row = m0 + r;
                const bool ok = row < rows;
                mm_cp8(st + SA_OFF + r * 8, ok ? dw + (i64)row * nb32 + k0 / 32 : dw, ok);
            }
        } else {
            u16* sa = reinterpret_cast<u16*>(smem + s * STAGE + SA_OFF);
            for (int i = tid; i < BM * 4; i += 256) {
                const int r = i >> 2, j = i & 3, row = m0 + r, kb = k0 / 32 + j;
                sa[i] = (row < rows && kb < nb32) ? dw[(i64)row * nb32 + kb] : (u16)0;
            }
        }
#pragma unroll
        for (int j = 0; j < SB_IT; ++j) {
            const int i = tid + 256 * j, kb = k0 / 32 + i / BN;
            const bool ok = sb_ok && kb < nb32;
            mm_cp4(st + SB_OFF + i * 4, ok ? xd + sb_off + kb : xd, ok);
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.f;

    load(0, 0);
    mm_commit();
    for (int kt = 0; kt < nkt; ++kt) {
        if (kt + 1 < nkt) load(kt + 1, (kt + 1) & 1);
        mm_commit();
        mm_wait1();
        __syncthreads();
        const int s = kt & 1;
        const u32 st = smem_s + s * STAGE;
        const u16* sa = reinterpret_cast<const u16*>(smem + s * STAGE + SA_OFF);
        const float* sb = reinterpret_cast<const float*>(smem + s * STAGE + SB_OFF);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            u32 a[MT][4], b[NT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = wm * WM + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                mm_ldsm4(st + r * MM_PITCH + ks * 32 + (lane >> 4) * 16, a[mt][0], a[mt][1],
                         a[mt][2], a[mt][3]);
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                const int r = wn * WN + np * 16 + (lane & 7) + (lane >> 4) * 8;
                mm_ldsm4(st + B_OFF + r * MM_PITCH + ks * 32 + ((lane >> 3) & 1) * 16,
                         b[2 * np][0], b[2 * np][1], b[2 * np + 1][0], b[2 * np + 1][1]);
            }
            float wa[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = wm * WM + mt * 16 + gq;
                wa[mt][0] = h2f(sa[r * 4 + ks]);
                wa[mt][1] = h2f(sa[(r + 8) * 4 + ks]);
            }
            float2 xb[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                xb[nt] = *reinterpret_cast<const float2*>(sb + ks * BN + wn * WN + nt * 8 + 2 * tq);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    int c[4];
                    mm_mma(c, a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[nt][0], b[nt][1]);
                    acc[mt][nt][0] += mm_f(c[0]) * (wa[mt][0] * xb[nt].x);
                    acc[mt][nt][1] += mm_f(c[1]) * (wa[mt][0] * xb[nt].y);
                    acc[mt][nt][2] += mm_f(c[2]) * (wa[mt][1] * xb[nt].x);
                    acc[mt][nt][3] += mm_f(c[3]) * (wa[mt][1] * xb[nt].y);
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int r = m0 + wm * WM + mt * 16 + gq;
            const int t = n0 + wn * WN + nt * 8 + 2 * tq;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int rr = r + (i >> 1) * 8, tt = t + (i & 1);
                if (rr < rows && tt < n_tok) y[(i64)tt * y_tok + rr] = acc[mt][nt][i];
            }
        }
}

// BOUNDS: the launch bounds. The 128×128 tile at one block an SM (185 registers, 8 warps)
// waited on its barriers and loads with nothing else to issue; at two (128 registers, a
// few spills) a 2,048-token prefill's 128×128 products took 572 µs instead of 602 (H200),
// 551 with the load addresses set up once. The 128×64 tile: with those loads plain (256)
// gave it 141 registers (one block an SM, 143 µs), (256, 2) 128 (132 µs; with the old
// loads two blocks had lost, 138 → 143). Never (256, 1): ptxas then took 217 registers
// where plain (256) took 104.
#define MM_Q8_0_KERNEL(BM, BN, BOUNDS)                                                          \
    extern "C" __global__ void __launch_bounds__ BOUNDS mm_q8_0_##BM##x##BN(                   \
        const i8* __restrict__ qs, const u16* __restrict__ dw, i64 mat_q, i64 mat_d,            \
        const i8* __restrict__ xq, const float* __restrict__ xd, float* __restrict__ y,         \
        int rows, int cols, int n_tok, i64 x_tok, i64 x_grp, i64 y_tok, i64 y_grp) { PDL_WAIT();            \
        mm_q8_0_body<BM, BN>(qs, dw, mat_q, mat_d, xq, xd, y, rows, cols, n_tok, x_tok, x_grp,  \
                             y_tok, y_grp);                                                     \
    }
MM_Q8_0_KERNEL(128, 128, (256, 2))
MM_Q8_0_KERNEL(128, 64, (256, 2))
MM_Q8_0_KERNEL(64, 64, (256))

// ---------------------------------------------------------------------------------------
// Expert (and dense non-Q8_0) GEMM: block = 4 warps, 128 rows (32 per warp: two m-tiles)
// × up to 32 pairs (four n-tiles, empty ones skipped), or (_w) 8 warps of 16 rows × up to
// 64 pairs; k-stages of one 256 super-block.
// Shared memory per stage: the raw weight blocks of the 128 rows (row pitches padded so
// the fragment loads hit distinct banks), then the activations [32][XP] int8 and their
// scales [8][32] f32.
//
// k order: for IQ2_XXS, Q2_K and Q4_K the 32 values of a k-step are permuted (the same
// permutation for A and B leaves the product unchanged): lane t of a quad owns values
// 8t..8t+7, a0/a1 = values 8t..8t+3 and a2/a3 = 8t+4..8t+7. A lane then decodes one whole
// IQ2 grid entry (or 8 consecutive 2-/4-bit quants of one sub-block) and reads its
// activations with one 8-byte load. Q8_0 keeps the natural order (ldmatrix).
//
// Fast stages: when every pair's activation scale is the same over the stage's 256 values
// (the Q8_K rule; checked per stage by a warp vote) the int32 products of the 8 k-steps
// are summed exactly in int32 (Q2_K: in the mma accumulator; IQ2_XXS/Q4_K: × the
// integer sub-block scale 2·ls+1 / sc), and the float scales are applied once per stage.

#define EXP_F_Q8_0 0
#define EXP_F_IQ2 1
#define EXP_F_Q2K 2
#define EXP_F_Q4K 3
template <int F>
__host__ __device__ constexpr bool exp_iq2() { return F == EXP_F_IQ2; }

template <int F>
__host__ __device__ constexpr int exp_xpitch() { return F == EXP_F_Q8_0 ? 272 : 288; }
// The warp tile: NT n-tiles of 8 pairs × 8 / NT m-tiles of 16 rows, so every warp holds
// 32 accumulators a lane. NT = 4: 4 warps of 32 rows × 32 pairs (mm_exp_*_b2/_b3/_b4);
// NT = 8: 8 warps of 16 rows × 64 pairs (mm_exp_*_w), which decode each weight tile once
// per 64 pairs instead of per 32: an expert with 33..64 pairs of a prefill chunk (2,048
// tokens give each of 256 experts ~48) is one work item, not two. A block is 128 rows
// either way.
template <int NT>
__host__ __device__ constexpr int exp_mt() { return 8 / NT; }
template <int NT>
__host__ __device__ constexpr int exp_pairs() { return 8 * NT; }
template <int NT>
__host__ __device__ constexpr int exp_threads() { return 32 * 128 / (16 * exp_mt<NT>()); }
// IQ2_XXS grid table copies (exp_decode): 16 (32 KB) in the 64-pair kernels, whose two
// blocks an SM have the room; one (2 KB) in the 32-pair kernels, which would lose blocks.
template <int NT>
__host__ __device__ constexpr int exp_grid_copies() { return NT == 8 ? 16 : 1; }
template <int F, int NT>
__host__ __device__ constexpr int exp_x_bytes() {
    return exp_pairs<NT>() * exp_xpitch<F>() + 8 * exp_pairs<NT>() * 4;
}
// Weight row pitch in the stage (quant bytes).
template <int F>
__host__ __device__ constexpr int exp_wpitch() {
    return F == EXP_F_Q8_0 ? 272 : F == EXP_F_Q4K ? 160 : 96;
}
template <int F>
__host__ __device__ constexpr int exp_w_bytes() {
    return F == EXP_F_Q8_0 ? 128 * 272 + 128 * 16
         : F == EXP_F_IQ2  ? 128 * 96 + 128 * 4
         : F == EXP_F_Q2K  ? 128 * 96 + 128 * 16 + 128 * 4
                           : 128 * 160;
}

// Q4_K sub-block scale and min j (0..7) from the 12 scale bytes in words w0..w2.
__device__ __forceinline__ u32 mm_q4k_byte(int i, u32 w0, u32 w1, u32 w2) {
    const u32 w = i < 4 ? w0 : (i < 8 ? w1 : w2);
    return (w >> (8 * (i & 3))) & 0xff;
}
__device__ __forceinline__ void mm_q4k_sm(int j, u32 w0, u32 w1, u32 w2, u32& sc, u32& mn) {
    if (j < 4) {
        sc = mm_q4k_byte(j, w0, w1, w2) & 63;
        mn = mm_q4k_byte(j + 4, w0, w1, w2) & 63;
    } else {
        const u32 hi = mm_q4k_byte(j + 4, w0, w1, w2);
        sc = (hi & 0xF) | ((mm_q4k_byte(j - 4, w0, w1, w2) >> 6) << 4);
        mn = (hi >> 4) | ((mm_q4k_byte(j, w0, w1, w2) >> 6) << 4);
    }
}

// c = A·B (exact int32); the accumulating form adds to c.
__device__ __forceinline__ void mm_mma0(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}
__device__ __forceinline__ void mm_mma_acc(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The decoded m-tile of one k-step: A fragment, minimum fragment (K-quants), per lane
// row (g, g+8): float scales s1/s2 of a per-k-step product, integer sub-block factor fi
// (fast stages: IQ2 2·ls+1, Q4_K sc; 1 otherwise).
struct ExpTile {
    u32 a[4], am[4];
    float s1[2], s2[2];
    int fi[2];
};

// Decodes k-step j of the m-tile whose lane rows are r and r + 8 (tile-local). COPIES:
// the IQ2_XXS grid table's interleaved copies in shared memory (entry e of copy c at
// e·COPIES + c; lane l reads copy l mod COPIES). With 16, each half-warp of an 8-byte
// load reads 16 distinct bank pairs: no conflicts, where one copy's random entries cost
// a few wavefronts a load (Nsight Compute: the 32-pair kernel is bound by the L1/shared
// pipe at 77%, not by its ALU work).
template <int F, int COPIES>
__device__ __forceinline__ void exp_decode(const u8* wst, u32 wst_s, const u64* grid64, int r,
                                           int j, int lane, ExpTile& o) {
    constexpr int WP = exp_wpitch<F>();
    const int tq = lane & 3;
    if (F == EXP_F_Q8_0) {
        const int rr = (r - (lane >> 2)) + (lane & 7) + ((lane >> 3) & 1) * 8;
        mm_ldsm4(wst_s + rr * WP + 32 * j + (lane >> 4) * 16, o.a[0], o.a[1], o.a[2], o.a[3]);
        const u16* d = reinterpret_cast<const u16*>(wst + 128 * WP);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) o.s1[hh] = h2f(d[(r + 8 * hh) * 8 + j]);
    } else if (exp_iq2<F>()) {
        const float* d = reinterpret_cast<const float*>(wst + 128 * WP);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = r + 8 * hh;
            const uint2 v = *reinterpret_cast<const uint2*>(wst + row * WP + 8 * j);
            const u64 gv = grid64[((v.x >> (8 * tq)) & 255) * COPIES + (lane & (COPIES - 1))];
            u32 s = (v.y >> (7 * tq)) & 127;
            s |= (__popc(s) & 1) << 7;
            const u32 bl = ((s & 15) * 0x204081u) & 0x01010101u;
            const u32 bh = ((s >> 4) * 0x204081u) & 0x01010101u;
            // Grid bytes are 8, 25 or 43: (g ^ 0xff) + 1 = -g per byte, no carries.
            o.a[hh] = ((u32)gv ^ (bl * 255u)) + bl;
            o.a[hh + 2] = ((u32)(gv >> 32) ^ (bh * 255u)) + bh;
            const u32 ls = v.y >> 28;
            o.fi[hh] = 2 * (int)ls + 1;
            o.s1[hh] = d[row] * (0.5f + (float)ls) * 0.25f;
        }
    } else if (F == EXP_F_Q2K) {
        const u8* sc = wst + 128 * WP;
        const u32* dm = reinterpret_cast<const u32*>(wst + 128 * WP + 128 * 16);
        const int kk = j >> 2, jj = j & 3;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = r + 8 * hh;
            const uint2 w = *reinterpret_cast<const uint2*>(wst + row * WP + 32 * kk + 8 * tq);
            const u32 s = sc[row * 16 + 8 * kk + 2 * jj + (tq >> 1)];
            o.a[hh] = ((w.x >> (2 * jj)) & 0x03030303u) * (s & 15);
            o.a[hh + 2] = ((w.y >> (2 * jj)) & 0x03030303u) * (s & 15);
            o.am[hh] = o.am[hh + 2] = (s >> 4) * 0x01010101u;
            const u32 dmv = dm[row];
            o.s1[hh] = h2f((u16)(dmv & 0xffff));
            o.s2[hh] = h2f((u16)(dmv >> 16));
            o.fi[hh] = 1;
        }
    } else {
        const int c = j >> 1, sh = 4 * (j & 1);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const u8* blk = wst + (r + 8 * hh) * WP;
            const uint4 hdr = *reinterpret_cast<const uint4*>(blk);
            const uint2 w = *reinterpret_cast<const uint2*>(blk + 16 + 32 * c + 8 * tq);
            o.a[hh] = (w.x >> sh) & 0x0f0f0f0fu;
            o.a[hh + 2] = (w.y >> sh) & 0x0f0f0f0fu;
            u32 scv, mn;
            mm_q4k_sm(j, hdr.y, hdr.z, hdr.w, scv, mn);
            o.am[hh] = o.am[hh + 2] = mn * 0x01010101u;
            o.fi[hh] = (int)scv;
            o.s1[hh] = h2f((u16)(hdr.x & 0xffff)) * (float)scv;
            o.s2[hh] = h2f((u16)(hdr.x >> 16));
        }
    }
}

// Per-row scales of a fast stage (applied to the int32 sums of the whole stage).
template <int F>
__device__ __forceinline__ void exp_stage_scales(const u8* wst, int row, float& d1, float& d2) {
    constexpr int WP = exp_wpitch<F>();
    if (exp_iq2<F>()) {
        d1 = reinterpret_cast<const float*>(wst + 128 * WP)[row] * 0.125f;
        d2 = 0.f;
    } else if (F == EXP_F_Q2K) {
        const u32 dmv = reinterpret_cast<const u32*>(wst + 128 * WP + 128 * 16)[row];
        d1 = h2f((u16)(dmv & 0xffff));
        d2 = h2f((u16)(dmv >> 16));
    } else {
        const u32 h = *reinterpret_cast<const u32*>(wst + row * WP);
        d1 = h2f((u16)(h & 0xffff));
        d2 = h2f((u16)(h >> 16));
    }
}

// One stage (256 values) of a warp's 16·MT rows × nnt n-tiles.
template <int F, bool FAST, int NT>
__device__ __forceinline__ void exp_stage(const u8* wst, u32 wst_s, const u8* xst, u32 xst_s,
                                          const u64* grid64, int lane, int warp, int nnt,
                                          float (&acc)[exp_mt<NT>()][NT][4]) {
    constexpr int XP = exp_xpitch<F>(), MT = exp_mt<NT>(), PAIRS = exp_pairs<NT>();
    constexpr bool KQ = F == EXP_F_Q2K || F == EXP_F_Q4K;
    const int gq = lane >> 2, tq = lane & 3;
    const float* xds = reinterpret_cast<const float*>(xst + PAIRS * XP);
    int ci[MT][NT][4], cm[MT][NT][4];
    if (FAST) {
#pragma unroll
        for (int a = 0; a < MT; ++a)
#pragma unroll
            for (int b = 0; b < NT; ++b)
#pragma unroll
                for (int i = 0; i < 4; ++i) ci[a][b][i] = cm[a][b][i] = 0;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        u32 bf[NT][2];
        if (F == EXP_F_Q8_0) {
            const int r = (lane & 7) + (lane >> 4) * 8;
            const u32 off = 32 * j + ((lane >> 3) & 1) * 16;
            // Two n-tiles per ldmatrix.x4 (16 pair rows). Every n-tile is loaded: the
            // stage's rows past the item's pairs are zero-filled (cp.async), and only
            // the products below skip them — predicated loads cost a zeroing CS2R each
            // and predicate registers the k loop then spilled (P2R).
#pragma unroll
            for (int h = 0; h < NT / 2; ++h)
                mm_ldsm4(xst_s + (r + 16 * h) * XP + off, bf[2 * h][0], bf[2 * h][1],
                         bf[2 * h + 1][0], bf[2 * h + 1][1]);
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint2 v =
                    *reinterpret_cast<const uint2*>(xst + (nt * 8 + gq) * XP + 32 * j + 8 * tq);
                bf[nt][0] = v.x;
                bf[nt][1] = v.y;
            }
        }
        float2 xv[NT];
        if (!FAST) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                xv[nt] = *reinterpret_cast<const float2*>(xds + j * PAIRS + nt * 8 + 2 * tq);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            ExpTile t;
            exp_decode<F, exp_grid_copies<NT>()>(wst, wst_s, grid64, warp * 16 * MT + mt * 16 + gq,
                                                 j, lane, t);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                if (nt >= nnt) continue;
                if (FAST) {
                    if (F == EXP_F_Q2K) {
                        mm_mma_acc(ci[mt][nt], t.a, bf[nt][0], bf[nt][1]);
                    } else {
                        int c[4];
                        mm_mma0(c, t.a, bf[nt][0], bf[nt][1]);
#pragma unroll
                        for (int i = 0; i < 4; ++i) ci[mt][nt][i] += c[i] * t.fi[i >> 1];
                    }
                    if (KQ) mm_mma_acc(cm[mt][nt], t.am, bf[nt][0], bf[nt][1]);
                } else {
                    int c[4];
                    mm_mma(c, t.a[0], t.a[1], t.a[2], t.a[3], bf[nt][0], bf[nt][1]);
                    if (KQ) {
                        int c2[4];
                        mm_mma(c2, t.am[0], t.am[1], t.am[2], t.am[3], bf[nt][0], bf[nt][1]);
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const float x = (i & 1) ? xv[nt].y : xv[nt].x;
                            acc[mt][nt][i] += x * (t.s1[i >> 1] * mm_f(c[i]) - t.s2[i >> 1] * mm_f(c2[i]));
                        }
                    } else {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const float x = (i & 1) ? xv[nt].y : xv[nt].x;
                            acc[mt][nt][i] += mm_f(c[i]) * (t.s1[i >> 1] * x);
                        }
                    }
                }
            }
        }
    }
    if (FAST) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float d1[2], d2[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
                exp_stage_scales<F>(wst, warp * 16 * MT + mt * 16 + gq + 8 * hh, d1[hh], d2[hh]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                if (nt >= nnt) continue;
                const float2 xu = *reinterpret_cast<const float2*>(xds + nt * 8 + 2 * tq);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float x = (i & 1) ? xu.y : xu.x;
                    float v = d1[i >> 1] * (float)ci[mt][nt][i];
                    if (KQ) v -= d2[i >> 1] * (float)cm[mt][nt][i];
                    acc[mt][nt][i] += x * v;
                }
            }
        }
    }
}

// Plan mode (items != null): block y = work item {expert, first pair, pairs}, block z =
// which PAIRS-slice of it (a plan of 64-pair items run by the 32-pair kernels: z = 0, 1);
// pair p reads input row p / k_div (x_tok int8 per row) and writes y[p·y_tok + row].
// Dense mode: block y = tokens PAIRS·y.., block z = group (matrix z), token t reads
// xq[t·x_tok + z·x_grp] and writes y[t·y_tok + z·y_grp + row].
template <int F, int NT>
__device__ __forceinline__ void mm_exp_body(
    const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2, i64 mat0,
    i64 mat1, i64 mat2, const u64* __restrict__ grid_g, const i8* __restrict__ xq,
    const float* __restrict__ xd, float* __restrict__ y, int rows, int cols,
    const int4* __restrict__ items, const i32* __restrict__ n_items, const i32* __restrict__ pairs,
    int k_div, int n_tok, i64 x_tok, i64 x_grp, i64 y_tok, i64 y_grp) {
    constexpr int WB = exp_w_bytes<F>(), WP = exp_wpitch<F>(), XP = exp_xpitch<F>();
    constexpr int STAGE = WB + exp_x_bytes<F, NT>();
    constexpr int MT = exp_mt<NT>(), PAIRS = exp_pairs<NT>(), THREADS = exp_threads<NT>();
    extern __shared__ __align__(16) u8 smem[];
    __shared__ i64 s_xoff[PAIRS], s_yoff[PAIRS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    int e, len;
    if (items) {
        if ((int)blockIdx.y >= *n_items) return;
        const int4 it = items[blockIdx.y];
        const int first = it.y + PAIRS * (int)blockIdx.z;
        e = it.x;
        len = min(PAIRS, it.z - PAIRS * (int)blockIdx.z);
        if (len <= 0) return;
        if (tid < PAIRS) {
            i64 xo = -1, yo = -1;
            if (tid < len) {
                const int p = pairs[first + tid];
                xo = (i64)(p / k_div) * x_tok;
                yo = (i64)p * y_tok;
            }
            s_xoff[tid] = xo;
            s_yoff[tid] = yo;
        }
    } else {
        e = blockIdx.z;
        const int t0 = blockIdx.y * PAIRS;
        len = min(PAIRS, n_tok - t0);
        if (tid < PAIRS) {
            const bool ok = tid < len;
            s_xoff[tid] = ok ? (i64)(t0 + tid) * x_tok + e * x_grp : -1;
            s_yoff[tid] = ok ? (i64)(t0 + tid) * y_tok + e * y_grp : -1;
        }
    }
    u64* grid64 = reinterpret_cast<u64*>(smem + 2 * STAGE);
    if (exp_iq2<F>())
        for (int i = tid; i < 256 * exp_grid_copies<NT>(); i += THREADS)
            grid64[i] = grid_g[i / exp_grid_copies<NT>()];
    __syncthreads();

    const int row0 = blockIdx.x * 128;
    const int nb = cols / 256;
    w0 += e * mat0;
    w1 += e * mat1;
    w2 += e * mat2;
    const u32 smem_s = mm_smem(smem);
    // The row whose per-row scales this thread fetches (threads 0..127).
    const int my_row = row0 + tid;
    const bool scales = THREADS == 128 || tid < 128;

    // Stage s ← super-block b. IQ2_XXS scales are 2-byte values: fetched into `dnext` by
    // a plain load and stored after the compute of the current stage.
    auto load = [&](int b, int s, u16& dnext) {
        const u32 st = smem_s + s * STAGE;
        if (F == EXP_F_Q8_0) {
#pragma unroll
            for (int u = 0; u < 2048 / THREADS; ++u) {
                const int i = tid + THREADS * u, r = i >> 4, c = i & 15;
                const bool ok = row0 + r < rows;
                mm_cp16(st + r * WP + 16 * c, ok ? w0 + (i64)(row0 + r) * cols + b * 256 + 16 * c : w0, ok);
            }
            if (scales) {
                const bool ok = my_row < rows;
                mm_cp16(st + 128 * WP + tid * 16, ok ? w1 + ((i64)my_row * (cols / 32) + b * 8) * 2 : w1, ok);
            }
        } else if (F == EXP_F_Q4K) {
#pragma unroll
            for (int u = 0; u < (1152 + THREADS - 1) / THREADS; ++u) {
                const int i = tid + THREADS * u, r = i / 9, c = i % 9;
                if (1152 % THREADS != 0 && i >= 1152) break;
                const bool ok = row0 + r < rows;
                mm_cp16(st + r * WP + 16 * c, ok ? w0 + ((i64)(row0 + r) * nb + b) * 144 + 16 * c : w0, ok);
            }
        } else {
#pragma unroll
            for (int u = 0; u < 512 / THREADS; ++u) {
                const int i = tid + THREADS * u, r = i >> 2, c = i & 3;
                const bool ok = row0 + r < rows;
                mm_cp16(st + r * WP + 16 * c, ok ? w0 + ((i64)(row0 + r) * nb + b) * 64 + 16 * c : w0, ok);
            }
            if (scales) {
                const bool ok = my_row < rows;
                const i64 blk = (i64)my_row * nb + b;
                if (exp_iq2<F>()) {
                    dnext = ok ? reinterpret_cast<const u16*>(w1)[blk] : (u16)0;
                } else {
                    mm_cp16(st + 128 * WP + tid * 16, ok ? w1 + blk * 16 : w1, ok);
                    mm_cp4(st + 128 * WP + 128 * 16 + tid * 4, ok ? w2 + blk * 4 : w2, ok);
                }
            }
        }
        const u32 xs = st + WB;
#pragma unroll
        for (int u = 0; u < PAIRS * 16 / THREADS; ++u) {
            const int i = tid + THREADS * u, pr = i >> 4, c = i & 15;
            const i64 xo = s_xoff[pr];
            mm_cp16(xs + pr * XP + 16 * c, xo >= 0 ? xq + xo + b * 256 + 16 * c : xq, xo >= 0);
        }
#pragma unroll
        for (int u = 0; u < 8 * PAIRS / THREADS; ++u) {
            const int i = tid + THREADS * u, j = i / PAIRS, pr = i % PAIRS;
            const i64 xo = s_xoff[pr];
            mm_cp4(xs + PAIRS * XP + i * 4, xo >= 0 ? xd + (xo >> 5) + b * 8 + j : xd, xo >= 0);
        }
    };
    auto store_d = [&](int s, u16 d) {
        if (exp_iq2<F>() && scales)
            reinterpret_cast<float*>(smem + s * STAGE + 128 * WP)[tid] = h2f(d);
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.f;
    const int nnt = (len + 7) >> 3;

    u16 dn = 0;
    load(0, 0, dn);
    store_d(0, dn);
    mm_commit();
    for (int b = 0; b < nb; ++b) {
        if (b + 1 < nb) load(b + 1, (b + 1) & 1, dn);
        mm_commit();
        mm_wait1();
        __syncthreads();
        const int s = b & 1;
        const u8* wst = smem + s * STAGE;
        const u32 wst_s = smem_s + s * STAGE;
        if (F == EXP_F_Q8_0) {
            exp_stage<F, false, NT>(wst, wst_s, wst + WB, wst_s + WB, grid64, lane, warp, nnt, acc);
        } else {
            // Fast stage when every pair slot has one activation scale over the stage.
            const float* xds = reinterpret_cast<const float*>(wst + WB + PAIRS * XP);
            bool same = true;
#pragma unroll
            for (int h = 0; h < PAIRS / 32; ++h) {
                const float x0 = xds[32 * h + lane];
#pragma unroll
                for (int j = 1; j < 8; ++j) same &= xds[j * PAIRS + 32 * h + lane] == x0;
            }
            if (__all_sync(0xffffffffu, same))
                exp_stage<F, true, NT>(wst, wst_s, wst + WB, wst_s + WB, grid64, lane, warp, nnt, acc);
            else
                exp_stage<F, false, NT>(wst, wst_s, wst + WB, wst_s + WB, grid64, lane, warp, nnt, acc);
        }
        if (b + 1 < nb) store_d((b + 1) & 1, dn);
        __syncthreads();
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if (nt >= nnt) continue;
            const int r = row0 + warp * 16 * MT + mt * 16 + gq;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int rr = r + (i >> 1) * 8, n = nt * 8 + 2 * tq + (i & 1);
                if (rr < rows && n < len) y[s_yoff[n] + rr] = acc[mt][nt][i];
            }
        }
}

// Each format in three occupancy targets of the 32-pair tile (minimum blocks per SM 2, 3,
// 4: the register cap trades spills against warps in flight) and the 64-pair tile (_w);
// the launcher picks one.
#define MM_EXP_KERNEL(NAME, F, NT, BOUNDS)                                                      \
    extern "C" __global__ void __launch_bounds__ BOUNDS NAME(                                  \
        const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,        \
        i64 mat0, i64 mat1, i64 mat2, const u64* __restrict__ grid_g, const i8* __restrict__ xq, \
        const float* __restrict__ xd, float* __restrict__ y, int rows, int cols,                \
        const int4* __restrict__ items, const i32* __restrict__ n_items,                        \
        const i32* __restrict__ pairs, int k_div, int n_tok, i64 x_tok, i64 x_grp, i64 y_tok,   \
        i64 y_grp) { PDL_WAIT();                                                                            \
        mm_exp_body<F, NT>(w0, w1, w2, mat0, mat1, mat2, grid_g, xq, xd, y, rows, cols, items,  \
                       n_items, pairs, k_div, n_tok, x_tok, x_grp, y_tok, y_grp);               \
    }
// mm_exp_<fmt>_b2, _b3, _b4 and _w of one format; WMB: the 64-pair tile's minimum blocks
// an SM. Two (128 registers) for IQ2_XXS (28 bytes spilled), Q2_K (24) and Q8_0 (none);
// Q4_K needs its 32-pair tile's ~255 registers (872 bytes spilled at two), so one.
#define MM_EXP_KERNELS(FMT, F, WMB)                      \
    MM_EXP_KERNEL(mm_exp_##FMT##_b2, F, 4, (128, 2))     \
    MM_EXP_KERNEL(mm_exp_##FMT##_b3, F, 4, (128, 3))     \
    MM_EXP_KERNEL(mm_exp_##FMT##_b4, F, 4, (128, 4))     \
    MM_EXP_KERNEL(mm_exp_##FMT##_w, F, 8, (256, WMB))
MM_EXP_KERNELS(q8_0, EXP_F_Q8_0, 2)
MM_EXP_KERNELS(iq2_xxs, EXP_F_IQ2, 2)
MM_EXP_KERNELS(q2_k, EXP_F_Q2K, 2)
MM_EXP_KERNELS(q4_k, EXP_F_Q4K, 1)

// Inclusive prefix sums of two values across a warp at once.
__device__ __forceinline__ void warp_scan2(int& a, int& b, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int va = __shfl_up_sync(0xffffffffu, a, o);
        const int vb = __shfl_up_sync(0xffffffffu, b, o);
        if (lane >= o) {
            a += va;
            b += vb;
        }
    }
}

// ---------------------------------------------------------------------------------------
// Route plan: one block of 1024 threads. offsets[e] = first slot of expert e in `pairs`
// (offsets[n_expert] = valid pairs), pairs[] = pair indices grouped by expert (order
// within an expert unspecified: every output column is computed independently, so the
// results do not depend on it), items[i] = {expert, first slot, count ≤ tile, 0}.
// Pairs with an id outside [0, n_expert) are dropped.
extern "C" __global__ void __launch_bounds__(1024) route_plan_build(
    const i32* __restrict__ ids, int n_pairs, int n_expert, int tile, i32* __restrict__ offsets,
    i32* __restrict__ pairs, int4* __restrict__ items, i32* __restrict__ n_items) {
    PDL_WAIT();
    __shared__ int cnt[1024], cur[1024];
    __shared__ int wsum[2][32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    cnt[tid] = 0;
    __syncthreads();
    for (int p = tid; p < n_pairs; p += 1024) {
        const int e = ids[p];
        if (e >= 0 && e < n_expert) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    const int c = tid < n_expert ? cnt[tid] : 0;
    const int nt = (c + tile - 1) / tile;
    // Block-wide exclusive scans of c and nt.
    int ic = c, in = nt;
    warp_scan2(ic, in, lane);
    if (lane == 31) {
        wsum[0][warp] = ic;
        wsum[1][warp] = in;
    }
    __syncthreads();
    if (warp == 0) {
        int vc = wsum[0][lane], vn = wsum[1][lane];
        warp_scan2(vc, vn, lane);
        wsum[0][lane] = vc;  // inclusive per warp
        wsum[1][lane] = vn;
    }
    __syncthreads();
    const int off = ic - c + (warp ? wsum[0][warp - 1] : 0);
    const int toff = in - nt + (warp ? wsum[1][warp - 1] : 0);
    if (tid < n_expert) {
        offsets[tid] = off;
        cur[tid] = off;
        for (int j = 0; j < nt; ++j)
            items[toff + j] = make_int4(tid, off + j * tile, min(tile, c - j * tile), 0);
    }
    if (tid == 0) {
        offsets[n_expert] = wsum[0][31];
        *n_items = wsum[1][31];
    }
    __syncthreads();
    for (int p = tid; p < n_pairs; p += 1024) {
        const int e = ids[p];
        if (e >= 0 && e < n_expert) pairs[atomicAdd(&cur[e], 1)] = p;
    }
}
