// The undo record of a multi-row decode step (engine: cuda/state/rows.rs). Items are
// five i64 each: {state, saved, floats, ring_cap, row}. A ring item (ring_cap > 0) is a
// layer's raw KV ring: the slots of the step's rows [first, n_rows) (positions from the
// step buffer, slot = pos % ring_cap, `row` floats each) go to / come back from saved
// row i. Any other item is a whole buffer of `floats` (a compressor frontier).
// restore = 0 saves state → saved, 1 puts saved → state. grid: (items, splits).
extern "C" __global__ void rows_undo(const long long* __restrict__ items, int n_items,
                                     const int* __restrict__ step, int first, int n_rows,
                                     int restore) {
    const int it = blockIdx.x;
    if (it >= n_items) return;
    const long long* e = items + 5 * it;
    float* state = (float*)e[0];
    float* saved = (float*)e[1];
    const long long floats = e[2];
    const long long cap = e[3];
    const long long row = e[4];
    const long long tid = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    const long long nthreads = (long long)gridDim.y * blockDim.x;
    if (cap > 0) {
        for (int i = first; i < n_rows; ++i) {
            const long long slot = (long long)step[2 * i] % cap;
            float* s = state + slot * row;
            float* d = saved + (long long)i * row;
            for (long long k = tid; k < row; k += nthreads) {
                if (restore) s[k] = d[k]; else d[k] = s[k];
            }
        }
    } else if ((floats & 3) == 0 && (((long long)state | (long long)saved) & 15) == 0) {
        float4* s4 = (float4*)state;
        float4* d4 = (float4*)saved;
        for (long long k = tid; k < floats / 4; k += nthreads) {
            if (restore) s4[k] = d4[k]; else d4[k] = s4[k];
        }
    } else {
        for (long long k = tid; k < floats; k += nthreads) {
            if (restore) state[k] = saved[k]; else saved[k] = state[k];
        }
    }
}
