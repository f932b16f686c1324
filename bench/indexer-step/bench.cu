// Stand-alone timing of a decode token's indexer: the three-launch chain
// (indexer_q_warp, indexer_scores_sp, topk_select_rg) against indexer_step, each as a
// CUDA graph of 20 launches (PDL off), at 525 to 8,192 live rows; checks that both give
// the same scores and selection. Build and run with bench/indexer-step/run.sh (nvcc and
// a GPU; the binary is stand-alone). Grid as the launcher sets it for a 132-SM H200.
#include "all_kernels.cu"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
int main() {
    const int H = 64, D = 128, K = 512, RATIO = 4, NSM = 132;
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int NMAX = 131072 / RATIO + 64;
    std::vector<float> q(H * D), rows((size_t)NMAX * D), wt(H), freqs(32);
    for (auto& v : q) v = nd(rng);
    const float e2m1[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (size_t i = 0; i < rows.size(); i += 32) {
        float s = ldexpf(1.f, (int)(rng() % 4) - 3);
        for (int j = 0; j < 32; ++j) rows[i + j] = e2m1[rng() % 8] * s * ((rng() & 1) ? -1.f : 1.f);
    }
    for (auto& v : wt) v = nd(rng);
    for (int i = 0; i < 32; ++i) freqs[i] = powf(10000.f, -(float)i / 32.f);
    float *d_q, *d_qi, *d_rows, *d_wt, *d_fr, *d_sc1, *d_sc2;
    int *d_sel1, *d_sel2; unsigned* d_done; Step* d_step;
    CK(cudaMalloc(&d_q, q.size() * 4)); CK(cudaMalloc(&d_qi, q.size() * 4));
    CK(cudaMalloc(&d_rows, rows.size() * 4)); CK(cudaMalloc(&d_wt, 256)); CK(cudaMalloc(&d_fr, 128));
    CK(cudaMalloc(&d_sc1, NMAX * 4)); CK(cudaMalloc(&d_sc2, NMAX * 4));
    CK(cudaMalloc(&d_sel1, K * 4)); CK(cudaMalloc(&d_sel2, K * 4));
    CK(cudaMalloc(&d_done, 64)); CK(cudaMemset(d_done, 0, 64)); CK(cudaMalloc(&d_step, 8));
    CK(cudaMemcpy(d_q, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_rows, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_wt, wt.data(), 256, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_fr, freqs.data(), 128, cudaMemcpyHostToDevice));
    RopeP rp; rp.freqs = d_fr; rp.rope_dim = 64; rp.pad = 0;
    const float wscale = (float)(pow(128., -0.5) * pow(64., -0.5));
    const int smem_old = (2 * 128 * 68 + 16 * 64) * 4;
    CK(cudaFuncSetAttribute(indexer_scores_sp, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_old));
    cudaStream_t st; CK(cudaStreamCreate(&st));
    CK(cudaFuncSetAttribute(indexer_step, cudaFuncAttributeMaxDynamicSharedMemorySize, IXS_SMEM));
    int ctxs[] = {2100, 4096, 8192, 16384, 24576, 32768};
    for (int ctx : ctxs) {
        Step s; s.pos = ctx - 1; s.token = 0;
        CK(cudaMemcpy(d_step, &s, 8, cudaMemcpyHostToDevice));
        const int n = ctx / RATIO, max_rows = n + 2;
        const int g_old = (max_rows + 63) / 64;
        // The launcher's grid (Launcher::indexer_step).
        const int tiles = std::max((std::min(max_rows, IXS_NARROW_MAX) + 15) / 16, (max_rows + IXS_ROWS - 1) / IXS_ROWS);
        const int cap = std::min(NSM / 2, 8 * IXS_CLUSTER) / IXS_CLUSTER * IXS_CLUSTER;
        const int g_new = (std::max(1, std::min(tiles, cap)) + IXS_CLUSTER - 1) / IXS_CLUSTER * IXS_CLUSTER;
        auto old_chain = [&]() {
            indexer_q_warp<<<8, 256, 0, st>>>(d_step, d_qi, H, rp);
            indexer_scores_sp<<<dim3(g_old, 1), 256, smem_old, st>>>(d_step, d_rows, d_qi, d_wt, H, D, wscale, RATIO, K, d_sc1, max_rows, nullptr);
            topk_select_rg<<<dim3(1, 1), 1024, 0, st>>>(d_step, d_sc1, max_rows, RATIO, K, d_sel1);
        };
        auto new_chain = [&]() {
            indexer_step<<<dim3(g_new, 1), 256, IXS_SMEM, st>>>(d_step, d_rows, d_q, rp, d_wt, wscale, RATIO, K, d_sc2, max_rows, d_sel2, d_done, nullptr);
        };
        CK(cudaMemcpyAsync(d_qi, d_q, q.size() * 4, cudaMemcpyDeviceToDevice, st));
        CK(cudaMemsetAsync(d_sc1, 0, NMAX * 4, st)); CK(cudaMemsetAsync(d_sc2, 0, NMAX * 4, st));
        old_chain(); new_chain();
        CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
        std::vector<float> s1(n), s2(n); std::vector<int> l1(K), l2(K);
        CK(cudaMemcpy(s1.data(), d_sc1, n * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(s2.data(), d_sc2, n * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(l1.data(), d_sel1, K * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(l2.data(), d_sel2, K * 4, cudaMemcpyDeviceToHost));
        int bad_s = 0, bad_l = 0;
        for (int i = 0; i < n; ++i) bad_s += memcmp(&s1[i], &s2[i], 4) != 0;
        for (int i = 0; i < K; ++i) bad_l += l1[i] != l2[i];
        // timing: a graph of 20 chains each
        float t[5];
        for (int w = 0; w < 5; ++w) {
            cudaGraph_t gr; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < 20; ++i) {
                if (w == 0) old_chain(); else if (w == 1) new_chain();
                else if (w == 2) indexer_q_warp<<<8, 256, 0, st>>>(d_step, d_qi, H, rp);
                else if (w == 3) indexer_scores_sp<<<dim3(g_old, 1), 256, smem_old, st>>>(d_step, d_rows, d_qi, d_wt, H, D, wscale, RATIO, K, d_sc1, max_rows, nullptr);
                else topk_select_rg<<<dim3(1, 1), 1024, 0, st>>>(d_step, d_sc1, max_rows, RATIO, K, d_sel1);
            }
            CK(cudaStreamEndCapture(st, &gr)); CK(cudaGraphInstantiate(&ge, gr, 0));
            for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
            cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
            cudaEventRecord(a, st);
            for (int i = 0; i < 50; ++i) CK(cudaGraphLaunch(ge, st));
            cudaEventRecord(b, st); CK(cudaEventSynchronize(b));
            float ms; cudaEventElapsedTime(&ms, a, b); t[w] = ms * 1000.f / (50 * 20);
        }
        printf("ctx %6d n %5d  old %6.2f us (q %.2f sc %.2f tk %.2f)  new %6.2f us (grid %d)  score diffs %d  sel diffs %d\n", ctx, n, t[0], t[2], t[3], t[4], t[1], g_new, bad_s, bad_l);
    }
    return 0;
}
