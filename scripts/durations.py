"""Refresh tests/durations.json (the seconds each unit of real-vLLM tests takes, which
tests/conftest.py uses to start the longest units first) from a run's ``--durations=0`` report:

    bash scripts/test.sh --durations=0 > run.log 2>&1
    .venv/bin/python scripts/durations.py run.log

Only the integration run's report is read (the part before scripts/test.sh prints the output of
the tests that ran beside it). A unit's seconds are the sum of its tests' setup, call and teardown;
units of under ``--min`` seconds are left out (they count ``UNKNOWN_TEST_S`` a test).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import DURATIONS, unit_of  # noqa: E402

LINE = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)")
BESIDE = "tests not marked integration"  # scripts/test.sh's heading of the other run's output


def unit_seconds(lines: list[str]) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for line in lines:
        if BESIDE in line:
            break
        if match := LINE.match(line):
            seconds[unit_of(match[3])] += float(match[1])
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("log", type=Path, help="output of a run with --durations=0")
    parser.add_argument("--min", type=float, default=10.0, help="leave out units under this many seconds")
    args = parser.parse_args()
    seconds = unit_seconds(args.log.read_text(errors="replace").splitlines())
    if not seconds:
        print(f"no --durations=0 lines in {args.log}", file=sys.stderr)
        return 1
    kept = {unit: round(s) for unit, s in sorted(seconds.items(), key=lambda kv: -kv[1]) if s >= args.min}
    DURATIONS.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"wrote {DURATIONS.relative_to(REPO)}: {len(kept)} units, {sum(kept.values())} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
