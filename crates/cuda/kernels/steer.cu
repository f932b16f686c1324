// Directional steering (engine: crate::steer, cuda/state/layers.rs; architecture.md §8
// item 17). One block per token row of n_embd floats at x (rows n_embd apart). With
// `parts` (n_parts rows of n_embd per token), the row first becomes their sum plus x,
// in hc_post's order and rounding (the FFN output: the routed experts' weighted rows in
// order k, then the shared expert at x), and is written back, so the engine then runs
// hc_post without parts. Then x −= (scale·(d·x))·d with d the layer's direction (the
// reference's order: the product of scale and the dot first).
extern "C" __global__ void __launch_bounds__(1024) steer_rows(float* x, const float* parts,
                                                              int n_parts, const float* dir,
                                                              float scale, int n_embd) {
    PDL_WAIT();
    PDL_TRIGGER();  // single-wave kernel: let the next grid launch now
    __shared__ float red[32];
    x += (i64)blockIdx.x * n_embd;
    if (parts) parts += (i64)blockIdx.x * n_parts * n_embd;
    float acc = 0.f;
    for (int d = threadIdx.x; d < n_embd; d += blockDim.x) {
        float o = x[d];
        if (parts) {
            float s = 0.f;
            for (int k = 0; k < n_parts; ++k) s += parts[(i64)k * n_embd + d];
            o = s + o;
            x[d] = o;
        }
        acc = __fmaf_rn(o, dir[d], acc);
    }
    acc = warp_sum(acc);
    if ((threadIdx.x & (WARP - 1)) == 0) red[threadIdx.x / WARP] = acc;
    __syncthreads();
    if (threadIdx.x < WARP) {
        float v = threadIdx.x < blockDim.x / WARP ? red[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    const float coeff = scale * red[0];
    for (int d = threadIdx.x; d < n_embd; d += blockDim.x)
        x[d] = __fsub_rn(x[d], __fmul_rn(coeff, dir[d]));
}
