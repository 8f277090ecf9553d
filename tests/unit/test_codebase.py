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
    "connector.real_model.conversion",  # transformers and torch only inside the conversion itself
    "connector.config.loading",
    "connector.scheduler.connector_scheduler",
    "connector.scheduler.scheduler_state",
    "connector.scheduler.prefix_lookup",
    "connector.scheduler.insight_feed",
    "connector.scheduler.responses",
    "connector.scheduler.worker_feedback",
    "connector.scheduler.step_planner",
    "connector.scheduler.disk_sync",
    "connector.tiers.cpu",
    "connector.tiers.disk",
    "connector.tiers.disk_scan",
    "connector.tiers.codec",
    "connector.tiers.background",
    "connector.engine.keys",
    "connector.engine.index",
    "connector.engine.tracker",
    "connector.engine.policy",
    "connector.engine.jobs",
    "connector.engine.outcomes",
    "connector.engine.snapshots",
    "connector.engine.prefill_cost",
    "connector.engine.health",
    "connector.engine.suspects",
    "connector.engine.facts",
    "connector.engine.whatif",
    "connector.engine.namespace_records",
    "connector.identity.read_along",
    "connector.vllm_plugin",  # vLLM imports it in every process: no vLLM until a hook acts
    "connector.vllm_plugin.weights_hook",
)


def test_pure_logic_imports_neither_vllm_nor_torch():
    code = (
        f"import sys, {', '.join(PURE)}\n"
        "heavy = sorted(m for m in ('vllm', 'torch') if m in sys.modules)\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _package_modules(*packages: str) -> list[str]:
    return sorted(
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for package in packages
        for path in (REPO / package.replace(".", "/")).glob("*.py")
        if path.name != "__init__.py"
    )


def test_the_engine_and_the_configuration_import_neither_vllm_nor_torch():
    modules = _package_modules("connector.engine", "connector.config")
    assert len(modules) > 20
    code = (
        f"import sys, {', '.join(modules)}\n"
        "print(','.join(sorted(m for m in ('vllm', 'torch') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# The copy path and the device check (scripts/gpu_check.py) run where vLLM is not installed.
WITHOUT_VLLM = ("connector.worker.kv_blocks", "connector.worker.layer_copies", "connector.worker.cuda_copies")


def test_the_copy_path_imports_without_vllm():
    code = f"import sys, {', '.join(WITHOUT_VLLM)}\nprint('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


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


def _connector_imports(path: Path) -> set[str]:
    """Modules of the connector package a file imports, at run time or for type checking."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("connector.")}


def test_connector_modules_import_one_way():
    modules = {
        ".".join(p.relative_to(REPO).with_suffix("").parts): p
        for p in (REPO / "connector").rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {name: _connector_imports(path) & modules.keys() for name, path in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                if nxt == goal:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert not cycles, cycles


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff_is_clean(args):
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    out = subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# What each package of connector/ may import from the rest of it (its own modules always): the
# pure engine nothing, the configuration and the tiers nothing of either half, and the two halves
# never each other; only the vLLM-facing modules at the top bring the halves together.
MAY_IMPORT = {
    "connector.engine": set(),
    "connector.config": {"connector.engine", "connector.tiers"},
    "connector.tiers": {"connector.engine", "connector.cpu_affinity"},
    "connector.scheduler": {
        "connector.engine",
        "connector.config",
        "connector.tiers",
        "connector.identity",
        "connector.vllm_compat",
    },
    "connector.worker": {"connector.engine", "connector.config", "connector.tiers", "connector.cpu_affinity"},
    "connector.ops": {
        "connector.engine",
        "connector.config",
        "connector.tiers",
        "connector.scheduler",
        "connector.pd",
        "connector.pd_proxy",
    },
    "connector.pd_proxy": set(),
    "connector.identity": set(),
    "connector.vllm_plugin": {"connector.identity"},
    "connector.real_model": set(),
}


def _package_of(module: str) -> str:
    """``connector.scheduler`` for ``connector.scheduler.admin``; a top-level module itself."""
    return ".".join(module.split(".")[:2])


def test_each_package_imports_only_what_its_init_allows():
    wrong = []
    for path in (REPO / "connector").rglob("*.py"):
        own = _package_of(".".join(path.relative_to(REPO).with_suffix("").parts))
        if own not in MAY_IMPORT:
            continue
        for module in _connector_imports(path):
            theirs = _package_of(module)
            if theirs != own and theirs not in MAY_IMPORT[own]:
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert not wrong, wrong


def test_the_halves_never_import_each_other():
    for half, other in (("scheduler", "worker"), ("worker", "scheduler")):
        for path in (REPO / "connector" / half).rglob("*.py"):
            bad = {m for m in _connector_imports(path) if m.startswith(f"connector.{other}")}
            assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def test_no_file_in_connector_is_over_500_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / "connector").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long
