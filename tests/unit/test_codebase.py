"""Architecture and style rules the codebase keeps, checked like behaviour."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_pure_logic_imports_neither_vllm_nor_torch():
    code = (
        "import sys, connector, connector.config, connector.scheduler, connector.tiers.cpu, "
        "connector.tiers.disk, connector.tiers.codec\n"
        "import connector.engine.keys, connector.engine.index, connector.engine.tracker, "
        "connector.engine.requests, connector.engine.jobs, connector.engine.facts\n"
        "heavy = sorted(m for m in ('vllm', 'torch') if m in sys.modules)\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff_is_clean(args):
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    out = subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
