// Decode matrix-vector products, y = W·x with f32 activations, for every weight format.
// Memory-bound: each lane streams 16-byte chunks of one row; x comes from L1/L2.
// Weight layouts are the repacked ones of src/weights.rs (scales split from quants so
// that quant loads are 16-byte aligned); Q4_K and F16/F32 keep the GGUF layout.
#include "common.cuh"

// Q8_0: qs [rows][cols] int8, d [rows][cols/32] f16.
extern "C" __global__ void __launch_bounds__(256) matvec_q8_0(
    const i8* __restrict__ qs, const u16* __restrict__ d, i64 mat_q, i64 mat_d,
    const float* __restrict__ x, float* __restrict__ y, int rows, int cols, MatSel sel) {
    PDL_WAIT();
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    if (row >= rows) return;
    const int m = sel_matrix(sel);
    x += blockIdx.y * sel.x_stride;
    const i8* q = qs + m * mat_q + (i64)row * cols;
    const u16* dr = d + m * mat_d + (i64)row * (cols / 32);
    float acc = 0.f;
#pragma unroll 4
    for (int c = threadIdx.x * 16; c < cols; c += WARP * 16) {
        const W4 w = ld16(q + c);
        const float s = h2f(dr[c >> 5]);
        float4 x0 = ldx4(x + c), x1 = ldx4(x + c + 4), x2 = ldx4(x + c + 8), x3 = ldx4(x + c + 12);
        acc += s * (dot4_i8(w.a, x0) + dot4_i8(w.b, x1) + dot4_i8(w.c, x2) + dot4_i8(w.d, x3));
    }
    acc = warp_sum(acc);
    if (threadIdx.x == 0) y[blockIdx.y * sel.y_stride + row] = acc;
}

__device__ __forceinline__ float dot2_h(u32 h, float a, float b) {
    return h2f((u16)(h & 0xffff)) * a + h2f((u16)(h >> 16)) * b;
}

// 8 f16 weights (16 bytes) · 8 f32 activations at x.
// dot8_h with the 8 activations already loaded.
__device__ __forceinline__ float dot8_h_x(const uint4 v, const float4 x0, const float4 x1) {
    return dot2_h(v.x, x0.x, x0.y) + dot2_h(v.y, x0.z, x0.w) + dot2_h(v.z, x1.x, x1.y) +
           dot2_h(v.w, x1.z, x1.w);
}
__device__ __forceinline__ float dot8_h(const uint4 v, const float* x) {
    return dot8_h_x(v, ldx4(x), ldx4(x + 4));
}

// F16: [rows][cols] f16 (GGUF layout). EARLY (matvec_f16_early): a lane's first
// F16_EARLY_STEPS 16-byte weight loads are issued before griddepcontrol.wait, as in
// matvec_q8_0_q8_early (the caller guarantees sel.ids is not written in the graph); the
// same sums in the same order, so bit-identical.
#define F16_EARLY_STEPS 4
template <bool EARLY>
__device__ __forceinline__ void matvec_f16_body(const u16* __restrict__ w, i64 mat_w,
                                                const float* __restrict__ x,
                                                float* __restrict__ y, int rows, int cols,
                                                MatSel sel, int ks) {
    if (!EARLY) PDL_WAIT();
    // `ks` warps share a row (split K) so short matrices still fill the GPU.
    __shared__ float red[ROWS_PER_BLOCK];
    const int row = blockIdx.x * (blockDim.y / ks) + threadIdx.y / ks;
    const int split = threadIdx.y % ks;
    const int m = sel_matrix(sel);
    x += blockIdx.y * sel.x_stride;
    float acc = 0.f;
    // A row past the last addresses the last (only the early loads read it).
    const u16* r = w + m * mat_w + (i64)(row < rows ? row : rows - 1) * cols;
    const bool vec8 = (cols & 7) == 0;
    const int c0 = (split * WARP + threadIdx.x) * 8, cstep = ks * WARP * 8;
    int c = c0;
    if (EARLY && vec8) {
        // Unconditional loads (a step past the row reads the row's first 8): ptxas
        // moved griddepcontrol.wait above loads that sat in branches, so they no longer
        // overlapped the previous kernel.
        uint4 wv[F16_EARLY_STEPS];
#pragma unroll
        for (int u = 0; u < F16_EARLY_STEPS; ++u)
            wv[u] = ld_early16(r + (c0 + u * cstep < cols ? c0 + u * cstep : 0));
        PDL_WAIT_AFTER_LOADS(rows < 0);
        if (row < rows) {
            // Every prefetched step's activations first, then the products in step
            // order; a step past the row is computed on the row's first 8 and not added.
            // (With a branch a step the compiler moved each step's loads behind the
            // previous step's products.)
            float4 xa[F16_EARLY_STEPS], xb[F16_EARLY_STEPS];
#pragma unroll
            for (int u = 0; u < F16_EARLY_STEPS; ++u) {
                const int cu = c0 + u * cstep < cols ? c0 + u * cstep : 0;
                xa[u] = ldx4(x + cu);
                xb[u] = ldx4(x + cu + 4);
            }
#pragma unroll
            for (int u = 0; u < F16_EARLY_STEPS; ++u) {
                const float v = dot8_h_x(wv[u], xa[u], xb[u]);
                if (c0 + u * cstep < cols) acc += v;
            }
        }
        c = c0 + F16_EARLY_STEPS * cstep;
    } else if (EARLY) {
        PDL_WAIT();
    }
    if (row < rows) {
        if (vec8) {
#pragma unroll 4
            for (; c < cols; c += cstep) {
                acc += dot8_h(__ldg(reinterpret_cast<const uint4*>(r + c)), x + c);
            }
        } else {
            for (int cc = split * WARP + threadIdx.x; cc < cols; cc += ks * WARP)
                acc += h2f(r[cc]) * x[cc];
        }
    }
    PDL_TRIGGER();
    store_split_row(acc, ks, split, row < rows, y, blockIdx.y * sel.y_stride + row, red);
}

#define MATVEC_F16_PARAMS                                                                      \
    const u16 *__restrict__ w, i64 mat_w, const float *__restrict__ x, float *__restrict__ y, \
        int rows, int cols, MatSel sel, int ks
#define MATVEC_F16_ARGS w, mat_w, x, y, rows, cols, sel, ks
KERNEL_PAIR(__launch_bounds__(256), matvec_f16, matvec_f16_early, matvec_f16_body,
            MATVEC_F16_PARAMS, MATVEC_F16_ARGS)

// F32: [rows][cols] f32.
extern "C" __global__ void __launch_bounds__(256) matvec_f32(
    const float* __restrict__ w, i64 mat_w, const float* __restrict__ x, float* __restrict__ y,
    int rows, int cols, MatSel sel) {
    PDL_WAIT();
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    if (row >= rows) return;
    const int m = sel_matrix(sel);
    x += blockIdx.y * sel.x_stride;
    const float* r = w + m * mat_w + (i64)row * cols;
    float acc = 0.f;
    if ((cols & 3) == 0) {
        for (int c = threadIdx.x * 4; c < cols; c += WARP * 4) {
            const float4 v = *reinterpret_cast<const float4*>(r + c);
            const float4 xv = ldx4(x + c);
            acc += v.x * xv.x + v.y * xv.y + v.z * xv.z + v.w * xv.w;
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += WARP) acc += r[c] * x[c];
    }
    acc = warp_sum(acc);
    if (threadIdx.x == 0) y[blockIdx.y * sel.y_stride + row] = acc;
}

// IQ2_XXS: qs [rows][cols/256][64 bytes], d [rows][cols/256] f16. A lane takes 16 bytes
// (two groups of 32 values). The 2 KB grid is staged in shared memory: lanes index it
// divergently, which constant memory would serialise.
extern "C" __global__ void __launch_bounds__(256) matvec_iq2_xxs(
    const u8* __restrict__ qs, const u16* __restrict__ d, i64 mat_q, i64 mat_d,
    const u64* __restrict__ grid_g, const float* __restrict__ x, float* __restrict__ y,
    int rows, int cols, MatSel sel) {
    PDL_WAIT();
    __shared__ u64 grid[256];
    const int tid = threadIdx.y * WARP + threadIdx.x;
    for (int i = tid; i < 256; i += WARP * ROWS_PER_BLOCK) grid[i] = grid_g[i];
    __syncthreads();
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    if (row >= rows) return;
    const int m = sel_matrix(sel);
    x += blockIdx.y * sel.x_stride;
    const int nb = cols / 256;
    const u8* q = qs + m * mat_q + (i64)row * nb * 64;
    const u16* dr = d + m * mat_d + (i64)row * nb;
    float acc = 0.f;
    for (int c = threadIdx.x; c < nb * 4; c += WARP) {
        const int b = c >> 2;
        const W4 w = ld16(q + (i64)c * 16);
        const float db = h2f(dr[b]) * 0.25f;
        const float* xb = x + b * 256 + (c & 3) * 64;
        const u32 words[4] = {w.a, w.b, w.c, w.d};
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            const u32 idx = words[2 * g], sg = words[2 * g + 1];
            const float scale = db * (0.5f + (float)(sg >> 28));
            float s = 0.f;
#pragma unroll
            for (int l = 0; l < 4; ++l) {
                const u64 gv = grid[(idx >> (8 * l)) & 0xff];
                u32 signs = (sg >> (7 * l)) & 127;
                signs |= (__popc(signs) & 1) << 7;
                const float* xx = xb + g * 32 + l * 8;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float v = (float)((gv >> (8 * j)) & 0xff);
                    s += ((signs >> j) & 1) ? -v * xx[j] : v * xx[j];
                }
            }
            acc += scale * s;
        }
    }
    acc = warp_sum(acc);
    if (threadIdx.x == 0) y[blockIdx.y * sel.y_stride + row] = acc;
}

// Q2_K: qs [rows][nb][64], sc [rows][nb][16], dm [rows][nb] (f16 d, f16 dmin). A lane
// takes 16 quant bytes: half h of chunk k covers elements 128k + 32j + 16h + l.
extern "C" __global__ void __launch_bounds__(256) matvec_q2_k(
    const u8* __restrict__ qs, const u8* __restrict__ sc, const u32* __restrict__ dm,
    i64 mat_blocks, const float* __restrict__ x, float* __restrict__ y, int rows, int cols,
    MatSel sel) {
    PDL_WAIT();
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    if (row >= rows) return;
    const int m = sel_matrix(sel);
    x += blockIdx.y * sel.x_stride;
    const int nb = cols / 256;
    const i64 b0 = m * mat_blocks + (i64)row * nb;
    float acc = 0.f;
    for (int c = threadIdx.x; c < nb * 4; c += WARP) {
        const int b = c >> 2, k = (c >> 1) & 1, h = c & 1;
        const W4 w = ld16(qs + (b0 + b) * 64 + k * 32 + h * 16);
        const u32 words[4] = {w.a, w.b, w.c, w.d};
        const u32 dmv = dm[b0 + b];
        const float dd = h2f((u16)(dmv & 0xffff)), dmin = h2f((u16)(dmv >> 16));
        const u8* scb = sc + (b0 + b) * 16;
        const float* xb = x + b * 256 + 128 * k + 16 * h;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u8 s = scb[8 * k + 2 * j + h];
            float sq = 0.f, sx = 0.f;
#pragma unroll
            for (int l = 0; l < 16; ++l) {
                const u32 byte = (words[l >> 2] >> (8 * (l & 3))) & 0xff;
                const float xv = xb[32 * j + l];
                sq += (float)((byte >> (2 * j)) & 3) * xv;
                sx += xv;
            }
            acc += dd * (float)(s & 15) * sq - dmin * (float)(s >> 4) * sx;
        }
    }
    acc = warp_sum(acc);
    if (threadIdx.x == 0) y[blockIdx.y * sel.y_stride + row] = acc;
}

// Byte i (0..11) of the Q4_K scale words without indexing a register array at run
// time (which would spill it to local memory).
__device__ __forceinline__ u32 q4k_byte(int i, u32 w0, u32 w1, u32 w2) {
    const u32 w = i < 4 ? w0 : (i < 8 ? w1 : w2);
    return (w >> (8 * (i & 3))) & 0xff;
}

__device__ __forceinline__ void q4k_scale_min(int j, u32 w0, u32 w1, u32 w2, float& sc, float& mn) {
    if (j < 4) {
        sc = (float)(q4k_byte(j, w0, w1, w2) & 63);
        mn = (float)(q4k_byte(j + 4, w0, w1, w2) & 63);
    } else {
        const u32 hi = q4k_byte(j + 4, w0, w1, w2);
        sc = (float)((hi & 0xF) | ((q4k_byte(j - 4, w0, w1, w2) >> 6) << 4));
        mn = (float)((hi >> 4) | ((q4k_byte(j, w0, w1, w2) >> 6) << 4));
    }
}

// Q4_K in the GGUF layout (144-byte blocks are 16-byte aligned): a lane takes 16 quant
// bytes of chunk c, half h: elements 64c + 16h + l (low nibbles) and 64c + 32 + 16h + l.
extern "C" __global__ void __launch_bounds__(256) matvec_q4_k(
    const u8* __restrict__ w, i64 mat_blocks, const float* __restrict__ x,
    float* __restrict__ y, int rows, int cols, MatSel sel) {
    PDL_WAIT();
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    if (row >= rows) return;
    const int m = sel_matrix(sel);
    x += blockIdx.y * sel.x_stride;
    const int nb = cols / 256;
    const u8* base = w + (m * mat_blocks + (i64)row * nb) * 144;
    float acc = 0.f;
    for (int c = threadIdx.x; c < nb * 8; c += WARP) {
        const int b = c >> 3, ch = (c >> 1) & 3, h = c & 1;
        const u8* blk = base + (i64)b * 144;
        const W4 hdr = ld16(blk);
        const W4 q = ld16(blk + 16 + ch * 32 + h * 16);
        const u32 words[4] = {q.a, q.b, q.c, q.d};
        const float dd = h2f((u16)(hdr.a & 0xffff)), dmin = h2f((u16)(hdr.a >> 16));
        float sc1, m1, sc2, m2;
        q4k_scale_min(2 * ch, hdr.b, hdr.c, hdr.d, sc1, m1);
        q4k_scale_min(2 * ch + 1, hdr.b, hdr.c, hdr.d, sc2, m2);
        const float* xl = x + b * 256 + 64 * ch + 16 * h;
        float ql = 0.f, qh = 0.f, xsl = 0.f, xsh = 0.f;
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const u32 byte = (words[l >> 2] >> (8 * (l & 3))) & 0xff;
            const float a = xl[l], bb = xl[32 + l];
            ql += (float)(byte & 15) * a;
            qh += (float)(byte >> 4) * bb;
            xsl += a;
            xsh += bb;
        }
        acc += dd * (sc1 * ql + sc2 * qh) - dmin * (m1 * xsl + m2 * xsh);
    }
    acc = warp_sum(acc);
    if (threadIdx.x == 0) y[blockIdx.y * sel.y_stride + row] = acc;
}

// T tokens of a plain F16 matrix in one pass over its weights (a multi-row decode step;
// see matvec_q8_0_q8_tok_body): `ks` warps a row as the one-token kernel picks, per
// (row, token) the same 8-wide steps in the same order and the same reduction, so the
// same sums. Rows of a multiple of 8 columns.
template <int T>
__device__ __forceinline__ void matvec_f16_tok_body(const u16* __restrict__ w,
                                                    const float* __restrict__ x,
                                                    float* __restrict__ y, int rows, int cols,
                                                    MatSel sel, int ks, int n_tok) {
    __shared__ float red[T][ROWS_PER_BLOCK];
    const int row = blockIdx.x * (blockDim.y / ks) + threadIdx.y / ks;
    const int split = threadIdx.y % ks;
    // A row past the last addresses the last (only the early loads read it).
    const u16* r = w + (i64)(row < rows ? row : rows - 1) * cols;
    const int c0 = (split * WARP + threadIdx.x) * 8, cstep = ks * WARP * 8;
    float acc[T];
#pragma unroll
    for (int t = 0; t < T; ++t) acc[t] = 0.f;
    // The first steps' weights before the PDL wait, as matvec_f16_early (unconditional
    // loads: a step past the row reads its first 8).
    uint4 wv[F16_EARLY_STEPS];
#pragma unroll
    for (int u = 0; u < F16_EARLY_STEPS; ++u)
        wv[u] = ld_early16(r + (c0 + u * cstep < cols ? c0 + u * cstep : 0));
    PDL_WAIT_AFTER_LOADS(rows < 0);
    // The step's activations of every token are loaded together, ahead of its products
    // (tokens past n_tok read the first; their sums are not stored): with a branch a
    // token each token's loads followed the previous token's products, T L1 round trips
    // one after another a step.
    constexpr int TC = T < 4 ? T : 4;  // tokens whose activations are held at once
    auto dot = [&](const uint4 wq, int c) {
#pragma unroll
        for (int t0 = 0; t0 < T; t0 += TC) {
            float4 xa[TC], xb[TC];
#pragma unroll
            for (int k = 0; k < TC; ++k) {
                if (t0 + k >= T) continue;  // T = 5: compile-time dead slots
                const float* xp = x + (t0 + k < n_tok ? t0 + k : 0) * sel.x_stride + c;
                xa[k] = ldx4(xp);
                xb[k] = ldx4(xp + 4);
            }
#pragma unroll
            for (int k = 0; k < TC; ++k)
                if (t0 + k < T) acc[t0 + k] += dot8_h_x(wq, xa[k], xb[k]);
        }
    };
    if (row < rows) {
#pragma unroll
        for (int u = 0; u < F16_EARLY_STEPS; ++u) {
            const int c = c0 + u * cstep;
            if (c < cols) dot(wv[u], c);
        }
        for (int c = c0 + F16_EARLY_STEPS * cstep; c < cols; c += cstep)
            dot(__ldg(reinterpret_cast<const uint4*>(r + c)), c);
    }
    PDL_TRIGGER();
    // One transposed reduction, padded with zeros to a power of two for T = 3.
    constexpr int TP = pow2_ceil_ct(T);
    float v[TP];
#pragma unroll
    for (int t = 0; t < TP; ++t) v[t] = t < T ? acc[t] : 0.f;
    int first;
    warp_sums<TP>(v, first);  // v[0] is token first's sum: warp_sum's bits
    if (warp_sums_writer<TP>() && first < T) {
        if (ks == 1) {
            if (first < n_tok && row < rows) y[first * sel.y_stride + row] = v[0];
        } else {
            red[first][threadIdx.y] = v[0];
        }
    }
    if (ks > 1) {
        __syncthreads();
        if (threadIdx.x == 0 && split == 0 && row < rows) {
            for (int t = 0; t < n_tok; ++t) {
                float s = 0.f;
                for (int i = 0; i < ks; ++i) s += red[t][threadIdx.y + i];
                y[t * sel.y_stride + row] = s;
            }
        }
    }
}

#define F16_TOK_KERNEL(T)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) matvec_f16_t##T(                   \
        const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,    \
        int rows, int cols, MatSel sel, int ks, int n_tok) {                              \
        matvec_f16_tok_body<T>(w, x, y, rows, cols, sel, ks, n_tok);                      \
    }
F16_TOK_KERNEL(2)
F16_TOK_KERNEL(3)
F16_TOK_KERNEL(4)
F16_TOK_KERNEL(5)
F16_TOK_KERNEL(8)
F16_TOK_KERNEL(16)
