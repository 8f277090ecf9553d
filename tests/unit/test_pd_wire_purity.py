"""connector/pd/ is pure Python and sockets: it imports neither vLLM nor torch, and nothing else
of the connector (the scheduler and the worker halves both import it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted(
    f"connector.pd.{p.stem}" for p in (REPO / "connector" / "pd").glob("*.py") if p.stem != "__init__"
)


def test_the_pd_package_imports_neither_vllm_nor_torch():
    assert len(MODULES) >= 7
    code = (
        f"import sys, {', '.join(MODULES)}\nprint(','.join(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_pd_package_imports_nothing_else_of_the_connector():
    for path in (REPO / "connector" / "pd").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name} reaches outside connector/pd"
                assert not (node.module or "").startswith("connector"), path.name
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("connector") for a in node.names), path.name
