#!/usr/bin/env bash
# First device run of the opt-in kernel variants (crates/cuda/NOTES.md, session 8; run
# in session 9, whose results are in bench/results/session9/: all but exp_pitch are
# defaults now, so the `+name` settings below repeat the defaults):
#   bench/variants-first-run.sh BIN_DIR OUT_DIR
# BIN_DIR holds ds4-tool, ds4-bench (and libcupti.so.13 for traces). Writes at most six
# files to OUT_DIR: selftest.txt, ab.csv, ab.log, walk.csv, walk-idx_mma.csv, walk.log.
# About 3 minutes on an H200 (q2, 43 layers); each step has its own time limit, so a
# hang costs that step only.
set -uo pipefail
bin=$1; out=$2
mkdir -p "$out"
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

# 1. Correctness first: every variant's bit-identity line.
timeout 120 "$bin/ds4-tool" gpu-selftest > "$out/selftest.txt" 2>&1
echo "selftest rc=$?"
grep -E "FAIL|_pl |_sp |_rg |_warp|_early|_split|_rxe|_mma|_p |_w =|passed" "$out/selftest.txt"

# 2. Every decode/prefill variant against the defaults in one process (2k frontier).
all="+hc_preload,+idx_banks,+topk_reg,+combine_pl,+norm_pl,+idxq_warp,+att_early"
all="$all,+router_split,+iq2_early,+mm_pitch,+exp_pitch"
timeout 240 "$bin/ds4-bench" --synthetic-weights q2 --layers 43 --ctx-start 2048 \
  --ctx-max 2048 -n 128 --rounds 3 --csv "$out/ab.csv" \
  --fuse-ab all=all --fuse-ab hc=+hc_preload --fuse-ab idx=+idx_banks \
  --fuse-ab topk=+topk_reg --fuse-ab comb=+combine_pl --fuse-ab norm=+norm_pl \
  --fuse-ab idxq=+idxq_warp --fuse-ab early=+att_early --fuse-ab rsplit=+router_split \
  --fuse-ab iq2e=+iq2_early --fuse-ab pitch=+mm_pitch --fuse-ab expp=+exp_pitch \
  --fuse-ab new="$all" \
  > "$out/ab.log" 2>&1
echo "fuse-ab rc=$?"
grep -E "^ds4-bench: (decode|prefill)|failed" "$out/ab.log"

# 3. The context walk with the defaults, then with the tensor-core indexer (prefill
#    past 2k is where the indexer works).
walk() {
  timeout 180 "$bin/ds4-bench" --synthetic-weights q2 --layers 43 --ctx-start 2048 \
    --ctx-max 32768 --step-mul 2 -n 64 --csv "$1" >> "$out/walk.log" 2>&1
  echo "walk $1 rc=$?"
  cat "$1"
}
walk "$out/walk.csv"
DS4_CUDA_FUSE=+idx_mma walk "$out/walk-idx_mma.csv"
