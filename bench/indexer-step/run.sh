#!/usr/bin/env bash
# Builds bench.cu against the engine's kernels (the build's concatenation: consts,
# common.cuh, then the .cu files it needs) and runs it. NVCC: the compiler (default
# nvcc on PATH); OUT: where the binary goes (default a temporary folder).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
k=$here/../../crates/cuda/kernels
out=${OUT:-$(mktemp -d)}
nvcc=${NVCC:-nvcc}
{
    cat "$k/ds4_consts.h"
    grep -v 'ds4_consts.h' "$k/common.cuh"
    for f in layer.cu layer_indexer.cu layer_indexer_step.cu matvec.cu matvec_q8act.cu; do grep -v '#include "common.cuh"' "$k/$f"; done
} > "$out/all_kernels.cu"
cp "$here/bench.cu" "$out/"
lib=$(dirname "$(command -v "$nvcc")")/../lib
"$nvcc" -O3 -std=c++17 -arch=sm_90a -diag-suppress 1556 -I"$out" -L"$lib" -cudart static \
    -o "$out/indexer-step-bench" "$out/bench.cu"
"$out/indexer-step-bench"
