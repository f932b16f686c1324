// The IQ2_XXS expert matvecs with their activations in registers (`iq2_rx` and the
// variants built on it: `iq2_early`, `iq2_tab`, `iq2_pipe`, `iq2_lut32`), for rows of
// 4096 columns — the routed experts' gate and up. They share matvec_q8act.cu's IQ2
// lookup scheme (IQ2_LUT_POS/NEG, iq2_tables, iq2_xxs_dot, iq2_xxs_dot_tab) and
// parameter list (IQ2_MATVEC_PARAMS), and give its staged kernel's sums bit for bit
// (gpu-selftest's expert line). build.rs concatenates the kernel files in name order,
// so this file follows matvec_q8act.cu.
#include "common.cuh"

// The IQ2 tables with 32 interleaved copies (`iq2_lut32`): entry e of lane l is word
// e·32 + l, so a warp's 32 lookups fall on 32 distinct banks whatever the indices. With
// one copy a warp's random indices land ~3 to a bank: in a batched step (48 expert
// pairs a layer) ncu counted 12.4M bank conflicts on 18.7M shared-load wavefronts and
// short-scoreboard and MIO-throttle stalls as 3.1 of the 6.8 cycles between a warp's
// instructions. 48 KB a block in dynamic shared memory, placed at its first 32 KB
// boundary (the launch asks for IQ2_LUT32_SMEM: user shared memory starts after the
// CTA's reserved 1 KB), filled from the grid before the PDL wait.
// (IQ2_LUT32_WORDS, IQ2_LUT32_SMEM: ds4_consts.h.)
static_assert(IQ2_LUT32_WORDS == 384 * 32, "256 code and 128 sign entries, 32 copies");
static_assert(IQ2_LUT32_SMEM >= IQ2_LUT32_WORDS * 4 + 32768 - 16,
              "the tables at the first 32 KB boundary of 16-byte aligned dynamic memory");
// An entry's 32 copies as 8 16-byte stores at `row`, started at a thread-dependent piece
// so that a warp's stores spread over the banks.
__device__ __forceinline__ void iq2_entry_copies(uint4* row, u32 v, int tid) {
    const uint4 v4 = make_uint4(v, v, v, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) row[(k + tid) & 7] = v4;
}
__device__ __forceinline__ void iq2_tables32(u32* tab, const u64* grid_g) {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;
    for (int e = tid; e < 384; e += nthreads)
        iq2_entry_copies(reinterpret_cast<uint4*>(tab + e * 32), iq2_table_entry(e, grid_g), tid);
}

// The sign half of the 32-copy tables, 32 KB past the code half.
__device__ __forceinline__ u32 lds_u32_32k(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1+32768];" : "=r"(v) : "r"(addr));
    return v;
}

// The 32-copy tables laid out for `iq2_prmt`: code entry e of lane l at byte
// 0x10000 + 256e + 4l of the block's shared window (the first 64 KB boundary, so an
// entry's address is the lane's address with its byte 1 replaced by the code byte: one
// PRMT), sign entry e at 0xC000 + 128e + 4l (16 KB below, reached from the same
// address base by the load's immediate, as in iq2_xxs_dot_l32). `win` is the window's
// byte 0; the launch asks for IQ2_PRMT_SMEM of dynamic shared memory.
__device__ __forceinline__ void iq2_tables64(u8* win, const u64* grid_g) {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;
    for (int e = tid; e < 384; e += nthreads) {
        u8* row = e < 256 ? win + 0x10000 + 256 * e : win + 0xC000 + 128 * (e - 256);
        iq2_entry_copies(reinterpret_cast<uint4*>(row), iq2_table_entry(e, grid_g), tid);
    }
}
__device__ __forceinline__ u32 lds_u32_m16k(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1+-16384];" : "=r"(v) : "r"(addr));
    return v;
}
// iq2_xxs_dot_l32 on the iq2_tables64 layout: tl = 0x10000 | lane · 4 (a window
// address); the code address is one PRMT of the index word into tl's byte 1. The same
// products and sums as iq2_xxs_dot<0>.
__device__ __forceinline__ float iq2_xxs_dot_p64(const W4 w, u16 d, const int4 (&x)[4],
                                                 const float (&s)[2], u32 tl) {
    return iq2_xxs_dot_sel<true>(w, d, x, s, [&](u32 idx, u32 sg, int l) -> u32 {
        const u32 ca = prmt_raw(idx, tl, 0x7604u | ((u32)l << 4));
        const u32 si = (l == 0 ? sg << 7 : (l == 1 ? sg : sg >> (7 * l - 7))) & 0x3f80u;
        return lds_u32(ca) | lds_u32_m16k(tl | si);
    });
}

// iq2_xxs_dot_tab on the 32-copy tables. `tl` is the table's shared address (32 KB
// aligned) OR the lane's byte offset (lane · 4): entry e of this lane sits at tl +
// e·128, so an index field shifted to bits 7..14 and OR-ed into tl is the address —
// one LOP3 after at most one shift, the sign half's 32 KB in the load's immediate.
// (Plain array indexing let the compiler turn the OR into an add, reassociate it with
// the base and pay one IADD more per lookup.) The same products and sums as
// iq2_xxs_dot<0>.
__device__ __forceinline__ float iq2_xxs_dot_l32(const W4 w, u16 d, const int4 (&x)[4],
                                                 const float (&s)[2], u32 tl) {
    return iq2_xxs_dot_sel<true>(w, d, x, s, [&](u32 idx, u32 sg, int l) -> u32 {
        // Code byte l to bits 7..14; sign field l (bits 7l..7l+6) likewise.
        const u32 ci = (l == 0 ? idx << 7 : idx >> (8 * l - 7)) & 0x7f80u;
        const u32 si = (l == 0 ? sg << 7 : (l == 1 ? sg : sg >> (7 * l - 7))) & 0x3f80u;
        return lds_u32(tl | ci) | lds_u32_32k(tl | si);
    });
}

// matvec_iq2_xxs_q8 for rows of IQ2_RX_STEPS × 32 16-byte steps (the Flash experts'
// 4096 columns): lane l always takes steps l, l + 32, … of a row, so its activations
// (64 int8 values and 2 scales per step) sit in registers, read once from global memory
// per selection input: no staging, no barrier but the tables', and no shared-memory
// reads of x, which the probes showed the staged kernel waiting on (6-expert gate, H100:
// 17.2 µs, 11.1 without activation reads). Warps walk units of EXP_ROWS_PER_WARP
// consecutive rows of any matrix in the launch on their own (the grid is ~2 blocks per
// SM), all of a unit's weight loads in flight at once. The sums are
// matvec_iq2_xxs_q8's, in the same order.
//
// EARLY (matvec_iq2_xxs_q8_rxe, `iq2_early`): the tables are built before the PDL wait
// (they come from the constant grid; the plain kernel builds them after it: an L2 load
// and a barrier on the routed experts' chain, 43 times a token). Same sums.
// (IQ2_RX_STEPS: ds4_consts.h.)

// The register-activation kernels' loads. A unit: R consecutive rows from row0 of the
// matrix at (q, dw) (rows past the last repeat it), lane's steps lane + 32k, k < S.
template <int R, int S>
__device__ __forceinline__ void iq2_rx_load_rows(const u8* q, const u16* dw, int row0, int rows,
                                                 int lane, W4 (&w)[R][S], u16 (&d)[R][S]) {
    constexpr int nc = S * WARP;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = min(row0 + r, rows - 1);
        const u8* qr = q + (i64)row * nc * 16;
        const u16* dr = dw + (i64)row * (nc / 4);
#pragma unroll
        for (int k = 0; k < S; ++k) {
            const int c = lane + k * WARP;
            const uint4 v = ld_stream16(qr + c * 16);
            w[r][k].a = v.x; w[r][k].b = v.y; w[r][k].c = v.z; w[r][k].d = v.w;
            d[r][k] = dr[c >> 2];
        }
    }
}
// The lane's activations (64 int8 values and 2 scales a step) of the input at xo.
template <int S>
__device__ __forceinline__ void iq2_rx_load_x(const i8* xq, const float* xd, i64 xo, int lane,
                                              int4 (&x)[S][4], float (&s)[S][2]) {
#pragma unroll
    for (int k = 0; k < S; ++k) {
        const int grp = 2 * (lane + k * WARP);
        const int4* xv = reinterpret_cast<const int4*>(xq + xo + grp * 32);
#pragma unroll
        for (int i = 0; i < 4; ++i) x[k][i] = xv[i];
        s[k][0] = xd[xo / 32 + grp];
        s[k][1] = xd[xo / 32 + grp + 1];
    }
}

template <bool EARLY>
__device__ __forceinline__ void iq2_xxs_q8_rx_body(IQ2_MATVEC_PARAMS) {
    if (!EARLY) PDL_WAIT();
    constexpr int R = EXP_ROWS_PER_WARP, S = IQ2_RX_STEPS;
    __shared__ u32 base_codes[256], base_signs[128];
    iq2_tables(base_codes, base_signs, grid_g);
    __syncthreads();
    const u32* codes = base_codes;
    const u32* signs = base_signs;
    if (EARLY) PDL_WAIT();
    (void)cols;  // S × 32 steps of 64 values (the host checks)
    const int lane = threadIdx.x;
    const int units_per_sel = (rows + R - 1) / R;
    const int n_units = (qs2 != nullptr ? 2 : 1) * n_pair * units_per_sel;
    int4 x[S][4];
    float s[S][2];
    i64 x_at = -1;
    for (int u = blockIdx.x * blockDim.y + threadIdx.y; u < n_units;
         u += gridDim.x * blockDim.y) {
        int yi = u / units_per_sel;
        const int row0 = (u - yi * units_per_sel) * R;
        const u8* qm = qs;
        const u16* dm = dw;
        float* ym = y;
        if (qs2 != nullptr && yi >= n_pair) {
            yi -= n_pair;
            qm = qs2;
            dm = dw2;
            ym = y2;
        }
        const int m = sel.ids ? sel.ids[yi] : 0;
        W4 w[R][S];
        u16 d[R][S];
        iq2_rx_load_rows(qm + m * mat_q, dm + m * mat_d, row0, rows, lane, w, d);
        const i64 xo = (i64)yi * sel.x_stride;
        if (xo != x_at) {
            x_at = xo;
            iq2_rx_load_x(xq, xd, xo, lane, x, s);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float acc = 0.f;
#pragma unroll
            for (int k = 0; k < S; ++k)
                acc += iq2_xxs_dot<0>(w[r][k], d[r][k], x[k], s[k], codes, signs);
            acc = warp_sum(acc);
            if (lane == 0 && row0 + r < rows) ym[yi * sel.y_stride + row0 + r] = acc;
        }
    }
    PDL_TRIGGER();
}

KERNEL_PAIR(__launch_bounds__(256, 2), matvec_iq2_xxs_q8_rx, matvec_iq2_xxs_q8_rxe,
            iq2_xxs_q8_rx_body, IQ2_MATVEC_PARAMS, IQ2_MATVEC_ARGS)

// The register-activation IQ2_XXS kernel with its next row unit's weights in flight
// while the current one is computed (`iq2_pipe`): the rx kernel loads a unit, waits,
// computes, and only then loads the next, so each warp's ~3 units a launch pay the
// memory latency one after another, in step with every other warp of the SM. Units of
// R rows (2 here, so that two units' loads fit the registers of 2 blocks per SM), the
// tables built before the PDL wait as in rxe. Per row the same steps, products and
// warp_sum as matvec_iq2_xxs_q8: the same sums.
//
// MODE: 0 = iq2_xxs_dot, 4 = iq2_xxs_dot_tab (same sums, fewer instructions), 5 =
// iq2_xxs_dot_l32 (the 32-copy tables), 6 = iq2_xxs_dot_p64 (the 32-copy tables at a
// 64 KB boundary); probe.cu only: 1 = no table lookups (arithmetic on the weight bits),
// 3 = weight loads only (outputs meaningless).
template <int R, bool PIPE, int MODE>
__device__ __forceinline__ void iq2_xxs_q8_rxp_body(IQ2_MATVEC_PARAMS) {
    constexpr int S = IQ2_RX_STEPS;
    __shared__ __align__(2048) u32 tab[MODE >= 5 ? 1 : 384];  // 256 codes, 128 sign masks
    const u32* codes = tab;
    const u32* signs = tab + 256;
    u32 tl = 0;  // MODE 5 / 6: the 32-copy tables' address | lane · 4
    if constexpr (MODE == 5) {
        extern __shared__ __align__(16) u8 iq2_l32_smem[];
        const u32 base = ((u32)__cvta_generic_to_shared(iq2_l32_smem) + 32767u) & ~32767u;
        u32* t32 = reinterpret_cast<u32*>(iq2_l32_smem + (base - (u32)__cvta_generic_to_shared(
                                                                      iq2_l32_smem)));
        iq2_tables32(t32, grid_g);
        tl = base | (threadIdx.x * 4);
    } else if constexpr (MODE == 6) {
        // The window's 64 KB past 0x10000 and 16 KB past 0xC000 lie inside this block's
        // dynamic shared memory (it starts near 0x400 and is IQ2_PRMT_SMEM long).
        extern __shared__ __align__(16) u8 iq2_p64_smem[];
        const u32 start = (u32)__cvta_generic_to_shared(iq2_p64_smem);
        // A GPU that put the dynamic memory elsewhere would read outside it: stop loudly.
        if (start > 0xC000u || start + IQ2_PRMT_SMEM < 0x20000u) __trap();
        iq2_tables64(iq2_p64_smem - start, grid_g);
        tl = 0x10000u | (threadIdx.x * 4);
    } else {
        iq2_tables(tab, tab + 256, grid_g);
    }
    __syncthreads();
    PDL_WAIT();
    (void)cols;  // S × 32 steps of 64 values (the host checks)
    const int lane = threadIdx.x;
    const int units_per_sel = (rows + R - 1) / R;
    const int n_units = (qs2 != nullptr ? 2 : 1) * n_pair * units_per_sel;
    // Unit u = yi · ups + ru: selection yi (past n_pair: the second stack's), row unit
    // ru. A warp walks a contiguous range of units [u, u_end), so its units mostly share
    // one selection and its activations are read about once: with a walk by the grid's
    // warp count every unit of a step's per-pair inputs (a multi-row or batched step
    // gives each pair its own row: quantize_q8_k32_rep) changed the selection and reloaded them
    // (128 bytes a lane, twice a unit's weight bytes). It advances the quotient and
    // remainder instead of dividing again (two signed divisions a unit were ~50 of its
    // ~690 instructions).
    struct UnitPos {
        int yi, ru;
    };
    const int ups = units_per_sel;
    const i64 warps = (i64)gridDim.x * blockDim.y;
    const i64 wi = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const int u_end = (int)((wi + 1) * n_units / warps);
    constexpr int stride = 1;
    auto advance = [&](UnitPos p) {
        if (++p.ru >= ups) {
            p.ru = 0;
            ++p.yi;
        }
        return p;
    };
    auto id_of = [&](int uu, UnitPos p) -> int {
        if (sel.ids == nullptr || uu >= u_end) return 0;
        return sel.ids[qs2 != nullptr && p.yi >= n_pair ? p.yi - n_pair : p.yi];
    };
    // A unit's weights through one pointer pair: the lane's first 16-byte chunk and
    // first block scale in the unit's first row. Inside a selection the next unit's
    // pair is this one plus R rows (the loads take immediate offsets), so the 64-bit
    // address arithmetic and the expert id's read happen only where a selection starts
    // (they were ~100 of a unit's ~520 instructions when every unit formed them).
    constexpr int nc = S * WARP;  // 16-byte chunks a row
    struct UnitPtr {
        const u8* q;
        const u16* d;
    };
    auto ptr_of = [&](UnitPos p, int m) -> UnitPtr {
        const bool second = qs2 != nullptr && p.yi >= n_pair;
        const i64 row0 = (i64)p.ru * R;
        return {(second ? qs2 : qs) + m * mat_q + row0 * (nc * 16) + lane * 16,
                (second ? dw2 : dw) + m * mat_d + row0 * (nc / 4) + (lane >> 2)};
    };
    // Issues every weight load of the unit at row unit ru from pp into wt, dt. Rows past
    // the matrix's end are not read (zeros; their sums are not stored).
    auto load = [&](UnitPtr pp, int ru, W4 (&wt)[R][S], u16 (&dt)[R][S]) {
        const int left = rows - ru * R;
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int k = 0; k < S; ++k) {
                uint4 v = make_uint4(0, 0, 0, 0);
                u16 d = 0;
                if (r == 0 || r < left) {
                    v = ld_stream16(pp.q + r * (nc * 16) + k * (WARP * 16));
                    d = pp.d[r * (nc / 4) + k * (WARP / 4)];
                }
                wt[r][k].a = v.x; wt[r][k].b = v.y; wt[r][k].c = v.z; wt[r][k].d = v.w;
                dt[r][k] = d;
            }
        }
    };
    int4 x[S][4];
    float s[S][2];
    i64 x_at = -1;
    int u = (int)(wi * n_units / warps);
    // The compute side: the unit at pos, its selection's output row (ym + yi · y_stride).
    UnitPos pos = {u / ups, u - (u / ups) * ups};
    int cur_yi = -1;
    float* yrow = y;
    // The load side: the next unit to load (at ld_pos, through ld_ptr).
    UnitPos ld_pos = pos;
    UnitPtr ld_ptr = ptr_of(pos, id_of(u, pos));
    int ld_u = u;
    auto load_next = [&](W4 (&wt)[R][S], u16 (&dt)[R][S]) {
        load(ld_ptr, ld_pos.ru, wt, dt);
        const UnitPos np = advance(ld_pos);
        ++ld_u;
        if (np.yi != ld_pos.yi) {
            ld_ptr = ptr_of(np, id_of(ld_u, np));
        } else {
            ld_ptr.q += R * (nc * 16);
            ld_ptr.d += R * (nc / 4);
        }
        ld_pos = np;
    };
    // Unit u from (wc, dc) — loaded here unless PIPE — with PIPE the next unit's loads
    // into (wn, dn) issued first. The loop below alternates the two buffers, so no
    // registers are copied between units (38 moves a unit when one buffer was copied).
    auto unit = [&](W4 (&wc)[R][S], u16 (&dc)[R][S], W4 (&wn)[R][S], u16 (&dn)[R][S]) {
        if (!PIPE) load_next(wc, dc);
        if (PIPE && u + stride < u_end) load_next(wn, dn);
        const int row0 = pos.ru * R;
        if (pos.yi != cur_yi) {
            cur_yi = pos.yi;
            int yi = pos.yi;
            float* ym = y;
            if (qs2 != nullptr && yi >= n_pair) {
                yi -= n_pair;
                ym = y2;
            }
            yrow = ym + yi * sel.y_stride;
            const i64 xo = (i64)yi * sel.x_stride;
            if (MODE != 3 && xo != x_at) {
                x_at = xo;
                iq2_rx_load_x(xq, xd, xo, lane, x, s);
            }
        }
        pos = advance(pos);
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] = 0.f;
#pragma unroll
            for (int k = 0; k < S; ++k) {
                if constexpr (MODE == 3)
                    acc[r] += (float)(wc[r][k].a ^ wc[r][k].b ^ wc[r][k].c ^ wc[r][k].d ^ dc[r][k]);
                else if constexpr (MODE == 4)
                    acc[r] += iq2_xxs_dot_tab(wc[r][k], dc[r][k], x[k], s[k], tab);
                else if constexpr (MODE == 5)
                    acc[r] += iq2_xxs_dot_l32(wc[r][k], dc[r][k], x[k], s[k], tl);
                else if constexpr (MODE == 6)
                    acc[r] += iq2_xxs_dot_p64(wc[r][k], dc[r][k], x[k], s[k], tl);
                else
                    acc[r] += iq2_xxs_dot<MODE == 1 ? 1 : 0>(wc[r][k], dc[r][k], x[k], s[k],
                                                             codes, signs);
            }
        }
        // The unit's R sums in one transposed reduction (warp_sum's bits).
        int first;
        warp_sums<R>(acc, first);
        if (warp_sums_writer<R>() && row0 + first < rows) yrow[row0 + first] = acc[0];
    };
    W4 wa[R][S], wb[R][S];
    u16 da[R][S], db[R][S];
    if (PIPE && u < u_end) load_next(wa, da);
    while (u < u_end) {
        unit(wa, da, wb, db);
        u += stride;
        if (u >= u_end) break;
        unit(wb, db, wa, da);
        u += stride;
    }
    PDL_TRIGGER();
}

extern "C" __global__ void __launch_bounds__(256, 2) matvec_iq2_xxs_q8_rxp(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<2, true, 0>(IQ2_MATVEC_ARGS);
}
// `iq2_tab`: units of 4 rows loaded then computed (as rxe), iq2_xxs_dot_tab.
extern "C" __global__ void __launch_bounds__(256, 2) matvec_iq2_xxs_q8_rxt(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<4, false, 4>(IQ2_MATVEC_ARGS);
}
// `iq2_tab` with `iq2_pipe`: pipelined units of 2 rows, iq2_xxs_dot_tab.
extern "C" __global__ void __launch_bounds__(256, 2) matvec_iq2_xxs_q8_rxtp(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<2, true, 4>(IQ2_MATVEC_ARGS);
}

// `iq2_lut32` with `iq2_pipe`: pipelined units of 2 rows, iq2_xxs_dot_l32.
extern "C" __global__ void __launch_bounds__(256, 2) matvec_iq2_xxs_q8_rxtl(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<2, true, 5>(IQ2_MATVEC_ARGS);
}


// `iq2_prmt`: as rxtl with the code lookups' address one PRMT (iq2_xxs_dot_p64); the
// tables need a 64 KB boundary inside the block's shared memory, so one 16-warp block an
// SM (the same 16 warps as rxtl's two 8-warp blocks).
extern "C" __global__ void __launch_bounds__(512, 1) matvec_iq2_xxs_q8_rxtm(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<2, true, 6>(IQ2_MATVEC_ARGS);
}
