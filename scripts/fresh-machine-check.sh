#!/usr/bin/env bash
# The acceptance check of #19 ("a newcomer's first hour"): on a clean clone in a fresh
# directory, with a python3 that has no packages at all, the README's two Quickstart
# commands succeed and the test summary lists the skipped tests.
#
#   - clones HEAD (committed work only) into a new mktemp directory;
#   - puts first on PATH a `python3 -m venv --without-pip` python, and checks that it
#     cannot import numpy, gguf, tokenizers, openai or anthropic;
#   - builds into a fresh target/ inside the clone (cargo may use ~/.cargo's registry,
#     offline), without the CI switches (DS4_NVCC, DS4_REQUIRE_*) of this environment;
#   - runs the README's Quickstart commands verbatim, taken from README.md itself;
#   - prints each command's status and the skip summary of `./test`.
#
# Usage: scripts/fresh-machine-check.sh [--dry-run] [--keep]
#   --dry-run  clone and check the bare python, print the commands, run nothing else
#   --keep     leave the clone (and its target/, several GB) instead of removing it
# A full run takes a while: a release build, a debug build and the whole test suite.
set -euo pipefail

dry_run=0
keep=0
for a in "$@"; do
    case "$a" in
        --dry-run) dry_run=1 ;;
        --keep) keep=1 ;;
        *) echo "usage: $0 [--dry-run] [--keep]" >&2; exit 2 ;;
    esac
done

src=$(cd "$(dirname "$0")/.." && pwd)
commit=$(git -C "$src" rev-parse HEAD)
if [ -n "$(git -C "$src" status --porcelain --untracked-files=no)" ]; then
    echo "fresh-machine-check: note: uncommitted changes in $src are not part of the check"
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/ds4-fresh.XXXXXX")
cleanup() {
    if [ "$keep" = 1 ]; then
        echo "fresh-machine-check: kept $work"
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT

echo "== clone $commit into $work/ds4"
git clone --quiet --no-checkout --no-hardlinks "$src" "$work/ds4"
git -C "$work/ds4" checkout --quiet --detach "$commit"

echo "== a python3 without any packages"
# Whatever python3 is on PATH: a venv made from it (without --system-site-packages)
# sees neither its site-packages nor user packages.
base_python=$(command -v python3)
"$base_python" -m venv --without-pip "$work/py"
export PATH="$work/py/bin:$PATH"
unset PYTHONPATH PYTHONHOME PYTHONUSERBASE VIRTUAL_ENV
[ "$(command -v python3)" = "$work/py/bin/python3" ] || {
    echo "fresh-machine-check: $work/py/bin/python3 is not first on PATH" >&2
    exit 1
}
for m in numpy gguf tokenizers openai anthropic; do
    if python3 -c "import $m" 2>/dev/null; then
        echo "fresh-machine-check: the bare python3 can import $m; the check needs it absent" >&2
        exit 1
    fi
    echo "   cannot import $m (as wanted)"
done

# The switches of this development environment and of CI are not on a fresh machine.
unset CARGO_TARGET_DIR DS4_NVCC DS4_REQUIRE_NVCC DS4_REQUIRE_PYTHON_TESTS \
    DS4_SKIP_PYTHON_TESTS DS4_TEST_SKIPS DS4_REQUIRE_WEB_TEST DS4_REGEN_PYTHON_GOLDEN RUST_LOG
export CARGO_NET_OFFLINE=true

# The README's Quickstart commands: the first ```sh block after "## Quickstart",
# comments dropped, backslash-continued lines joined, one command per line.
commands=$(awk '
    /^## Quickstart/ { inq = 1 }
    inq && /^```sh/ { inb = 1; next }
    inb && /^```/ { exit }
    inb { print }
' "$work/ds4/README.md" | sed -e 's/^[[:space:]]*#.*$//' | sed -e ':a' -e '/\\$/N; s/[[:space:]]*\\\n[[:space:]]*/ /; ta' | grep -v '^[[:space:]]*$')
n=$(printf '%s\n' "$commands" | wc -l)
if [ "$n" -ne 2 ]; then
    echo "fresh-machine-check: expected the README's two Quickstart commands, found $n:" >&2
    printf '%s\n' "$commands" >&2
    exit 1
fi

echo "== the README's commands (in $work/ds4):"
printf '%s\n' "$commands" | sed 's/^/   $ /'
if [ "$dry_run" = 1 ]; then
    echo "== dry run: nothing built or run"
    exit 0
fi

cd "$work/ds4"
status=0
i=0
while IFS= read -r cmd; do
    i=$((i + 1))
    log="$work/command-$i.log"
    echo "== command $i: $cmd   (output in $log)"
    t0=$SECONDS
    if bash -c "$cmd" >"$log" 2>&1; then rc=0; else rc=$?; fi
    echo "   exit status $rc after $((SECONDS - t0)) s"
    if [ "$rc" -ne 0 ]; then
        status=1
        tail -n 40 "$log"
    fi
done <<<"$commands"

echo "== test summary (the end of ./test's output)"
last="$work/command-$i.log"
if grep -q '^== skipped tests\|^== no tests skipped' "$last"; then
    sed -n '/^== skipped tests\|^== no tests skipped/,$p' "$last"
else
    echo "fresh-machine-check: ./test printed no skip summary" >&2
    status=1
fi
grep -E '^test result:' "$last" | awk '{ p += $4; f += $6; ig += $8 } END { print "   cargo test: " p " passed, " f " failed, " ig " ignored" }'
if [ "$status" = 0 ]; then
    echo "== fresh-machine check passed"
else
    echo "== fresh-machine check FAILED"
    keep=1
fi
exit "$status"
