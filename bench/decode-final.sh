#!/usr/bin/env bash
# One device call for a decode change: the selftest, an A/B at 2k of every
# DS4_CUDA_FUSE setting given (twice each, interleaved), then the frontier walk
# 2k..32k with the first setting that passed (or all fusions off).
#   bench/decode-final.sh BIN_DIR OUT_DIR LAYERS label=fuse-list ...   (fuse-list "all" = unset)
set -uo pipefail
bin=$1; out=$2; layers=$3; shift 3
mkdir -p "$out"
fuse_env() { if [ "$1" = all ]; then echo "-u DS4_CUDA_FUSE"; else echo "DS4_CUDA_FUSE=$1"; fi; }
if "$bin/ds4-tool" gpu-selftest >"$out/selftest.txt" 2>&1; then st=ok; else st=FAILED; fi
echo "selftest: $st ($(grep -E 'passed' "$out/selftest.txt" | tail -1))"
grep -E "^FAIL" "$out/selftest.txt" | head -5
here=$(cd "$(dirname "$0")" && pwd)
for round in 1 2; do
  bash "$here/ab-fuse.sh" "$bin" "$out/round$round" "$layers" 128 "$@" | sed "s/^/round $round: /"
done
first=${1#*=}
[ "$st" = ok ] || first=0
echo "frontier walk with DS4_CUDA_FUSE=$first"
env $(fuse_env "$first") timeout 300 "$bin/ds4-bench" --synthetic-weights q2 --layers "$layers" \
  --ctx-start 2048 --ctx-max 32768 --step-mul 2 -n 64 --csv "$out/frontier.csv" --plot "$out/frontier.svg" 2>"$out/frontier.err"
cat "$out/frontier.csv"
