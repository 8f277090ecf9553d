"""Architecture and style rules the codebase keeps, checked like behaviour."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PURE = (
    "connector",
    "connector.config",
    "connector.scheduler",
    "connector.step_planner",
    "connector.disk_sync",
    "connector.tiers.cpu",
    "connector.tiers.disk",
    "connector.tiers.codec",
    "connector.tiers.background",
    "connector.engine.keys",
    "connector.engine.index",
    "connector.engine.tracker",
    "connector.engine.policy",
    "connector.engine.jobs",
    "connector.engine.outcomes",
    "connector.engine.health",
    "connector.engine.suspects",
    "connector.engine.facts",
    "connector.engine.whatif",
)


def test_pure_logic_imports_neither_vllm_nor_torch():
    code = (
        f"import sys, {', '.join(PURE)}\n"
        "heavy = sorted(m for m in ('vllm', 'torch') if m in sys.modules)\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _runtime_imports(path: Path) -> set[str]:
    """Modules a file imports when it runs (imports under ``if TYPE_CHECKING:`` excluded)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_telemetry_depends_on_the_connector_in_one_direction_only():
    for path in (REPO / "telemetry").rglob("*.py"):
        bad = {m for m in _runtime_imports(path) if m.split(".")[0] == "connector"}
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"
    users = {
        str(p.relative_to(REPO))
        for p in (REPO / "connector").rglob("*.py")
        if any(m.split(".")[0] == "telemetry" for m in _runtime_imports(p))
    }
    assert users <= {"connector/kv_connector.py"}, users  # only the facade hands outcomes over


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff_is_clean(args):
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    out = subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
