// The MTP draft block's input (architecture.md §7): Hin_s = g_s + e for each of the
// n_hc streams, where g_s = h_proj·rmsnorm(G_s) and e = e_proj·rmsnorm(embedding).
#include "common.cuh"

// out[r][i] = x[r][i] + e[i] (e null: a plain copy) for rows r < gridDim.y, i < n;
// out may be x.
extern "C" __global__ void __launch_bounds__(256) mtp_add_rows(float* out, const float* x,
                                                               const float* e, int n) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    out += (i64)blockIdx.y * n;
    x += (i64)blockIdx.y * n;
    for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < n; i += blockDim.x * gridDim.x)
        out[i] = e ? x[i] + e[i] : x[i];
}
