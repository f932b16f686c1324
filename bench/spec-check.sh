#!/usr/bin/env bash
# Issue 20 on one GPU machine, in one call (session 13 left these unrun):
#   bench/spec-check.sh BIN_DIR OUT_DIR [MULTIROW_TEST_BINARY]
# BIN_DIR holds release ds4-tool and ds4-bench. Runs, each with a time limit so one hang
# cannot eat the device budget:
#   1. `ds4-tool gpu-selftest` (kernels incl. `tokens`, the tiny fixtures in both tiers,
#      the CUDA MTP draft against the CPU block, the CUDA speculative greedy identity);
#   2. the multirow test binary when given (needs the repo at its build path:
#      `mkdir -p /work && ln -s "$PWD" /work/main` for a binary built in /work/main);
#   3. greedy identity with accepting drafts in Exact numerics (6 layers, 512 tokens,
#      `--accept-rate 0.8,0.6`: ds4-bench errors under --quality on a mismatch);
#   4. #20's acceptance rows, synthetic q2, 43 layers: 2k with --rows 2/3/4 and MTP
#      draft 1 at 0.8 and draft 2 at 0.8,0.6; 32k with MTP draft 1 at 0.8.
# Writes one CSV per run and its log to OUT_DIR; prints the CSVs.
set -uo pipefail
bin=$1; out=$2; multirow=${3:-}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 120 "$bin/ds4-tool" gpu-selftest > "$out/selftest.txt" 2>&1
echo "selftest rc=$?"; grep -E "FAIL|passed" "$out/selftest.txt" | tail -12
if [ -n "$multirow" ]; then
  timeout 150 "$multirow" --test-threads 1 > "$out/multirow.txt" 2>&1
  echo "multirow rc=$?"; grep -E "test result|panicked" "$out/multirow.txt"
fi
bench() { # NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$bin/ds4-bench" --synthetic-weights q2 "$@" --csv "$out/$name.csv" \
    > "$out/$name.log" 2>&1
  echo "== $name rc=$? ($*)"; cat "$out/$name.csv" 2>/dev/null
  grep -iE "warn|error" "$out/$name.log" | head -3
}
bench identity-exact 120 --quality --layers 6 --ctx-start 2048 --ctx-max 2048 -n 512 \
  --synthetic-mtp --mtp-draft 2 --accept-rate 0.8,0.6
bench rows2-draft1 120 --ctx-start 2048 --ctx-max 2048 -n 128 --rows 2 \
  --synthetic-mtp --mtp-draft 1 --accept-rate 0.8
bench rows3-draft2 120 --ctx-start 2048 --ctx-max 2048 -n 128 --rows 3 \
  --synthetic-mtp --mtp-draft 2 --accept-rate 0.8,0.6
bench rows4 100 --ctx-start 2048 --ctx-max 2048 -n 128 --rows 4
bench 32k-draft1 160 --ctx-start 32768 --ctx-max 32768 -n 128 \
  --synthetic-mtp --mtp-draft 1 --accept-rate 0.8
