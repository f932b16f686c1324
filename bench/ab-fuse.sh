#!/usr/bin/env bash
# A/B of DS4_CUDA_FUSE settings, decode at the 2k frontier:
#   bench/ab-fuse.sh BIN_DIR OUT_DIR LAYERS N label=fuse-list ...   (fuse-list "all" = unset)
# Prints "label tok/s" per setting; CSVs and stderr land in OUT_DIR as ab-LABEL.*.
set -uo pipefail
bin=$1; out=$2; layers=$3; n=$4; shift 4
mkdir -p "$out"
for spec in "$@"; do
  label=${spec%%=*}; fuse=${spec#*=}
  if [ "$fuse" = all ]; then e=(env -u DS4_CUDA_FUSE); else e=(env DS4_CUDA_FUSE="$fuse"); fi
  "${e[@]}" timeout 200 "$bin/ds4-bench" --synthetic-weights q2 --layers "$layers" \
    --ctx-start 2048 --ctx-max 2048 -n "$n" --csv "$out/ab-$label.csv" 2>"$out/ab-$label.err" >/dev/null
  echo "$label $(tail -1 "$out/ab-$label.csv" | cut -d, -f5)"
done
