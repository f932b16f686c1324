#!/usr/bin/env bash
# Decode diagnosis on a lent GPU, in one call: the selftest, the kernel probes, and
# ds4-bench decode at 2k for each DS4_CUDA_SKIP kernel (its share inside the decode
# graph). Everything lands in OUT as CSV / text; a summary goes to stdout.
#
#   bench/decode-diagnosis.sh BIN_DIR OUT_DIR [LAYERS] [STAGES]
#
# BIN_DIR holds ds4-tool and ds4-bench (release builds). LAYERS defaults to 8 (each
# bench then takes ~15 s instead of ~55 s at 36; the output head weighs more, so read
# shares, not tok/s; 43 fits only an H200). STAGES is a comma list of selftest, probe,
# skip (default: all; ~7 min on an H100 at 8 layers). Compare numbers only
# within one run of this script.
set -euo pipefail

bin=${1:?usage: decode-diagnosis.sh BIN_DIR OUT_DIR [LAYERS] [STAGES]}
out=${2:?usage: decode-diagnosis.sh BIN_DIR OUT_DIR [LAYERS] [STAGES]}
layers=${3:-8}
stages=${4:-selftest,probe,skip}
mkdir -p "$out"

want() { [[ ",$stages," == *",$1,"* ]]; }

# ds4-bench decode at the 2k frontier with extra environment; prints "label tok/s".
bench() {
    local label=$1
    shift
    local csv="$out/bench-$label.csv"
    if env "$@" timeout 180 "$bin/ds4-bench" --synthetic-weights q2 --layers "$layers" \
        --ctx-start 2048 --ctx-max 2048 -n 64 --csv "$csv" 2>"$out/bench-$label.err"; then
        echo "$label $(tail -1 "$csv" | cut -d, -f5)"
    else
        echo "$label FAILED (see bench-$label.err)"
    fi
}

if want selftest; then
    if "$bin/ds4-tool" gpu-selftest >"$out/selftest.txt" 2>&1; then r=ok; else r=FAILED; fi
    echo "selftest: $r ($(grep -E 'passed' "$out/selftest.txt" | tail -1))"
fi

if want probe; then
    "$bin/ds4-tool" gpu-selftest --probe-q8 >"$out/probe-q8.txt" 2>&1 || true
    grep -E "IQ2_XXS|Q2_K|read probe" "$out/probe-q8.txt" || true
fi

if want skip; then
    bench skip-none DS4_CUDA_SKIP=
    for k in hc_mix hc_pre hc_comb hc_post attention_split attention_combine matvec_q8_0_q8 \
        matvec_iq2_xxs_q8_rx matvec_q2_k_q8 matvec_f16 router swiglu_q8k rmsnorm_q8 \
        kv_finish indexer_q indexer_scores topk_select; do
        bench "skip-$k" "DS4_CUDA_SKIP=$k"
    done
fi
