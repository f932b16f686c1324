// Read-bandwidth probe: the ceiling a weight-streaming kernel can reach on this GPU
// (`ds4-tool gpu-selftest --probe-q8`).
#include "common.cuh"

// Sums every 16-byte word of `n16` words (grid-stride, 4 loads in flight per thread).
extern "C" __global__ void __launch_bounds__(256) probe_stream_read(const uint4* __restrict__ p,
                                                                    i64 n16,
                                                                    u32* __restrict__ out) {
    PDL_WAIT();
    const i64 stride = (i64)gridDim.x * blockDim.x;
    u32 acc = 0;
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = __ldg(p + i + k * stride);
#pragma unroll
        for (int k = 0; k < 4; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    // Practically never true; keeps the loads alive.
    if (acc == 0x9e3779b9u) out[0] = acc;
}

// Does nothing: a graph of these measures the per-node launch cost of a decode token.
extern "C" __global__ void probe_empty(int unused) {
    PDL_WAIT(); (void)unused; }

// Busy-waits `ns` nanoseconds: DS4_CUDA_PROFILE holds the stream with it while the host
// enqueues the launches it times.
extern "C" __global__ void probe_spin(u64 ns) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

// The IQ2_XXS expert matvec with parts of its work taken out (iq2_xxs_step's PROBE):
// gpu-selftest --probe-q8 times them against the real kernel. Outputs are meaningless.
extern "C" __global__ void __launch_bounds__(256, 3) probe_iq2_nolut(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_body<1>(IQ2_MATVEC_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 3) probe_iq2_nox(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_body<2>(IQ2_MATVEC_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 3) probe_iq2_loads(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_body<3>(IQ2_MATVEC_ARGS);
}

// The register-activation kernel's structure (iq2_xxs_q8_rxp_body) without lookups /
// with loads only, units of 4 rows loaded then computed (as matvec_iq2_xxs_q8_rxe) or 2
// rows pipelined (as matvec_iq2_xxs_q8_rxp); and the pipelined kernel at 4 rows a unit
// and one block per SM (the registers of two units of 4).
extern "C" __global__ void __launch_bounds__(256, 2) probe_iq2_rx_nolut(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<4, false, 1>(IQ2_MATVEC_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 2) probe_iq2_rx_loads(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<4, false, 3>(IQ2_MATVEC_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 2) probe_iq2_rxp_nolut(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<2, true, 1>(IQ2_MATVEC_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 2) probe_iq2_rxp_loads(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<2, true, 3>(IQ2_MATVEC_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 1) probe_iq2_rxp4(IQ2_MATVEC_PARAMS) {
    iq2_xxs_q8_rxp_body<4, true, 0>(IQ2_MATVEC_ARGS);
}
