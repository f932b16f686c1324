// Expert matvecs against int8 activations: x is quantised once per 32 values
// (d = amax/127 in f32, q = rint(x/d), exactly ds4's Q8_0 activation rule), staged in
// shared memory, and products use dp4a. 2-bit weights expand to 4 products per byte, so
// f32 activations made these kernels instruction-bound (see NOTES.md).
#include "common.cuh"

// x [n_rows][n] f32 → q [n_rows][n] int8 and d [n_rows][n/32] f32. One warp per 32
// values: lane i quantises value i of its block.
extern "C" __global__ void quantize_q8_32(const float* __restrict__ x, i8* __restrict__ q,
                                          float* __restrict__ d, int n_blocks) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const int b = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (b >= n_blocks) return;
    const int lane = threadIdx.x % WARP;
    quant_block32(x[(i64)b * 32 + lane], q + (i64)b * 32, d + b);
}

// Stages one activation row (cols int8 + cols/32 scales) into shared memory.
__device__ __forceinline__ void stage_x(i8* sq, float* sd, const i8* q, const float* d, int cols) {
    const int tid = threadIdx.y * WARP + threadIdx.x;
    const int nthreads = WARP * blockDim.y;
    for (int i = tid * 16; i < cols; i += nthreads * 16)
        *reinterpret_cast<uint4*>(sq + i) = *reinterpret_cast<const uint4*>(q + i);
    for (int i = tid; i < cols / 32; i += nthreads) sd[i] = d[i];
    __syncthreads();
}

// Rows per warp of the expert kernels: a block stages the activation row (and the
// IQ2 tables) once for 8 × EXP_ROWS_PER_WARP rows. The IQ2_XXS kernel walks a warp's
// rows side by side (row r at threadIdx.y + 8r) and loads the next step's weights
// before computing the current one, so each lane keeps 2 × EXP_ROWS_PER_WARP 16-byte
// loads in flight, the first step's issued before the shared-memory staging (H200,
// 6-expert gate: 17.5 -> 16.4 µs; the rest is shared-memory grid lookups).
// (EXP_ROWS_PER_WARP: ds4_consts.h.)


// IQ2_XXS grid values are 8, 25 or 43 and sign bits flip them: a grid entry becomes 8
// nibble codes (0, 1, 2 = 8, 25, 43) and a sign pattern 8 nibble masks (4 = negative),
// so one byte permute per 4 weights picks the signed int8 values out of two constant
// words (+8 +25 +43 | −8 −25 −43). Tables in shared memory: 256 codes, 128 sign masks.
#define IQ2_LUT_POS 0x002b1908u
#define IQ2_LUT_NEG 0x00d5e7f8u

// Table entry e (every table layout: iq2_tables here, iq2_tables32 / iq2_tables64 in
// matvec_q8act_iq2rx.cu): e < 256 the grid point's 8 values (8, 25, 43) as 0, 1, 2 in
// the low bits of their nibbles; else sign pattern e − 256 with its 8th sign (making the
// count even) as bit 2 of each nibble.
__device__ __forceinline__ u32 iq2_table_entry(int e, const u64* grid_g) {
    u32 v = 0;
    if (e < 256) {
        const u64 g = grid_g[e];
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            const u32 q = (u32)(g >> (8 * b)) & 0xff;
            v |= (q == 8 ? 0u : (q == 25 ? 1u : 2u)) << (4 * b);
        }
    } else {
        u32 s7 = e - 256;
        s7 |= (__popc(s7) & 1) << 7;
#pragma unroll
        for (int b = 0; b < 8; ++b) v |= ((s7 >> b) & 1u) << (4 * b + 2);
    }
    return v;
}
// Fills the code and sign-mask tables (any block shape).
__device__ __forceinline__ void iq2_tables(u32* codes, u32* signs, const u64* grid_g) {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    for (int i = tid; i < 384; i += blockDim.x * blockDim.y) {
        if (i < 256)
            codes[i] = iq2_table_entry(i, grid_g);
        else
            signs[i - 256] = iq2_table_entry(i, grid_g);
    }
}

// prmt.b32 in its default mode: unlike __byte_perm (which keeps 3 bits of each selector
// nibble, so the compiler masks the selector), the mode bit is passed through; the IQ2
// selectors' nibbles are at most 6, so no mask is needed.
__device__ __forceinline__ u32 prmt_raw(u32 a, u32 b, u32 c) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 lds_u32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// The products of one IQ2_XXS lane step: 16 weight bytes (groups 2c and 2c + 1 of 32,
// super-block c >> 2, scale d as f16) against their int8 activations x (two int4 per
// group) and activation scales s. `sel_of(idx, sg, l)` gives entry l's byte selectors
// (its code nibbles OR its sign masks) from a group's index word and sign word: the
// kernels differ only in where those tables live. RAW: raw prmt (see prmt_raw) instead
// of __byte_perm. Every form gives the same products and sums.
//
// When the two groups' activation scales are equal — always under the Q8_K rule (one
// scale per 256 values: the routed experts' inputs), so the branch is uniform in the
// model — the groups' integer sums are combined with their scales 2·ls + 1 in integers
// and converted once, as the CPU's iq2_xxs_block_sum does for a whole block: 11 SASS
// instructions a step instead of 16 (of ~110), and no rounding between the groups (the
// kernels' time did not move: H200 rxtl 16.5 -> 16.4 µs, session 35). The products are
// spelled with _rn intrinsics so every kernel inlining this rounds alike.
// Other activations (Q8_0: a scale per 32) take the per-group float form.
template <bool RAW, typename SelOf>
__device__ __forceinline__ float iq2_xxs_dot_sel(const W4 w, u16 d, const int4 (&x)[4],
                                                 const float (&s)[2], SelOf sel_of) {
    const u32 words[4] = {w.a, w.b, w.c, w.d};
    int sums[2];
#pragma unroll
    for (int g = 0; g < 2; ++g) {
        const u32 idx = words[2 * g], sg = words[2 * g + 1];
        const int4 x01 = x[2 * g], x23 = x[2 * g + 1];
        const int xs[8] = {x01.x, x01.y, x01.z, x01.w, x23.x, x23.y, x23.z, x23.w};
        int sumi = 0;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 sel = sel_of(idx, sg, l);
            const int vlo = (int)(RAW ? prmt_raw(IQ2_LUT_POS, IQ2_LUT_NEG, sel)
                                      : __byte_perm(IQ2_LUT_POS, IQ2_LUT_NEG, sel));
            const int vhi = (int)(RAW ? prmt_raw(IQ2_LUT_POS, IQ2_LUT_NEG, sel >> 16)
                                      : __byte_perm(IQ2_LUT_POS, IQ2_LUT_NEG, sel >> 16));
            sumi = __dp4a(vlo, xs[2 * l], sumi);
            sumi = __dp4a(vhi, xs[2 * l + 1], sumi);
        }
        sums[g] = sumi;
    }
    if (s[0] == s[1]) {
        // (sg >> 27) | 1 = 2·(sg >> 28) + 1; d/4 · (0.5 + ls) = d/8 · (2·ls + 1).
        const int isum = sums[0] * (int)((words[1] >> 27) | 1u) + sums[1] * (int)((words[3] >> 27) | 1u);
        return __fmul_rn(__fmul_rn(h2f(d) * 0.125f, s[0]), (float)isum);
    }
    const float db = h2f(d) * 0.25f;
    float acc = 0.f;
#pragma unroll
    for (int g = 0; g < 2; ++g)
        acc += db * (0.5f + (float)(words[2 * g + 1] >> 28)) * s[g] * (float)sums[g];
    return acc;
}

// iq2_xxs_dot_sel on the tables built by iq2_tables. PROBE 1 (gpu-selftest --probe-q8
// only; 0 in production) replaces the table lookups by arithmetic on the weight bits.
template <int PROBE>
__device__ __forceinline__ float iq2_xxs_dot(const W4 w, u16 d, const int4 (&x)[4],
                                             const float (&s)[2], const u32* codes,
                                             const u32* signs) {
    return iq2_xxs_dot_sel<false>(w, d, x, s, [&](u32 idx, u32 sg, int l) -> u32 {
        if constexpr (PROBE == 1)
            return ((idx >> (8 * l)) ^ (sg >> (7 * l))) & 0x33333333u;
        else
            return codes[(idx >> (8 * l)) & 0xff] | signs[(sg >> (7 * l)) & 127];
    });
}

// iq2_xxs_dot with fewer integer instructions (the register-activation kernels are
// bound by the integer pipe, not by memory: H200, 6-expert gate+up 19.4 µs, 9.2 with
// loads only): one shared table (256 codes, then 128 sign masks) addressed as the
// kernel's own array, so the base folds into the LDS address; raw prmt without the
// selector masks. The table sits at 0x400 + 2048k in the shared window (`__align__` is
// relative to the start of user shared memory, after the CTA's reserved 1 KB), so tb's
// low 10 bits and tb + 1024's low 11 are zero: OR-ing a scaled index (< 1 KB, < 512 B)
// into them is one LOP3. gpu-selftest's bit-identical expert line catches a placement
// that breaks this.
__device__ __forceinline__ float iq2_xxs_dot_tab(const W4 w, u16 d, const int4 (&x)[4],
                                                 const float (&s)[2], const u32 (&tab)[384]) {
    const u32 tb = (u32)__cvta_generic_to_shared(tab);
    return iq2_xxs_dot_sel<true>(w, d, x, s, [&](u32 idx, u32 sg, int l) -> u32 {
        return lds_u32(tb | (((idx >> (8 * l)) & 0xff) << 2)) |
               lds_u32((tb + 1024) | (((sg >> (7 * l)) & 127) << 2));
    });
}

// One IQ2_XXS lane step of step index c against the activation staged in shared memory.
// PROBE (gpu-selftest --probe-q8 only; 0 in production) takes parts of the work out to
// find what bounds the kernel: 1 = no table lookups, 2 = no activation reads from
// shared memory, 3 = weight loads only.
template <int PROBE>
__device__ __forceinline__ float iq2_xxs_step(const W4 w, u16 d, int c, const u32* codes,
                                              const u32* signs, const i8* sq, const float* sd) {
    if constexpr (PROBE == 3) {
        return (float)(w.a ^ w.b ^ w.c ^ w.d ^ d);
    } else {
        int4 x[4];
        float s[2];
#pragma unroll
        for (int g = 0; g < 2; ++g) {
            const int grp = c * 2 + g;  // group of 32 within the row
            if (PROBE == 2) {
                x[2 * g] = make_int4(w.a, w.b, c, grp);
                x[2 * g + 1] = make_int4(w.c, w.d, grp, c);
                s[g] = 1.f;
            } else {
                const int4* xv = reinterpret_cast<const int4*>(sq + grp * 32);
                x[2 * g] = xv[0];
                x[2 * g + 1] = xv[1];
                s[g] = sd[grp];
            }
        }
        return iq2_xxs_dot<PROBE == 1 ? 1 : 0>(w, d, x, s, codes, signs);
    }
}

// With qs2 set, grid rows n_pair… use the second stack (qs2, dw2 → y2) with the same
// selections and input: the routed experts' gate and up in one launch.
#define IQ2_MATVEC_PARAMS                                                                   \
    const u8 *__restrict__ qs, const u16 *__restrict__ dw, i64 mat_q, i64 mat_d,             \
        const u64 *__restrict__ grid_g, const i8 *__restrict__ xq,                           \
        const float *__restrict__ xd, float *__restrict__ y, int rows, int cols, MatSel sel, \
        const u8 *__restrict__ qs2, const u16 *__restrict__ dw2, float *__restrict__ y2,     \
        int n_pair
#define IQ2_MATVEC_ARGS qs, dw, mat_q, mat_d, grid_g, xq, xd, y, rows, cols, sel, qs2, dw2, y2, n_pair

template <int PROBE>
__device__ __forceinline__ void iq2_xxs_q8_body(IQ2_MATVEC_PARAMS) {
    PDL_WAIT();
    constexpr int R = EXP_ROWS_PER_WARP;
    extern __shared__ __align__(16) u8 smem[];
    u32* codes = reinterpret_cast<u32*>(smem);
    u32* signs = reinterpret_cast<u32*>(smem + 1024);
    float* sd = reinterpret_cast<float*>(smem + 2048);
    i8* sq = reinterpret_cast<i8*>(smem + 2048 + (cols / 32) * 4);
    int yi = blockIdx.y;
    if (qs2 != nullptr && yi >= n_pair) {
        yi -= n_pair;
        qs = qs2;
        dw = dw2;
        y = y2;
    }
    const int m = sel.ids ? sel.ids[yi] : 0;
    const int nc = cols / 256 * 4;  // 16-byte steps per row
    const int row0 = blockIdx.x * blockDim.y * R + threadIdx.y;
    const u8* q[R];
    const u16* dr[R];
    bool ok[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = row0 + r * blockDim.y;
        ok[r] = row < rows;
        q[r] = qs + m * mat_q + (i64)(ok[r] ? row : 0) * nc * 16;
        dr[r] = dw + m * mat_d + (i64)(ok[r] ? row : 0) * (nc / 4);
    }
    W4 w[R];
    u16 d[R];
    auto load = [&](int c) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (ok[r] && c < nc) {
                const uint4 v = ld_stream16(q[r] + (i64)c * 16);
                w[r].a = v.x; w[r].b = v.y; w[r].c = v.z; w[r].d = v.w;
                d[r] = dr[r][c >> 2];
            }
        }
    };
    load(threadIdx.x);
    iq2_tables(codes, signs, grid_g);
    stage_x(sq, sd, xq + yi * sel.x_stride, xd + yi * (sel.x_stride / 32), cols);
    float acc[R] = {};
    for (int c = threadIdx.x; c < nc; c += WARP) {
        W4 cw[R];
        u16 cd[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            cw[r] = w[r];
            cd[r] = d[r];
        }
        load(c + WARP);
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (ok[r]) acc[r] += iq2_xxs_step<PROBE>(cw[r], cd[r], c, codes, signs, sq, sd);
    }
    PDL_TRIGGER();
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = warp_sum(acc[r]);
        if (threadIdx.x == 0 && ok[r]) y[yi * sel.y_stride + row0 + r * blockDim.y] = v;
    }
}

extern "C" __global__ void __launch_bounds__(256, 3) matvec_iq2_xxs_q8(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_body<0>(IQ2_MATVEC_ARGS);
}

// Q2_K × Q8: a lane takes 16 quant bytes (half h of chunk k): for each j the 16 values
// 128k + 32j + 16h + l sit in activation block 4k + j. Rows one after another: the
// side-by-side layout of the IQ2_XXS kernel measured slower here (13.8 -> 15.4 µs per
// 6-expert down on the H200 at 93 registers: two blocks per SM).
//
// One lane step adds, for j = 0..3, the 16 values of activation block 4k + j (x[j],
// scale xs[j]) times 2-bit values j of the quant words w (scale byte s[j] = scales[8k +
// 2j + h]; d and dmin in dmv) to acc, in j order.
//
// When the 4 blocks' activation scales are equal — always under the Q8_K rule (one
// scale per 256 values: the routed experts' down input), so the branch is uniform in
// the model — the step is summed in integers and converted once, as the CPU's
// k_quant_row does for a whole block: iq = Σ_j sc_j·Σ q·x, im = Σ_j m_j·Σ x, then
// (xs·d)·iq − (xs·dmin)·im. Each 2-bit field is masked in place (no shift) and summed by
// an unsigned × signed dp4a, whose sum is 4^j times the field's, shifted back once.
// ~73 SASS instructions a row step against ~100 in the float form (H200, 6-expert down
// 9.9 -> 9.0 µs, session 35); spelled with _rn intrinsics so every kernel inlining it
// rounds alike. Other activations (Q8_0) take the float form.
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// The sum of 16 int8 activations (an activation block's half a lane holds).
__device__ __forceinline__ int q8_sum16(const int4 v) {
    int s = __dp4a(0x01010101, v.x, 0);
    s = __dp4a(0x01010101, v.y, s);
    s = __dp4a(0x01010101, v.z, s);
    return __dp4a(0x01010101, v.w, s);
}
__device__ __forceinline__ bool q2k_uniform(const float (&xs)[4]) {
    return xs[0] == xs[1] && xs[1] == xs[2] && xs[2] == xs[3];
}
// The integer form; isx[j] = Σ of activation block j's 16 values.
__device__ __forceinline__ void q2k_lane_add_int(float& acc, const W4 w, u32 dmv, const u8 (&s)[4],
                                                 const int4 (&x)[4], float xs,
                                                 const int (&isx)[4]) {
    const u32 words[4] = {w.a, w.b, w.c, w.d};
    const float dd = h2f((u16)(dmv & 0xffff)), dmin = h2f((u16)(dmv >> 16));
    int iq = 0, im = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int xv[4] = {x[j].x, x[j].y, x[j].z, x[j].w};
        const u32 mask = 0x03030303u << (2 * j);
        int sq_ = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) sq_ = dp4a_us(words[t] & mask, xv[t], sq_);
        iq += (int)(s[j] & 15) * (sq_ >> (2 * j));
        im += (int)(s[j] >> 4) * isx[j];
    }
    acc = __fadd_rn(acc, __fsub_rn(__fmul_rn(__fmul_rn(xs, dd), (float)iq),
                                   __fmul_rn(__fmul_rn(xs, dmin), (float)im)));
}
// q2k_lane_add with the activation sums of the 4 blocks (isx, fsx = (float)isx) and
// the scales' uniformity (uni) given: they do not depend on the weights, so a kernel
// that keeps a selection's activations in registers forms them once, not for every row
// (16 of a row step's 32 dp4a in the float form). The same integers, products and
// order: the same sums.
__device__ __forceinline__ void q2k_lane_add_sx(float& acc, const W4 w, u32 dmv, const u8 (&s)[4],
                                                const int4 (&x)[4], const float (&xs)[4],
                                                const int (&isx)[4], const float (&fsx)[4],
                                                bool uni) {
    if (uni) {
        q2k_lane_add_int(acc, w, dmv, s, x, xs[0], isx);
        return;
    }
    const u32 words[4] = {w.a, w.b, w.c, w.d};
    const float dd = h2f((u16)(dmv & 0xffff)), dmin = h2f((u16)(dmv >> 16));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int xv[4] = {x[j].x, x[j].y, x[j].z, x[j].w};
        int sq_ = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t)
            sq_ = __dp4a((int)((words[t] >> (2 * j)) & 0x03030303u), xv[t], sq_);
        acc += xs[j] * (dd * (float)(s[j] & 15) * (float)sq_ - dmin * (float)(s[j] >> 4) * fsx[j]);
    }
}
// The staged kernel's lane step: q2k_lane_add_sx with the activation sums formed here.
__device__ __forceinline__ void q2k_lane_add(float& acc, const W4 w, u32 dmv, const u8 (&s)[4],
                                             const int4 (&x)[4], const float (&xs)[4]) {
    int isx[4];
    float fsx[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        isx[j] = q8_sum16(x[j]);
        fsx[j] = (float)isx[j];
    }
    q2k_lane_add_sx(acc, w, dmv, s, x, xs, isx, fsx, q2k_uniform(xs));
}

extern "C" __global__ void __launch_bounds__(256) matvec_q2_k_q8(
    const u8* __restrict__ qs, const u8* __restrict__ sc, const u32* __restrict__ dm,
    i64 mat_blocks, const i8* __restrict__ xq, const float* __restrict__ xd,
    float* __restrict__ y, int rows, int cols, MatSel sel) {
    PDL_WAIT();
    extern __shared__ __align__(16) u8 smem[];
    float* sd = reinterpret_cast<float*>(smem);
    i8* sq = reinterpret_cast<i8*>(smem + (cols / 32) * 4);
    stage_x(sq, sd, xq + blockIdx.y * sel.x_stride, xd + blockIdx.y * (sel.x_stride / 32), cols);
    const int row_end = min(rows, (int)((blockIdx.x + 1) * blockDim.y * EXP_ROWS_PER_WARP));
    for (int row = blockIdx.x * blockDim.y * EXP_ROWS_PER_WARP + threadIdx.y; row < row_end;
         row += blockDim.y) {
    const int m = sel_matrix(sel);
    const int nb = cols / 256;
    const i64 b0 = m * mat_blocks + (i64)row * nb;
    float acc = 0.f;
    for (int c = threadIdx.x; c < nb * 4; c += WARP) {
        const int b = c >> 2, k = (c >> 1) & 1, h = c & 1;
        const W4 w = ld16(qs + (b0 + b) * 64 + k * 32 + h * 16);
        const u8* scb = sc + (b0 + b) * 16;
        int4 x[4];
        float xs[4];
        u8 sv[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int xb = b * 8 + 4 * k + j;  // activation block of 32
            x[j] = *reinterpret_cast<const int4*>(sq + xb * 32 + 16 * h);
            xs[j] = sd[xb];
            sv[j] = scb[8 * k + 2 * j + h];
        }
        q2k_lane_add(acc, w, dm[b0 + b], sv, x, xs);
    }
    acc = warp_sum(acc);
    if (threadIdx.x == 0) y[blockIdx.y * sel.y_stride + row] = acc;
    }
}

// matvec_q2_k_q8 for rows of 2048 columns (8 super-blocks: lane c takes step c, the
// Flash experts' down projection; `q2k_rx`): each
// lane's 64 activation bytes and 4 scales sit in registers, read from global memory
// when its selection changes, and each warp walks a contiguous range of Q2K_RX_ROWS-row
// units (mostly one selection, so the activations are read about once per warp) with
// all of a unit's loads in flight; the scale bytes come in one 16-byte load per row.
// The sums are matvec_q2_k_q8's, in the same order.
#define Q2K_RX_ROWS 4
extern "C" __global__ void __launch_bounds__(256) matvec_q2_k_q8_rx(
    const u8* __restrict__ qs, const u8* __restrict__ sc, const u32* __restrict__ dm,
    i64 mat_blocks, const i8* __restrict__ xq, const float* __restrict__ xd,
    float* __restrict__ y, int rows, int cols, MatSel sel, int n_sel) {
    PDL_WAIT();
    constexpr int R = Q2K_RX_ROWS, NB = 8;
    (void)cols;  // NB · 256 (the host checks)
    const int c = threadIdx.x;
    const int b = c >> 2, k = (c >> 1) & 1, h = c & 1;
    const int units_per_sel = (rows + R - 1) / R;
    const i64 n_units = (i64)n_sel * units_per_sel;
    const i64 warps = (i64)gridDim.x * blockDim.y;
    const i64 wi = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    int4 x[4];
    float xs[4], fsx[4];
    int isx[4];
    bool uni = false;
    int x_sel = -1;
    // The warp's units [u_begin, u_end), walked with the selection and row unit advanced
    // (not divided out for every unit).
    const i64 u_begin = wi * n_units / warps, u_end = (wi + 1) * n_units / warps;
    int yi = (int)(u_begin / units_per_sel);
    int ru = (int)(u_begin - (i64)yi * units_per_sel);
    for (i64 u = u_begin; u < u_end; ++u, ++ru) {
        if (ru == units_per_sel) {
            ru = 0;
            ++yi;
        }
        const int row0 = ru * R;
        const int m = sel.ids ? sel.ids[yi] : 0;
        W4 w[R];
        u32 dmv[R];
        uint4 scv[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const i64 blk = m * mat_blocks + (i64)min(row0 + r, rows - 1) * NB + b;
            const uint4 v = ld_stream16(qs + blk * 64 + k * 32 + h * 16);
            w[r].a = v.x; w[r].b = v.y; w[r].c = v.z; w[r].d = v.w;
            dmv[r] = dm[blk];
            scv[r] = ld_stream16(sc + blk * 16);
        }
        if (yi != x_sel) {
            x_sel = yi;
            const i8* xr = xq + (i64)yi * sel.x_stride;
            const float* xdr = xd + (i64)yi * (sel.x_stride / 32);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int xb = b * 8 + 4 * k + j;
                x[j] = *reinterpret_cast<const int4*>(xr + xb * 32 + 16 * h);
                xs[j] = xdr[xb];
                isx[j] = q8_sum16(x[j]);
                fsx[j] = (float)isx[j];
            }
            uni = q2k_uniform(xs);
        }
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            // Scale bytes 8k + 2j + h: j = 0, 1 in word 2k, j = 2, 3 in word 2k + 1.
            const u32 lo = k ? scv[r].z : scv[r].x, hi = k ? scv[r].w : scv[r].y;
            const u8 sv[4] = {(u8)(lo >> (8 * h)), (u8)(lo >> (8 * (2 + h))), (u8)(hi >> (8 * h)),
                              (u8)(hi >> (8 * (2 + h)))};
            acc[r] = 0.f;
            q2k_lane_add_sx(acc[r], w[r], dmv[r], sv, x, xs, isx, fsx, uni);
        }
        // The unit's R sums in one transposed reduction (warp_sum's bits): 6 shuffles,
        // not 20, against a row's ~40 instructions of products.
        int first;
        warp_sums<R>(acc, first);
        if (warp_sums_writer<R>() && row0 + first < rows)
            y[(i64)yi * sel.y_stride + row0 + first] = acc[0];
    }
    PDL_TRIGGER();
}

// Q4_K × Q8 (GGUF layout): a lane takes 16 quant bytes of chunk ch, half h: low nibbles
// are values 64ch + 16h + l (activation block 2ch), high nibbles 64ch + 32 + 16h + l
// (block 2ch + 1).
extern "C" __global__ void __launch_bounds__(256) matvec_q4_k_q8(
    const u8* __restrict__ w, i64 mat_blocks, const i8* __restrict__ xq,
    const float* __restrict__ xd, float* __restrict__ y, int rows, int cols, MatSel sel) {
    PDL_WAIT();
    extern __shared__ __align__(16) u8 smem[];
    float* sd = reinterpret_cast<float*>(smem);
    i8* sq = reinterpret_cast<i8*>(smem + (cols / 32) * 4);
    stage_x(sq, sd, xq + blockIdx.y * sel.x_stride, xd + blockIdx.y * (sel.x_stride / 32), cols);
    const int row_end = min(rows, (int)((blockIdx.x + 1) * blockDim.y * EXP_ROWS_PER_WARP));
    for (int row = blockIdx.x * blockDim.y * EXP_ROWS_PER_WARP + threadIdx.y; row < row_end;
         row += blockDim.y) {
    const int m = sel_matrix(sel);
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
        const int xb_lo = b * 8 + 2 * ch, xb_hi = xb_lo + 1;
        const int4 xl = *reinterpret_cast<const int4*>(sq + xb_lo * 32 + 16 * h);
        const int4 xh = *reinterpret_cast<const int4*>(sq + xb_hi * 32 + 16 * h);
        const int xls[4] = {xl.x, xl.y, xl.z, xl.w};
        const int xhs[4] = {xh.x, xh.y, xh.z, xh.w};
        int ql = 0, qh = 0, sl = 0, sh = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            ql = __dp4a((int)(words[t] & 0x0f0f0f0fu), xls[t], ql);
            qh = __dp4a((int)((words[t] >> 4) & 0x0f0f0f0fu), xhs[t], qh);
            sl = __dp4a(0x01010101, xls[t], sl);
            sh = __dp4a(0x01010101, xhs[t], sh);
        }
        acc += sd[xb_lo] * (dd * sc1 * (float)ql - dmin * m1 * (float)sl) +
               sd[xb_hi] * (dd * sc2 * (float)qh - dmin * m2 * (float)sh);
    }
    acc = warp_sum(acc);
    if (threadIdx.x == 0) y[blockIdx.y * sel.y_stride + row] = acc;
    }
}

// Q8_K-style activation quantisation (llama.cpp quantize_row_q8_K_ref, as the CPU's
// quantize_q8_k): per 256 values the signed value of largest magnitude (the first on
// ties) maps to -127, q = clamp(rint(x·(-127/max)), -128, 127), d = 1/iscale. The
// scale is written once per 32 values so the int8 kernels above consume it unchanged.
// One block of 256 threads per 256 values.
extern "C" __global__ void __launch_bounds__(256) quantize_q8_k32(const float* __restrict__ x,
        i8* __restrict__ q, float* __restrict__ d) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const i64 base = (i64)blockIdx.x * 256;
    const float v = x[base + threadIdx.x];
    quant_q8k_block256(v, x + base, base, q, d);
}

// quantize_q8_k32 of n rows of `cols` values, each row's result written to k consecutive
// rows (row r to rows r·k .. r·k + k − 1): a multi-row or batched step's expert input,
// one row per (token, expert) pair, from its n tokens' rows — where the f32 rows were
// copied k times (repeat_rows) and every copy quantised. The same values and scales as
// quantize_q8_k32 on the copies. A block a 256-value block of a source row.
extern "C" __global__ void __launch_bounds__(256) quantize_q8_k32_rep(const float* __restrict__ x,
                                                                      i8* __restrict__ q,
                                                                      float* __restrict__ d,
                                                                      int cols, int k) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    const int cpr = cols / 256;
    const int r = blockIdx.x / cpr, c = blockIdx.x - r * cpr;
    const i64 src = (i64)r * cols + c * 256;
    float scale;
    const int qi = quant_q8k_value256(x[src + threadIdx.x], x + src, scale);
    for (int j = 0; j < k; ++j) {
        const i64 row = (i64)r * k + j;
        q[row * cols + c * 256 + threadIdx.x] = (i8)qi;
        if (threadIdx.x < 8) d[(row * cpr + c) * 8 + threadIdx.x] = scale;
    }
}

// One Q8_0 block of a row: 32 weight bytes (w0, w1) with scale dq against the 32 int8
// activations at xb with scale xs.
// q8_block_dot with the block's activations already loaded (x0, x1).
__device__ __forceinline__ float q8_block_dot_x(const uint4 w0, const uint4 w1, u16 dq,
                                                const int4 x0, const int4 x1, float xs) {
    int s = __dp4a((int)w0.x, x0.x, 0);
    s = __dp4a((int)w0.y, x0.y, s);
    s = __dp4a((int)w0.z, x0.z, s);
    s = __dp4a((int)w0.w, x0.w, s);
    s = __dp4a((int)w1.x, x1.x, s);
    s = __dp4a((int)w1.y, x1.y, s);
    s = __dp4a((int)w1.z, x1.z, s);
    s = __dp4a((int)w1.w, x1.w, s);
    return (h2f(dq) * xs) * (float)s;
}
__device__ __forceinline__ float q8_block_dot(const uint4 w0, const uint4 w1, u16 dq,
                                              const i8* __restrict__ xb, float xs) {
    return q8_block_dot_x(w0, w1, dq, *reinterpret_cast<const int4*>(xb),
                          *reinterpret_cast<const int4*>(xb + 16), xs);
}

// EARLY: the lane's first Q8_EARLY_STEPS weight blocks are loaded before
// griddepcontrol.wait. Weights never depend on the previous kernel, so under programmatic
// dependent launch these loads overlap the previous grid's drain instead of following it
// (the ramp that keeps 2–36 MB matvecs at 56–61% of the read ceiling). The caller
// guarantees that sel.ids, read before the wait too, is not written inside the graph.
// Same sums in the same order as without it: the results are bit-identical.
#define Q8_EARLY_STEPS 4
template <bool EARLY>
__device__ __forceinline__ void matvec_q8_0_q8_body(
    const i8* __restrict__ qs, const u16* __restrict__ dw, i64 mat_q, i64 mat_d,
    const i8* __restrict__ xq, const float* __restrict__ xd, float* __restrict__ y, int rows,
    int cols, MatSel sel, int ks) {
    if (!EARLY) PDL_WAIT();
    // `ks` warps share a row (split K) so short matrices still fill the GPU.
    __shared__ float red[ROWS_PER_BLOCK];
    const int row = blockIdx.x * (blockDim.y / ks) + threadIdx.y / ks;
    const int split = threadIdx.y % ks;
    const int m = sel_matrix(sel);
    xq += blockIdx.y * sel.x_stride;
    xd += blockIdx.y * (sel.x_stride / 32);
    float acc = 0.f;
    const int nb = cols / 32;
    const int b0 = split * WARP + threadIdx.x, bstep = ks * WARP;
    // A row past the last addresses the last (only the early loads read it).
    const i64 rc = row < rows ? row : rows - 1;
    const i8* q = qs + m * mat_q + rc * cols;
    const u16* dr = dw + m * mat_d + rc * nb;
    int b = b0;
    if (EARLY) {
        uint4 w0[Q8_EARLY_STEPS], w1[Q8_EARLY_STEPS];
        u16 dq[Q8_EARLY_STEPS];
        // Unconditional loads (a step past the row reads the row's first block): ptxas
        // moved griddepcontrol.wait above loads that sat in branches, so they no longer
        // overlapped the previous kernel.
#pragma unroll
        for (int u = 0; u < Q8_EARLY_STEPS; ++u) {
            const int bu = b0 + u * bstep < nb ? b0 + u * bstep : 0;
            w0[u] = ld_early16(q + bu * 32);
            w1[u] = ld_early16(q + bu * 32 + 16);
            dq[u] = ld_early2(dr + bu);
        }
        PDL_WAIT_AFTER_LOADS(rows < 0);
        if (row < rows) {
            // Every prefetched step's activations first, then the products in step
            // order; a step past the row is computed on the row's first block and not
            // added. (With a branch a step the compiler moved each step's loads behind
            // the previous step's products.)
            int4 xa[Q8_EARLY_STEPS], xb[Q8_EARLY_STEPS];
            float xs[Q8_EARLY_STEPS];
#pragma unroll
            for (int u = 0; u < Q8_EARLY_STEPS; ++u) {
                const int bu = b0 + u * bstep < nb ? b0 + u * bstep : 0;
                xa[u] = *reinterpret_cast<const int4*>(xq + bu * 32);
                xb[u] = *reinterpret_cast<const int4*>(xq + bu * 32 + 16);
                xs[u] = xd[bu];
            }
#pragma unroll
            for (int u = 0; u < Q8_EARLY_STEPS; ++u) {
                const float v = q8_block_dot_x(w0[u], w1[u], dq[u], xa[u], xb[u], xs[u]);
                if (b0 + u * bstep < nb) acc += v;
            }
        }
        b = b0 + Q8_EARLY_STEPS * bstep;
    }
    if (row < rows) {
#pragma unroll 4
        for (; b < nb; b += bstep)
            acc += q8_block_dot(ld_stream16(q + b * 32), ld_stream16(q + b * 32 + 16), dr[b],
                                xq + b * 32, xd[b]);
    }
    PDL_TRIGGER();
    store_split_row(acc, ks, split, row < rows, y, blockIdx.y * sel.y_stride + row, red);
}

#define Q8_0_Q8_PARAMS                                                                    \
    const i8 *__restrict__ qs, const u16 *__restrict__ dw, i64 mat_q, i64 mat_d,          \
        const i8 *__restrict__ xq, const float *__restrict__ xd, float *__restrict__ y,   \
        int rows, int cols, MatSel sel, int ks
#define Q8_0_Q8_ARGS qs, dw, mat_q, mat_d, xq, xd, y, rows, cols, sel, ks

// Q8_0 weights × Q8_0 activations (both int8 per 32, f16 / f32 scales), dp4a. A lane
// takes whole blocks of 32 (32 weight bytes, one scale), so a warp reads 1 KiB of its row
// per step; weight loads skip L1 and ask the L2 for 256-byte lines. Against 16 bytes
// per lane with plain loads this took the H200 output head from 3.79 to 4.19 TB/s and
// attn_output_b from 16.7 to 12.6 µs (NOTES.md, session 4).
KERNEL_PAIR(__launch_bounds__(256), matvec_q8_0_q8, matvec_q8_0_q8_early, matvec_q8_0_q8_body,
            Q8_0_Q8_PARAMS, Q8_0_Q8_ARGS)

// matvec_q8_0_q8_early with RPW rows per warp (`q8_rows`, ks 1): the warp's rows are
// consecutive, so a lane's loads of one step cover RPW × 32 bytes of RPW rows at once.
// For short rows (q_b: 1,024 columns, one step per lane) the plain kernel gives each warp
// 1 KiB and a reduction, and runs ~4 waves of blocks; here each warp has 4 KiB in flight
// and the grid is a quarter. Per row the same steps in the same order and the same
// warp_sum: the same sums.
// (Q8_ROWS_PER_WARP: ds4_consts.h.)
template <int R>
__device__ __forceinline__ void matvec_q8_0_q8_rows_body(
    const i8* __restrict__ qs, const u16* __restrict__ dw, i64 mat_q, i64 mat_d,
    const i8* __restrict__ xq, const float* __restrict__ xd, float* __restrict__ y, int rows,
    int cols, MatSel sel) {
    const int row0 = (blockIdx.x * blockDim.y + threadIdx.y) * R;
    const int m = sel_matrix(sel);
    const int nb = cols / 32;
    const int lane = threadIdx.x;
    const i8* q = qs + m * mat_q;
    const u16* dr = dw + m * mat_d;
    uint4 w0[R], w1[R];
    u16 dq[R];
    // Rows past the last read the last (their sums are not stored): no branch a row, so
    // the step's activation loads are issued once, with its weight loads. (With a branch
    // a row each row reloaded the block's activations after its weights arrived: R
    // L1 round trips one after another a step.)
    auto load = [&](int b) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = min(row0 + r, rows - 1);
            if (b < nb) {
                w0[r] = ld_stream16(q + (i64)row * cols + b * 32);
                w1[r] = ld_stream16(q + (i64)row * cols + b * 32 + 16);
                dq[r] = dr[(i64)row * nb + b];
            }
        }
    };
    load(lane);
    PDL_WAIT();
    xq += blockIdx.y * sel.x_stride;
    xd += blockIdx.y * (sel.x_stride / 32);
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int b = lane; b < nb; b += WARP) {
        if (b != lane) load(b);
        const int4 x0 = *reinterpret_cast<const int4*>(xq + b * 32);
        const int4 x1 = *reinterpret_cast<const int4*>(xq + b * 32 + 16);
        const float xs = xd[b];
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += q8_block_dot_x(w0[r], w1[r], dq[r], x0, x1, xs);
    }
    PDL_TRIGGER();
    int first;
    warp_sums<R>(acc, first);  // acc[0] is row first's sum: warp_sum's bits
    if (warp_sums_writer<R>() && row0 + first < rows)
        y[blockIdx.y * sel.y_stride + row0 + first] = acc[0];
}
extern "C" __global__ void __launch_bounds__(256) matvec_q8_0_q8_r4(Q8_0_Q8_PARAMS) {
    (void)ks;  // 1
    matvec_q8_0_q8_rows_body<Q8_ROWS_PER_WARP>(qs, dw, mat_q, mat_d, xq, xd, y, rows, cols, sel);
}
// Two rows a warp for longer rows (`q8_rows2`).
extern "C" __global__ void __launch_bounds__(256) matvec_q8_0_q8_r2(Q8_0_Q8_PARAMS) {
    (void)ks;  // 1
    matvec_q8_0_q8_rows_body<2>(qs, dw, mat_q, mat_d, xq, xd, y, rows, cols, sel);
}

// T tokens of a plain Q8_0 matrix (a multi-row decode step, sel.ids = 0): each weight
// block is loaded once and applied to the n_tok ≤ T activation rows at sel.x_stride, so
// a step of R rows reads the weights once instead of R times. R rows a warp with ks = 1
// (as matvec_q8_0_q8_r2 / _r4), or R = 1 with `ks` warps a row (as matvec_q8_0_q8 /
// _early): per (row, token) the same blocks in the same order and the same reduction as
// the kernel one token would use, so the sums are the same (gpu-selftest checks it).
// blockIdx.y is a group: matrix g of the stack (strides mat_q, mat_d) on the inputs at
// g·gx and outputs at g·gy of each token (the grouped output projection; 0 when plain).
template <int T, int R>
__device__ __forceinline__ void matvec_q8_0_q8_tok_body(
    const i8* __restrict__ qs, const u16* __restrict__ dw, i64 mat_q, i64 mat_d,
    const i8* __restrict__ xq, const float* __restrict__ xd, float* __restrict__ y, int rows,
    int cols, MatSel sel, int ks, int n_tok, i64 gx, i64 gy) {
    __shared__ float red[T][ROWS_PER_BLOCK];
    const int g = blockIdx.y;
    qs += g * mat_q;
    dw += g * mat_d;
    xq += g * gx;
    xd += g * (gx / 32);
    y += g * gy;
    const int group = threadIdx.y / ks, split = threadIdx.y % ks;
    const int row0 = (blockIdx.x * (blockDim.y / ks) + group) * R;
    const int nb = cols / 32;
    const int b0 = split * WARP + threadIdx.x, bstep = ks * WARP;
    const i64 xs = sel.x_stride;
    float acc[R][T];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = 0.f;
    // As the early kernels: the first P steps' weights are loaded before the PDL wait
    // (the matrix is plain, so nothing the previous kernel writes), about as many bytes
    // in flight per lane as matvec_q8_0_q8_early's.
    constexpr int P = R >= 4 ? 1 : (R == 2 ? 2 : Q8_EARLY_STEPS);
    uint4 w0[P][R], w1[P][R];
    u16 dq[P][R];
    // Rows past the last read the last and tokens past n_tok the first (their sums are
    // not stored): no branch a row or token, so a step's activation loads are issued
    // together, ahead of its products (with a branch each (row, token) reloaded its
    // activations after the weights arrived: R·T L1 round trips one after another).
    auto load = [&](int u, int b) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (b < nb) {
                const int row = min(row0 + r, rows - 1);
                const i8* q = qs + (i64)row * cols + b * 32;
                w0[u][r] = ld_stream16(q);
                w1[u][r] = ld_stream16(q + 16);
                dq[u][r] = dw[(i64)row * nb + b];
            }
        }
    };
    constexpr int TC = T < 4 ? T : 4;  // tokens whose activations are held at once
    auto dot = [&](int u, int b) {
#pragma unroll
        for (int t0 = 0; t0 < T; t0 += TC) {
            int4 x0[TC], x1[TC];
            float d[TC];
            // (T = 5: the last group's slots past T are compile-time dead.)
#pragma unroll
            for (int c = 0; c < TC; ++c) {
                if (t0 + c >= T) continue;
                const int tk = t0 + c < n_tok ? t0 + c : 0;
                const i8* x = xq + tk * xs + b * 32;
                x0[c] = *reinterpret_cast<const int4*>(x);
                x1[c] = *reinterpret_cast<const int4*>(x + 16);
                d[c] = xd[tk * (xs / 32) + b];
            }
#pragma unroll
            for (int c = 0; c < TC; ++c)
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (t0 + c < T)
                        acc[r][t0 + c] +=
                            q8_block_dot_x(w0[u][r], w1[u][r], dq[u][r], x0[c], x1[c], d[c]);
        }
    };
#pragma unroll
    for (int u = 0; u < P; ++u) load(u, b0 + u * bstep);
    PDL_WAIT();
#pragma unroll
    for (int u = 0; u < P; ++u)
        if (b0 + u * bstep < nb) dot(u, b0 + u * bstep);
    for (int b = b0 + P * bstep; b < nb; b += bstep) {
        load(0, b);
        dot(0, b);
    }
    PDL_TRIGGER();
    // The R·T sums in one transposed reduction (warp_sums: warp_sum's bits), padded
    // with zeros to a power of two for T = 3 (a padding slot's total is not stored).
    constexpr int N = R * T, NP = pow2_ceil_ct(N), K = NP > WARP ? NP / WARP : 1;
    float v[NP];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) v[r * T + t] = acc[r][t];
#pragma unroll
    for (int i = N; i < NP; ++i) v[i] = 0.f;
    int first;
    warp_sums<NP>(v, first);
    if (warp_sums_writer<NP>()) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (first + k >= N) continue;
            const int r = (first + k) / T, t = (first + k) % T;
            if (ks == 1) {
                if (t < n_tok && row0 + r < rows) y[t * sel.y_stride + row0 + r] = v[k];
            } else {
                red[t][threadIdx.y] = v[k];  // R = 1 with split K
            }
        }
    }
    if (ks > 1) {
        __syncthreads();
        if (threadIdx.x == 0 && split == 0 && row0 < rows) {
            for (int t = 0; t < n_tok; ++t) {
                float s = 0.f;
                for (int i = 0; i < ks; ++i) s += red[t][threadIdx.y + i];
                y[t * sel.y_stride + row0] = s;
            }
        }
    }
}

// BOUNDS: the kernel's __launch_bounds__. t2r4 asks for three blocks an SM: the q_b
// shapes (1,024 columns, one step a lane) are latency-bound, and at its free 93
// registers it held two against the one-token r4's three. (An explicit minimum of one
// block gave the others more registers than the plain bound, not fewer.)
#define Q8_TOK_KERNEL(T, R, BOUNDS)                                                         \
    extern "C" __global__ void BOUNDS matvec_q8_0_q8_t##T##r##R(                           \
        const i8* __restrict__ qs, const u16* __restrict__ dw, i64 mat_q, i64 mat_d,       \
        const i8* __restrict__ xq, const float* __restrict__ xd, float* __restrict__ y,    \
        int rows, int cols, MatSel sel, int ks, int n_tok, i64 gx, i64 gy) {               \
        matvec_q8_0_q8_tok_body<T, R>(qs, dw, mat_q, mat_d, xq, xd, y, rows, cols, sel, ks, \
                                      n_tok, gx, gy);                                      \
    }
Q8_TOK_KERNEL(2, 1, __launch_bounds__(256))
Q8_TOK_KERNEL(2, 2, __launch_bounds__(256))
Q8_TOK_KERNEL(2, 4, __launch_bounds__(256, 3))
// T = 3 (`tokens3`): a 3-token step (an MTP verify of two drafts) without the 4-token
// kernels' padding token, whose products were a quarter of their integer work.
Q8_TOK_KERNEL(3, 1, __launch_bounds__(256))
Q8_TOK_KERNEL(3, 2, __launch_bounds__(256))
Q8_TOK_KERNEL(3, 4, __launch_bounds__(256))
Q8_TOK_KERNEL(4, 1, __launch_bounds__(256))
Q8_TOK_KERNEL(4, 2, __launch_bounds__(256))
Q8_TOK_KERNEL(4, 4, __launch_bounds__(256))
// T = 5 (`tokens5`). 6 and 7 lost to the 8-token kernels in session 39 (sessions 6 / 7
// +0.8% / +2.1%), so those counts keep T = 8.
Q8_TOK_KERNEL(5, 1, __launch_bounds__(256))
Q8_TOK_KERNEL(5, 2, __launch_bounds__(256))
Q8_TOK_KERNEL(5, 4, __launch_bounds__(256))
Q8_TOK_KERNEL(8, 1, __launch_bounds__(256))
Q8_TOK_KERNEL(8, 2, __launch_bounds__(256))
Q8_TOK_KERNEL(8, 4, __launch_bounds__(256))
Q8_TOK_KERNEL(16, 1, __launch_bounds__(256))
Q8_TOK_KERNEL(16, 2, __launch_bounds__(256))
Q8_TOK_KERNEL(16, 4, __launch_bounds__(256))
