#!/usr/bin/env bash
# Set everything up and run the tests:  bash scripts/test.sh [pytest args]
#
# Without path arguments it runs every test in tests/ (as two processes side by side, below);
# arguments are passed to pytest (e.g. `bash scripts/test.sh tests/unit -x` runs only
# tests/unit). Exits with pytest's status, except that "no tests collected" (pytest's 5) is an
# error too.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/env.sh
source scripts/env.sh
bash scripts/setup.sh || { echo "[test] setup failed" >&2; exit 1; }

# Default to the tests/ folder unless a test path (file, folder or node id) was given.
targets=(tests)
for arg in "$@"; do
    case "$arg" in
        -*) ;;
        *) if [ -e "${arg%%::*}" ]; then targets=(); break; fi ;;
    esac
done

PY="$KVLENS_VENV/bin/python"
# The whole suite (no test paths, no -m of the caller's) runs as two pytest processes side by
# side: the tests marked integration (real vLLM; in xdist workers, below) and the rest. A vLLM
# test keeps about one core busy (its worker is pinned to one core; a start is mostly one
# process's imports), so each core runs one worker's engines, and the rest runs in the gaps.
# The second one's output follows the first's. KVLENS_TEST_SPLIT=0 runs one process.
split="${KVLENS_TEST_SPLIT:-1}"
[ ${#targets[@]} -eq 0 ] && split=0
for arg in "$@"; do
    case "$arg" in -m | -m*) split=0 ;; esac
done

if [ "$split" != 1 ]; then
    echo "[test] python -m pytest ${targets[*]:+${targets[*]} }-q $*"
    "$PY" -m pytest "${targets[@]}" -q "$@"
    rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "[test] ERROR: pytest collected no tests" >&2
        exit 1
    fi
    exit "$rc"
fi

# The integration tests themselves run as pytest-xdist workers side by side, one per core up to
# KVLENS_TEST_WORKERS (default 2: a test may run three engines, 24 GB holds two such tests;
# KVLENS_TEST_WORKERS=1: one process). tests/conftest.py keeps each test file (or xdist_group)
# in one worker, so that a module's shared engine starts once, starts the longest files first
# (tests/durations.json) and gives each worker's engines a core of their own.
cores="$("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))')"
workers="${KVLENS_TEST_WORKERS:-2}"
[ "$workers" -gt "$cores" ] && workers="$cores"
xdist=()
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadgroup)

beside_dir="$(mktemp -d "${TMPDIR:-/tmp}/kvlens-tests-beside.XXXXXX")"
echo "[test] python -m pytest tests -q -m 'not integration' $* (beside, output below)"
"$PY" -m pytest tests -q --durations=10 -m "not integration" -p no:cacheprovider --basetemp "$beside_dir/tmp" "$@" \
    >"$beside_dir/output.txt" 2>&1 &
beside=$!
echo "[test] python -m pytest tests -q -m integration ${xdist[*]:+${xdist[*]} }$*"
"$PY" -m pytest tests -q --durations=10 -m integration "${xdist[@]}" "$@"
rc_integration=$?
wait "$beside"
rc_beside=$?
echo
echo "[test] ---- tests not marked integration (ran beside the above) ----"
cat "$beside_dir/output.txt"
rm -rf "$beside_dir"
echo "[test] exit status: integration $rc_integration, the rest $rc_beside"
if [ "$rc_integration" -eq 5 ] && [ "$rc_beside" -eq 5 ]; then
    echo "[test] ERROR: pytest collected no tests" >&2
    exit 1
fi
for rc in "$rc_integration" "$rc_beside"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit "$rc"
    fi
done
exit 0
