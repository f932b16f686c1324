#!/usr/bin/env bash
# Kernel timeline of decode at 2k on a lent GPU (DS4_CUDA_TRACE, CUPTI):
#   bench/decode-trace.sh BIN_DIR OUT_DIR [LAYERS] [FUSE]
# BIN_DIR holds ds4-bench and libcupti.so.13 (from the nvidia-cuda-cupti==13.0.* wheel);
# FUSE, when given, is the DS4_CUDA_FUSE setting to trace. Writes OUT/trace.csv and
# prints bench/trace-summary.py's summary of one decode token (its timeline goes to
# OUT/timeline.txt).
set -euo pipefail
bin=${1:?usage: decode-trace.sh BIN_DIR OUT_DIR [LAYERS] [FUSE]}
out=${2:?usage: decode-trace.sh BIN_DIR OUT_DIR [LAYERS] [FUSE]}
layers=${3:-43}
mkdir -p "$out"
fuse=()
[ -n "${4:-}" ] && fuse=(DS4_CUDA_FUSE="$4")
here=$(cd "$(dirname "$0")" && pwd)
env "${fuse[@]}" LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    DS4_CUDA_TRACE="$out/trace.csv" timeout 300 "$bin/ds4-bench" --synthetic-weights q2 \
    --layers "$layers" --ctx-start 2048 --ctx-max 2048 -n 8 --csv "$out/trace-bench.csv"
python3 "$here/trace-summary.py" "$out/trace.csv"
python3 "$here/trace-summary.py" "$out/trace.csv" --timeline > "$out/timeline.txt"
