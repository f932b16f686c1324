#!/usr/bin/env bash
# Old vs new binaries on one machine, interleaved (issue 17's "no behaviour change"):
#   bench/ab-binaries.sh OLD_DIR NEW_DIR OUT_DIR [ROUNDS]
# Each dir holds ds4-tool and ds4-bench. Runs the new binary's gpu-selftest, then ROUNDS
# (default 3) pairs of 43-layer synthetic-q2 runs at the 2k frontier (old, new, old, new…),
# each a fresh process (weights generated and uploaded each time, ~20 s). Writes
# selftest.txt, ab.csv (label,round,prefill_tps,gen_tps) and ab.log to OUT_DIR and prints
# the means per binary.
set -uo pipefail
old=$1; new=$2; out=$3; rounds=${4:-3}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 180 "$new/ds4-tool" gpu-selftest > "$out/selftest.txt" 2>&1
echo "selftest rc=$?"; grep -E "FAIL|passed" "$out/selftest.txt" | tail -5
echo "label,round,prefill_tps,gen_tps" > "$out/ab.csv"
for r in $(seq 1 "$rounds"); do
  for label in old new; do
    dir=$old; [ $label = new ] && dir=$new
    timeout 200 "$dir/ds4-bench" --synthetic-weights q2 --layers 43 --ctx-start 2048 \
      --ctx-max 2048 -n 128 --csv "$out/run.csv" >> "$out/ab.log" 2>&1
    echo "$label,$r,$(tail -1 "$out/run.csv" | cut -d, -f3),$(tail -1 "$out/run.csv" | cut -d, -f5)" | tee -a "$out/ab.csv"
  done
done
rm -f "$out/run.csv"
awk -F, 'NR>1 {p[$1]+=$3; g[$1]+=$4; n[$1]++} END {for (k in n) printf "%s: prefill %.1f tok/s, decode %.2f tok/s (mean of %d)\n", k, p[k]/n[k], g[k]/n[k], n[k]}' "$out/ab.csv"
