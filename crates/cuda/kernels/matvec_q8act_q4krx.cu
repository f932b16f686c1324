// The Q4_K expert matvecs with their activations in registers (`q4k_rx`), for rows of
// NS × 1024 columns: 4096 (the routed experts' gate and up, NS = 4) and 2048 (their
// down, NS = 2). The MTP block's experts are Q4_K in the published file, and so are the
// q4 GGUF's; the staged kernel (matvec_q4_k_q8) stages the activation row in shared
// memory per block and walks one row a warp at a time with one row's loads in flight
// (H200, an MTP draft's three expert launches: 18.7 + 18.6 + 16.6 µs, ~1.5 TB/s).
// Here lane l always takes steps l, l + 32, … of a row, as matvec_q4_k_q8's loop does,
// so its activations (two 16-byte halves of two blocks of 32 and their scales a step)
// sit in registers, read once a selection; warps walk contiguous ranges of R-row units
// with all of a unit's loads in flight; with w2 set, the second stack (the experts' up
// beside their gate) takes grid rows n_pair… in the same launch. Per row the same
// steps, integer sums, float expressions and warp_sum as matvec_q4_k_q8: the same bits
// (gpu-selftest's expert line). Follows matvec.cu (q4k_scale_min) and
// matvec_q8act.cu (build.rs concatenates the files in name order).
#include "common.cuh"

#define Q4K_RX_PARAMS                                                                      \
    const u8 *__restrict__ w, i64 mat_blocks, const i8 *__restrict__ xq,                    \
        const float *__restrict__ xd, float *__restrict__ y, int rows, int cols, MatSel sel, \
        const u8 *__restrict__ w2, float *__restrict__ y2, int n_pair
#define Q4K_RX_ARGS w, mat_blocks, xq, xd, y, rows, cols, sel, w2, y2, n_pair

template <int R, int NS>
__device__ __forceinline__ void q4k_rx_body(Q4K_RX_PARAMS) {
    PDL_WAIT();
    constexpr int NB = NS * 4;  // 256-value blocks a row (8 lane steps each)
    (void)cols;                 // NB · 256 (the host checks)
    const int lane = threadIdx.x;
    const int ups = (rows + R - 1) / R;
    const int n_units = (w2 != nullptr ? 2 : 1) * n_pair * ups;
    const i64 warps = (i64)gridDim.x * blockDim.y;
    const i64 wi = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const int u_begin = (int)(wi * n_units / warps), u_end = (int)((wi + 1) * n_units / warps);
    int yi = u_begin / ups, ru = u_begin - (u_begin / ups) * ups;
    // The lane's activations: step k's low-nibble block (2ch) and high-nibble block
    // (2ch + 1) halves, their scales and their sums (the dp4a sums of matvec_q4_k_q8,
    // which do not depend on the weights: summed once a selection).
    int4 xl[NS], xh[NS];
    float sdl[NS], sdh[NS], fsl[NS], fsh[NS];
    int x_yi = -1;
    for (int u = u_begin; u < u_end; ++u, ++ru) {
        if (ru == ups) {
            ru = 0;
            ++yi;
        }
        const bool second = w2 != nullptr && yi >= n_pair;
        const int ys = second ? yi - n_pair : yi;
        const int m = sel.ids ? sel.ids[ys] : 0;
        const u8* wm = second ? w2 : w;
        const int row0 = ru * R;
        W4 hdr[R][NS], q[R][NS];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const u8* base = wm + (m * mat_blocks + (i64)min(row0 + r, rows - 1) * NB) * 144;
#pragma unroll
            for (int k = 0; k < NS; ++k) {
                const int c = lane + k * WARP;
                const int b = c >> 3, ch = (c >> 1) & 3, h = c & 1;
                const u8* blk = base + (i64)b * 144;
                const uint4 hv = ld_stream16(blk);
                const uint4 qv = ld_stream16(blk + 16 + ch * 32 + h * 16);
                hdr[r][k].a = hv.x; hdr[r][k].b = hv.y; hdr[r][k].c = hv.z; hdr[r][k].d = hv.w;
                q[r][k].a = qv.x; q[r][k].b = qv.y; q[r][k].c = qv.z; q[r][k].d = qv.w;
            }
        }
        if (ys != x_yi) {
            x_yi = ys;
            const i8* xr = xq + (i64)ys * sel.x_stride;
            const float* xdr = xd + (i64)ys * (sel.x_stride / 32);
#pragma unroll
            for (int k = 0; k < NS; ++k) {
                const int c = lane + k * WARP;
                const int b = c >> 3, ch = (c >> 1) & 3, h = c & 1;
                const int xb_lo = b * 8 + 2 * ch, xb_hi = xb_lo + 1;
                xl[k] = *reinterpret_cast<const int4*>(xr + xb_lo * 32 + 16 * h);
                xh[k] = *reinterpret_cast<const int4*>(xr + xb_hi * 32 + 16 * h);
                sdl[k] = xdr[xb_lo];
                sdh[k] = xdr[xb_hi];
                const int xls[4] = {xl[k].x, xl[k].y, xl[k].z, xl[k].w};
                const int xhs[4] = {xh[k].x, xh[k].y, xh[k].z, xh[k].w};
                int sl = 0, sh = 0;
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    sl = __dp4a(0x01010101, xls[t], sl);
                    sh = __dp4a(0x01010101, xhs[t], sh);
                }
                fsl[k] = (float)sl;
                fsh[k] = (float)sh;
            }
        }
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] = 0.f;
#pragma unroll
            for (int k = 0; k < NS; ++k) {
                const int c = lane + k * WARP;
                const int ch = (c >> 1) & 3;
                const W4 hd = hdr[r][k];
                const u32 words[4] = {q[r][k].a, q[r][k].b, q[r][k].c, q[r][k].d};
                const float dd = h2f((u16)(hd.a & 0xffff)), dmin = h2f((u16)(hd.a >> 16));
                float sc1, m1, sc2, m2;
                q4k_scale_min(2 * ch, hd.b, hd.c, hd.d, sc1, m1);
                q4k_scale_min(2 * ch + 1, hd.b, hd.c, hd.d, sc2, m2);
                const int xls[4] = {xl[k].x, xl[k].y, xl[k].z, xl[k].w};
                const int xhs[4] = {xh[k].x, xh[k].y, xh[k].z, xh[k].w};
                int ql = 0, qh = 0;
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    ql = __dp4a((int)(words[t] & 0x0f0f0f0fu), xls[t], ql);
                    qh = __dp4a((int)((words[t] >> 4) & 0x0f0f0f0fu), xhs[t], qh);
                }
                acc[r] += sdl[k] * (dd * sc1 * (float)ql - dmin * m1 * fsl[k]) +
                          sdh[k] * (dd * sc2 * (float)qh - dmin * m2 * fsh[k]);
            }
        }
        // The unit's R sums in one transposed reduction (warp_sum's bits).
        int first;
        warp_sums<R>(acc, first);
        float* ym = second ? y2 : y;
        if (warp_sums_writer<R>() && row0 + first < rows)
            ym[(i64)ys * sel.y_stride + row0 + first] = acc[0];
    }
    PDL_TRIGGER();
}

// 4096 columns (gate, up): units of one row (two spill at 128 registers); 2048 (down):
// units of 4. (The launcher's iq2_rx_units keeps these.)
extern "C" __global__ void __launch_bounds__(256, 2) matvec_q4_k_q8_rx4(Q4K_RX_PARAMS) {
    q4k_rx_body<1, 4>(Q4K_RX_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 2) matvec_q4_k_q8_rx2(Q4K_RX_PARAMS) {
    q4k_rx_body<4, 2>(Q4K_RX_ARGS);
}
