#!/usr/bin/env bash
# Set everything up and run the tests:  bash scripts/test.sh [pytest args]
#
# Without path arguments it runs `python -m pytest tests -q`; arguments are passed to pytest
# (e.g. `bash scripts/test.sh tests/unit -x` runs only tests/unit). Exits with pytest's status,
# except that "no tests collected" (pytest's 5) is an error too.
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

echo "[test] python -m pytest ${targets[*]:+${targets[*]} }-q $*"
"$KVLENS_VENV/bin/python" -m pytest "${targets[@]}" -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "[test] ERROR: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
