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

// Reads n_chunks chunks of `chunk` bytes by bulk copies (cp.async.bulk, the TMA's 1-D
// form) into a ring of `stages` shared-memory buffers, one mbarrier a stage: block b
// takes chunks b, b + grid, … One thread issues the copies; the block then touches one
// word a thread of each landed chunk (so the copy is consumed) and frees its stage. The
// question it answers: whether bulk copies stream a 4–36 MB matrix closer to the read
// ceiling than a grid of 16-byte loads (the decode matvecs' form).
extern "C" __global__ void __launch_bounds__(128) probe_bulk_read(const u8* __restrict__ p,
                                                                  i64 n_chunks, int chunk,
                                                                  int stages,
                                                                  u32* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 ring[];
    __shared__ __align__(8) u64 bar[16];
    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < stages; ++s) {
            const u32 a = (u32)__cvta_generic_to_shared(&bar[s]);
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    PDL_WAIT();
    const i64 first = blockIdx.x, stride = gridDim.x;
    auto issue = [&](i64 c, int s) {
        const u32 b = (u32)__cvta_generic_to_shared(&bar[s]);
        const u32 dst = (u32)__cvta_generic_to_shared(ring + (i64)s * chunk);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b),
                     "r"(chunk)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(dst),
            "l"(p + c * chunk), "r"(chunk), "r"(b)
            : "memory");
    };
    if (tid == 0)
        for (int s = 0; s < stages && first + s * stride < n_chunks; ++s)
            issue(first + s * stride, s);
    u32 acc = 0;
    int k = 0;
    for (i64 c = first; c < n_chunks; c += stride, ++k) {
        const int s = k % stages;
        const u32 phase = (u32)(k / stages) & 1u;
        const u32 b = (u32)__cvta_generic_to_shared(&bar[s]);
        u32 done = 0;
        while (!done)
            asm volatile(
                "{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; "
                "selp.u32 %0, 1, 0, q; }"
                : "=r"(done)
                : "r"(b), "r"(phase)
                : "memory");
        acc ^= reinterpret_cast<const u32*>(ring + (i64)s * chunk)[tid];
        __syncthreads();
        const i64 next = c + (i64)stages * stride;
        if (tid == 0 && next < n_chunks) issue(next, s);
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
#else
    __trap();
#endif
}
