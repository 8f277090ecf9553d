"""bench/pd_transfer.py keeps working (--quick): every mode is measured, the ratio to the bare
socket is there and every PD round really transferred (the script fails otherwise). Never a
timing assertion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_pd_transfer_compares_pd_with_a_bare_socket(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "pd_transfer.py"), "--quick", "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    data = json.loads((tmp_path / "pd_transfer.json").read_text())
    summary = data["summary"]["all"]
    assert set(summary) == {"bare", "bare-xxh3", "pd", "pd-tag", "pd-tls"}
    assert all(s["gbps"]["median"] > 0 for s in summary.values())
    assert data["ratios"]["all"]["pd"]["bare"]["gbps"]["n"] == 3
    assert data["ratios"]["all"]["pd-tag"]["pd"]["gbps"]["n"] == 3  # the tag's own cost
    assert data["ratios"]["all"]["pd-tls"]["pd"]["gbps"]["n"] == 3
    assert "PD transfer >= 0.8 x bare TCP" in run.stdout
    assert "the tag costs < 10% of the transfer" in run.stdout
