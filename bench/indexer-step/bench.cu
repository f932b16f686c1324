// Stand-alone timing of a decode token's indexer: the three-launch chain
// (indexer_q_warp, indexer_scores_sp, topk_select_rg) against indexer_step, each as a
// CUDA graph of 20 launches (PDL off), at 525 to 8,192 live rows; checks that both give
// the same scores and selection. Build and run with bench/indexer-step/run.sh (nvcc and
// a GPU; the binary is stand-alone). Grid as the launcher sets it for a 132-SM H200.
// Then the same beside the attention's q_b product on another stream ("contended").
#include "all_kernels.cu"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

static const int H = 64, D = 128, K = 512, RATIO = 4, NSM = 132;
static const int SMEM_OLD = (2 * 128 * 68 + 16 * 64) * 4;  // indexer_scores_sp's

// The token's inputs and both paths' outputs (chain: qi, sc1, sel1; fused: sc2, sel2).
struct Ix {
    Step* step; float *rows, *q, *qi, *wt; RopeP rp; float wscale;
    float *sc1, *sc2; int *sel1, *sel2; unsigned* done;
    // The three-launch chain on stream s.
    void chain(int max_rows, cudaStream_t s) const {
        indexer_q_warp<<<8, 256, 0, s>>>(step, qi, H, rp);
        indexer_scores_sp<<<dim3((max_rows + 63) / 64, 1), 256, SMEM_OLD, s>>>(step, rows, qi, wt, H, D, wscale, RATIO, K, sc1, max_rows, nullptr);
        topk_select_rg<<<dim3(1, 1), 1024, 0, s>>>(step, sc1, max_rows, RATIO, K, sel1);
    }
    // indexer_step on stream s, with the launcher's grid (Launcher::indexer_step).
    static int grid(int max_rows) {
        const int tiles = std::max((std::min(max_rows, IXS_NARROW_MAX) + 15) / 16, (max_rows + IXS_ROWS - 1) / IXS_ROWS);
        const int cap = std::min(NSM / 2, 8 * IXS_CLUSTER) / IXS_CLUSTER * IXS_CLUSTER;
        return (std::max(1, std::min(tiles, cap)) + IXS_CLUSTER - 1) / IXS_CLUSTER * IXS_CLUSTER;
    }
    void fused(int max_rows, cudaStream_t s) const {
        indexer_step<<<dim3(grid(max_rows), 1), 256, IXS_SMEM, s>>>(step, rows, q, rp, wt, wscale, RATIO, K, sc2, max_rows, sel2, done, nullptr);
    }
};

// ---- Contended: the indexer beside the attention's q_b product, as in the decode
// graph. There the main lane's q_b (matvec_q8_0_q8_r4, 32,768 rows × 1,024 Q8_0, ~36 MB,
// 1,024 blocks, background priority) starts a few µs before the indexer lane's
// selection, and an in-graph trace put indexer_step at 18–19 µs against ~11.4 alone
// (NOTES session 34). Each repetition: q_b on one stream (weights rotated over 4
// copies, past the L2), on another a spin of DELAY µs then the indexer (chain or
// fused), joined; µs a repetition for each alone and both together.
__global__ void ixb_spin(long ns) {
    long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
static void contended(cudaStream_t st, const Ix& ix) {
    const int QB_ROWS = 32768, QB_COLS = 1024, COPIES = 4;
    const size_t wq = (size_t)QB_ROWS * QB_COLS, wd = (size_t)QB_ROWS * QB_COLS / 32;
    i8 *d_wq, *d_xq; u16* d_wd; float *d_xd, *d_y;
    CK(cudaMalloc(&d_wq, wq * COPIES)); CK(cudaMalloc(&d_wd, wd * 2 * COPIES));
    CK(cudaMalloc(&d_xq, QB_COLS)); CK(cudaMalloc(&d_xd, QB_COLS / 32 * 4)); CK(cudaMalloc(&d_y, QB_ROWS * 4));
    {
        std::vector<i8> hq(wq * COPIES); std::vector<u16> hd(wd * COPIES, 0x2000);  // f16 2^-7
        std::mt19937 r(3);
        for (auto& v : hq) v = (i8)(r() % 255 - 127);
        CK(cudaMemcpy(d_wq, hq.data(), hq.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_wd, hd.data(), hd.size() * 2, cudaMemcpyHostToDevice));
        std::vector<i8> xq(QB_COLS); std::vector<float> xd(QB_COLS / 32, 0.01f);
        for (auto& v : xq) v = (i8)(r() % 255 - 127);
        CK(cudaMemcpy(d_xq, xq.data(), QB_COLS, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_xd, xd.data(), xd.size() * 4, cudaMemcpyHostToDevice));
    }
    // The indexer at the greatest priority, q_b at the least (the engine's `prio`).
    int least, greatest; CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t sa, sb;
    CK(cudaStreamCreateWithPriority(&sa, cudaStreamNonBlocking, greatest));
    CK(cudaStreamCreateWithPriority(&sb, cudaStreamNonBlocking, least));
    cudaEvent_t fork, joined; CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming)); CK(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming));
    const int delay_ns = 5000;
    int ctxs[] = {2100, 8192, 32768};
    for (int ctx : ctxs) {
        Step s; s.pos = ctx - 1; s.token = 0;
        CK(cudaMemcpy(ix.step, &s, 8, cudaMemcpyHostToDevice));
        const int n = ctx / RATIO, max_rows = n + 2;
        float t[5];
        // w: 0 q_b alone, 1 chain alone, 2 fused alone, 3 q_b + chain, 4 q_b + fused.
        for (int w = 0; w < 5; ++w) {
            cudaGraph_t gr; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < 20; ++i) {
                CK(cudaEventRecord(fork, st));
                CK(cudaStreamWaitEvent(sa, fork)); CK(cudaStreamWaitEvent(sb, fork));
                if (w == 0 || w >= 3) {
                    const int c = i % COPIES;
                    MatSel sel; sel.ids = nullptr; sel.x_stride = 0; sel.y_stride = 0;
                    matvec_q8_0_q8_r4<<<dim3(QB_ROWS / 32, 1), dim3(32, 8), 0, sb>>>(
                        d_wq + wq * c, (const u16*)(d_wd + wd * c), 0, 0, d_xq, d_xd, d_y, QB_ROWS, QB_COLS, sel, 1);
                }
                if (w >= 1) {
                    ixb_spin<<<1, 32, 0, sa>>>(delay_ns);
                    if (w == 1 || w == 3)
                        ix.chain(max_rows, sa);
                    else
                        ix.fused(max_rows, sa);
                }
                CK(cudaEventRecord(joined, sa)); CK(cudaStreamWaitEvent(st, joined));
                CK(cudaEventRecord(joined, sb)); CK(cudaStreamWaitEvent(st, joined));
            }
            // Node priorities as the engine's graphs use them (captured from the streams').
            CK(cudaStreamEndCapture(st, &gr));
            CK(cudaGraphInstantiateWithFlags(&ge, gr, cudaGraphInstantiateFlagUseNodePriority));
            for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
            cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
            cudaEventRecord(a, st);
            for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, st));
            cudaEventRecord(b, st); CK(cudaEventSynchronize(b));
            float ms; cudaEventElapsedTime(&ms, a, b); t[w] = ms * 1000.f / (20 * 20);
            CK(cudaGraphExecDestroy(ge)); CK(cudaGraphDestroy(gr));
        }
        printf("contended ctx %6d n %5d  q_b %6.2f  chain %6.2f  fused %6.2f  (after a %.0f us spin)  q_b+chain %6.2f  q_b+fused %6.2f us\n",
               ctx, n, t[0], t[1], t[2], delay_ns / 1000.0, t[3], t[4]);
    }
}

int main() {
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
    CK(cudaFuncSetAttribute(indexer_scores_sp, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_OLD));
    cudaStream_t st; CK(cudaStreamCreate(&st));
    CK(cudaFuncSetAttribute(indexer_step, cudaFuncAttributeMaxDynamicSharedMemorySize, IXS_SMEM));
    const Ix ix{d_step, d_rows, d_q, d_qi, d_wt, rp, wscale, d_sc1, d_sc2, d_sel1, d_sel2, d_done};
    int ctxs[] = {2100, 4096, 8192, 16384, 24576, 32768, 32900, 49152, 65536, 131072};
    for (int ctx : ctxs) {
        Step s; s.pos = ctx - 1; s.token = 0;
        CK(cudaMemcpy(d_step, &s, 8, cudaMemcpyHostToDevice));
        const int n = ctx / RATIO, max_rows = n + 2;
        const int g_old = (max_rows + 63) / 64, g_new = Ix::grid(max_rows);
        auto old_chain = [&]() { ix.chain(max_rows, st); };
        auto new_chain = [&]() { ix.fused(max_rows, st); };
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
                else if (w == 3) indexer_scores_sp<<<dim3(g_old, 1), 256, SMEM_OLD, st>>>(d_step, d_rows, d_qi, d_wt, H, D, wscale, RATIO, K, d_sc1, max_rows, nullptr);
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
    contended(st, ix);
    return 0;
}
