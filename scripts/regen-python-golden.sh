#!/usr/bin/env bash
# Rewrites the golden files of the Python-oracle tests (#19 item 1) from the live oracles:
#   crates/gguf/tests/golden/python_gguf.json        gguf.quants.dequantize (gguf, numpy)
#   crates/tokenizer/tests/golden/python_oracle.json tokenizers' ids
# The tests generate their seeded inputs, the Python packages pinned in
# .ci/requirements.txt compute the outputs, and the tests write a compact summary of
# those outputs (hashes and a few full rows), never of ours. Then both tests run normally
# against the new files. Review the diff before committing: a changed golden file means
# the inputs or the oracle changed.
#
# Usage: scripts/regen-python-golden.sh [--venv]
#   --venv   install the pinned packages into target/python-golden-venv (needs network)
#            and use that python3; otherwise the python3 on PATH must have them.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --venv ]; then
    venv=target/python-golden-venv
    [ -x "$venv/bin/python3" ] || python3 -m venv "$venv"
    "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check \
        "$(grep '^gguf==' .ci/requirements.txt)" "$(grep '^numpy==' .ci/requirements.txt)" \
        "$(grep '^tokenizers==' .ci/requirements.txt)"
    export PATH="$PWD/$venv/bin:$PATH"
elif [ $# -gt 0 ]; then
    echo "usage: $0 [--venv]" >&2
    exit 2
fi

# The exact pinned versions, or no regeneration: a golden file records one oracle.
python3 - <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
bad = []
for line in open(".ci/requirements.txt"):
    name, _, want = line.strip().partition("==")
    if name not in ("gguf", "numpy", "tokenizers"):
        continue
    try:
        have = version(name)
    except PackageNotFoundError:
        have = "missing"
    if have != want:
        bad.append(f"{name} {have} (want {want})")
if bad:
    sys.exit("regen-python-golden: " + ", ".join(bad) +
             "; pip install -r .ci/requirements.txt, or run with --venv")
PY

export DS4_REGEN_PYTHON_GOLDEN=1
cargo test -p ds4-gguf --test python_gguf -- golden_file_matches_live_python_gguf --exact
cargo test -p ds4-tokenizer --test python_oracle -- golden_file_matches_live_python_tokenizers --exact
unset DS4_REGEN_PYTHON_GOLDEN

# The new files must pass both the offline and the live comparison.
export DS4_REQUIRE_PYTHON_TESTS=1
cargo test -p ds4-gguf --test python_gguf
cargo test -p ds4-tokenizer --test python_oracle
git status --short -- crates/gguf/tests/golden crates/tokenizer/tests/golden
