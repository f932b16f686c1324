// Prefill products on fp16 tensor cores: Q8_0 weights (variant `q8_f16`) and F16 weights
// (variant `f16_split`).
//
// Why Q8_0: the int8 form (mm_q8_0_*, matmul.cu) scales every mma.m16n8k32's int32 result
// by its two per-32 block scales in f32 — three FP instructions per accumulator per 32
// values, which issue-bound it near a quarter of the tensor rate. Here the weights are
// expanded once per call to fp16 (q·d rounded once: q·d is exact in f32, 8 + 11 bits)
// and the int8 activations to fp16 (q·d/s_t with s_t a power of two per token, so the
// largest block lands in [127, 254) far from fp16's range), and one f32-accumulating
// mma.m16n8k16 per 16 values needs no epilogue at all: y = s_t · Σ w16·x16. Each product
// term is the int8 path's with two fp16 roundings (relative ≤ 2^-11 each), far below the
// Q8_0 activation quantisation both paths share.
//
// Why F16: the tf32 kernels (mm_tc_*, matmul_f32.cu) keep f32-grade products by two tf32
// mma per product on a 64×64 tile. F16 weights are exact in fp16, and an f32 activation
// is x·2^-e = hi + lo with hi, lo fp16 (22 bits, the tf32 split's precision; e puts the
// token's largest value in [2^14, 2^15), so lo stays normal down to 2^-24 of it). The
// token's fp16 row is [hi | lo] (2·cols values) and the GEMM runs over k < 2·cols with
// the weight's column k mod cols: the same kernel, twice the k.
//
// Layout (the same Batch as matmul_q8act): y[t·y_tok + g·y_grp + r] for weight rows r of
// matrix g, tokens t; W16 [groups][rows][a_cols], X16 [n_tok][x_tok] (matrix g reads
// columns g·x_grp..).

#include "common.cuh"

// Eight int8 values (q, little-endian) times d, each rounded once to fp16, packed in order.
__device__ __forceinline__ uint4 q8x8_to_f16(uint2 q, float d) {
    u32 o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 w = j < 2 ? q.x : q.y;
        const int sh = (j & 1) * 16;
        const float lo = (float)(i8)((w >> sh) & 0xff) * d;
        const float hi = (float)(i8)((w >> (sh + 8)) & 0xff) * d;
        o[j] = (u32)f2h(lo) | ((u32)f2h(hi) << 16);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// Weights: n_vals Q8_0 values (qs int8, one f16 scale per 32) to fp16, 8 a thread.
extern "C" __global__ void q8_0_to_f16(const i8* __restrict__ qs, const u16* __restrict__ dw,
                                       u16* __restrict__ out, i64 n_vals) {
    const i64 n8 = n_vals / 8;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n8;
         i += (i64)gridDim.x * blockDim.x) {
        const uint2 q = *reinterpret_cast<const uint2*>(qs + i * 8);
        *reinterpret_cast<uint4*>(out + i * 8) = q8x8_to_f16(q, h2f(dw[i / 4]));
    }
}

// The power of two s with s ≤ m < 2s (m > 0 and normal), else 1.
__device__ __forceinline__ float pow2_floor(float m) {
    const u32 e = __float_as_uint(m) & 0x7f800000u;
    return e == 0 || e == 0x7f800000u ? 1.0f : __uint_as_float(e);
}

// Token t's `cols` int8 values (one f32 scale per 32) to fp16 q·(d/s_t), with s_t =
// pow2_floor(the token's largest scale) into tscale[t]; PERM writes each 32-span in the
// expert GEMM's fragment order (matmul_f16_exp.cu), else in order. A block a token.
template <bool PERM>
__device__ __forceinline__ void q8act_to_f16_row(const i8* __restrict__ q,
                                                 const float* __restrict__ d,
                                                 u16* __restrict__ out,
                                                 float* __restrict__ tscale, int cols) {
    const i64 t = blockIdx.x;
    const int nb = cols / 32;
    const float* dt = d + t * nb;
    float m = 0.0f;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) m = fmaxf(m, fabsf(dt[b]));
    __shared__ float red[32];
    m = block_max(m, red);
    const float s = pow2_floor(m);
    const float inv = 1.0f / s;  // exact: a power of two
    if (threadIdx.x == 0) tscale[t] = s;
    const i8* qt = q + t * cols;
    u16* ot = out + t * cols;
    for (int i = threadIdx.x; i < cols / 8; i += blockDim.x) {
        const uint2 v = *reinterpret_cast<const uint2*>(qt + i * 8);
        const uint4 h = q8x8_to_f16(v, dt[i / 4] * inv);
        if (PERM) {
            // Values 8c..8c+7 of 32-block i/4 (c = i mod 4): pair p (values 8c+2p, +1)
            // to u32 c + 4p of the block.
            u32* ob = reinterpret_cast<u32*>(ot) + (i / 4) * 16 + (i & 3);
            ob[0] = h.x;
            ob[4] = h.y;
            ob[8] = h.z;
            ob[12] = h.w;
        } else {
            *reinterpret_cast<uint4*>(ot + i * 8) = h;
        }
    }
}

// Activations of the fp16 GEMM, in order.
extern "C" __global__ void __launch_bounds__(256) q8act_to_f16(const i8* __restrict__ q,
                                                               const float* __restrict__ d,
                                                               u16* __restrict__ out,
                                                               float* __restrict__ tscale,
                                                               int cols) {
    q8act_to_f16_row<false>(q, d, out, tscale, cols);
}

// F16 products' activations: token t's `cols` f32 values (x_tok apart) to fp16
// [hi | lo] (2·cols values) of x/s_t, s_t = 2^-14 · pow2_floor(the token's largest |x|)
// into tscale[t]. A block a token.
extern "C" __global__ void __launch_bounds__(256) f32_to_f16x2(const float* __restrict__ x,
                                                               i64 x_tok,
                                                               u16* __restrict__ out,
                                                               float* __restrict__ tscale,
                                                               int cols) {
    const i64 t = blockIdx.x;
    const float* xt = x + t * x_tok;
    float m = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, fabsf(xt[i]));
    __shared__ float red[32];
    m = block_max(m, red);
    // s = 2^-14 · pow2_floor(max), so max/s is in [2^14, 2^15); 1 where the row is zero,
    // not finite, or below 2^-112 (whose fp16 values would be zero anyway; 1/s must not
    // overflow). Powers of two: x/s is exact.
    const u32 e = __float_as_uint(m) & 0x7f800000u;
    const float s = e < (15u << 23) || e == 0x7f800000u ? 1.0f : __uint_as_float(e - (14u << 23));
    const float inv = 1.0f / s;
    if (threadIdx.x == 0) tscale[t] = s;
    u16* ot = out + t * 2 * (i64)cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = xt[i] * inv;
        const u16 hi = f2h(v);
        ot[i] = hi;
        ot[cols + i] = f2h(v - h2f(hi));
    }
}

// Block tile: 128 weight rows × 128 tokens, k-tiles of 64 in MF_STAGES cp.async stages;
// 8 warps as 2 (rows) × 4 (tokens), each 64 rows × 32 tokens (4 × 4 mma tiles, 64
// accumulators a lane). Rows of a stage are MF_PITCH halves apart (144 bytes: the 8 rows
// an ldmatrix reads land on distinct banks).
#define MF_BM 128
#define MF_BN 128
#define MF_BK 64
#define MF_PITCH 72
#define MF_STAGES 3
#define MF_STAGE_HALVES ((MF_BM + MF_BN) * MF_PITCH)

// Requires rows % 128 == 0, a_cols % 64 == 0 and cols = a_cols (Q8_0) or 2·a_cols (F16:
// [hi | lo]) (the launcher checks); tokens ≥ n_tok are zero-filled and not stored.
extern "C" __global__ void __launch_bounds__(256, 2)
    mm_f16_128x128(const u16* __restrict__ w16, const u16* __restrict__ x16,
                   const float* __restrict__ tscale, float* __restrict__ y, int rows, int cols,
                   int a_cols, int n_tok, i64 x_tok, i64 y_tok, i64 x_grp, i64 y_grp) {
    extern __shared__ __align__(16) u16 mf_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;  // 2 × 4 warps
    const int tok0 = blockIdx.x * MF_BN, row0 = blockIdx.y * MF_BM, grp = blockIdx.z;
    const u16* wg = w16 + ((i64)grp * rows + row0) * a_cols;
    const u16* xg = x16 + (i64)grp * x_grp;

    // This thread's cp.async sources: rows lr + 32j (j < 4) at 16-byte column lc, for A
    // (weights) and B (tokens); set up once.
    const int lr = tid >> 3, lc = (tid & 7) * 8;
    const u16* asrc = wg + (i64)lr * a_cols + lc;
    const u16* bsrc[4];
    bool bok[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int t = tok0 + lr + 32 * j;
        bok[j] = t < n_tok;
        bsrc[j] = xg + (i64)(bok[j] ? t : 0) * x_tok + lc;
    }
    const u32 sbase = mm_smem(mf_smem);
    const u32 sdst = (u32)((lr * MF_PITCH + lc) * 2);
    auto load = [&](int stage, int kt) {
        const u32 st = sbase + (u32)(stage * MF_STAGE_HALVES * 2);
        const i64 k = (i64)kt * MF_BK;
        // The weight column: k, or k − a_cols in an F16 product's lo half.
        const i64 ka = k < a_cols ? k : k - a_cols;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            mm_cp16(st + sdst + (u32)(32 * j * MF_PITCH * 2), asrc + (i64)32 * j * a_cols + ka,
                    true);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            mm_cp16(st + (u32)(MF_BM * MF_PITCH * 2) + sdst + (u32)(32 * j * MF_PITCH * 2),
                    bsrc[j] + k, bok[j]);
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

    const int nk = cols / MF_BK;
#pragma unroll
    for (int s = 0; s < MF_STAGES - 1; ++s) {
        if (s < nk) load(s, s);
        mm_commit();
    }
    // ldmatrix lane offsets: A x4 = rows (lane & 15), k 8·(lane >> 4); B x4 = two 8-token
    // n-tiles: token (lane & 7) + 8·(lane >> 4), k 8·((lane >> 3) & 1).
    const u32 a_off = (u32)(((wm * 64 + (lane & 15)) * MF_PITCH + (lane >> 4) * 8) * 2);
    const u32 b_off = (u32)((MF_BM * MF_PITCH +
                             (wn * 32 + (lane & 7) + ((lane >> 4) << 3)) * MF_PITCH +
                             ((lane >> 3) & 1) * 8) *
                            2);
    for (int kt = 0; kt < nk; ++kt) {
        asm volatile("cp.async.wait_group %0;" ::"n"(MF_STAGES - 2) : "memory");
        __syncthreads();
        {
            const int nt = kt + MF_STAGES - 1;
            if (nt < nk) load(nt % MF_STAGES, nt);
            mm_commit();
        }
        const u32 st = sbase + (u32)((kt % MF_STAGES) * MF_STAGE_HALVES * 2);
#pragma unroll
        for (int kk = 0; kk < MF_BK / 16; ++kk) {
            u32 a[4][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                mm_ldsm4(st + a_off + (u32)((i * 16 * MF_PITCH + kk * 16) * 2), a[i][0], a[i][1],
                         a[i][2], a[i][3]);
#pragma unroll
            for (int j = 0; j < 2; ++j)
                mm_ldsm4(st + b_off + (u32)((j * 16 * MF_PITCH + kk * 16) * 2), b[2 * j][0],
                         b[2 * j][1], b[2 * j + 1][0], b[2 * j + 1][1]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    mma_f16_f32(acc[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b[j][0], b[j][1]);
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");

    // c0/c1 = (row g, tokens 2t, 2t+1), c2/c3 = (row g + 8, same tokens).
    const int g = lane >> 2, t4 = lane & 3;
    float* yg = y + (i64)grp * y_grp;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = tok0 + wn * 32 + j * 8 + 2 * t4 + h;
            if (t >= n_tok) continue;
            const float s = tscale[t];
            float* yt = yg + (i64)t * y_tok + row0 + wm * 64 + g;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                yt[i * 16] = acc[i][j][h] * s;
                yt[i * 16 + 8] = acc[i][j][2 + h] * s;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The same product on Hopper's warpgroup MMA (variant `f16_wgmma`; sm_90a only: the
// compute_90 PTX of the fatbin and NVRTC builds trap, and the launcher takes it only
// from the fatbin on a 9.0 GPU). Block = 2 warpgroups, tile 128 rows × 128 tokens; each
// warpgroup runs wgmma.m64n128k16 over its 64 rows, reading both operands from shared
// memory (no ldmatrix: the register traffic that bounds mm_f16_128x128). Stages hold a
// k-tile of 64 values as 128-byte rows in the 128-byte swizzle (16-byte chunk c of row r
// at c ^ (r mod 8)), which the descriptors name (SBO = 8 rows = 1,024 bytes); a k16 step
// advances the descriptors' start by 32 bytes.
#define MW_STAGES 3
#define MW_TILE_BYTES (128 * 128)
#define MW_STAGE_BYTES (2 * MW_TILE_BYTES)

__device__ __forceinline__ u64 mw_desc(u32 saddr) {
    return (u64)((saddr & 0x3ffff) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}

__device__ __forceinline__ void mw_mma(float (&d)[64], u64 da, u64 db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, 0, 0;"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db));
#else
    __trap();
#endif
}

__device__ __forceinline__ void mw_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void mw_commit_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}

extern "C" __global__ void __launch_bounds__(256, 2)
    mm_f16_wg_128x128(const u16* __restrict__ w16, const u16* __restrict__ x16,
                      const float* __restrict__ tscale, float* __restrict__ y, int rows, int cols,
                      int a_cols, int n_tok, i64 x_tok, i64 y_tok, i64 x_grp, i64 y_grp) {
    extern __shared__ __align__(16) u8 mw_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, w4 = warp & 3;
    const int tok0 = blockIdx.x * MF_BN, row0 = blockIdx.y * MF_BM, grp = blockIdx.z;
    const u16* wg_ = w16 + ((i64)grp * rows + row0) * a_cols;
    const u16* xg = x16 + (i64)grp * x_grp;
    // cp.async: rows lr + 32j (j < 4), 16-byte chunk lc8 of the 128-byte k-row, stored
    // at its swizzled place (lr + 32j ≡ lr mod 8).
    const int lr = tid >> 3, lc8 = tid & 7;
    const u16* asrc = wg_ + (i64)lr * a_cols + lc8 * 8;
    const u16* bsrc[4];
    bool bok[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int t = tok0 + lr + 32 * j;
        bok[j] = t < n_tok;
        bsrc[j] = xg + (i64)(bok[j] ? t : 0) * x_tok + lc8 * 8;
    }
    // The swizzle is a function of the address: the stages start at a 1,024-byte
    // boundary (the launcher asks for 1 KB more than the stages).
    const u32 sbase = (mm_smem(mw_smem) + 1023u) & ~1023u;
    const u32 sdst = (u32)(lr * 128 + ((lc8 ^ (lr & 7)) << 4));
    auto load = [&](int stage, int kt) {
        const u32 st = sbase + (u32)(stage * MW_STAGE_BYTES);
        const i64 k = (i64)kt * MF_BK;
        const i64 ka = k < a_cols ? k : k - a_cols;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            mm_cp16(st + sdst + (u32)(j * 32 * 128), asrc + (i64)32 * j * a_cols + ka, true);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            mm_cp16(st + MW_TILE_BYTES + sdst + (u32)(j * 32 * 128), bsrc[j] + k, bok[j]);
    };

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    const int nk = cols / MF_BK;
#pragma unroll
    for (int s = 0; s < MW_STAGES - 1; ++s) {
        if (s < nk) load(s, s);
        mm_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        asm volatile("cp.async.wait_group %0;" ::"n"(MW_STAGES - 2) : "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        {
            const int nt = kt + MW_STAGES - 1;
            if (nt < nk) load(nt % MW_STAGES, nt);
            mm_commit();
        }
        const u32 st = sbase + (u32)((kt % MW_STAGES) * MW_STAGE_BYTES);
        const u32 a0 = st + (u32)(wg * 64 * 128), b0 = st + MW_TILE_BYTES;
        mw_fence();
#pragma unroll
        for (int kk = 0; kk < MF_BK / 16; ++kk)
            mw_mma(d, mw_desc(a0 + kk * 32), mw_desc(b0 + kk * 32));
        mw_commit_wait();
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");

    // d[4j + 0/1] = (row g, tokens 8j + 2t, +1), d[4j + 2/3] = (row g + 8, same tokens) of
    // the warp's 16 rows.
    const int g = lane >> 2, t4 = lane & 3;
    float* yg = y + (i64)grp * y_grp;
    const int r = row0 + wg * 64 + w4 * 16 + g;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int t = tok0 + 8 * j + 2 * t4 + h;
            if (t >= n_tok) continue;
            const float s = tscale[t];
            float* yt = yg + (i64)t * y_tok + r;
            yt[0] = d[4 * j + h] * s;
            yt[8] = d[4 * j + 2 + h] * s;
        }
    }
}
