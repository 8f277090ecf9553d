"""scripts/gpu_check.py, the one-run check of the CUDA path, runs where vLLM is not installed;
without CUDA it runs its CPU checks of the same copy code and passes."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.py"

WITHOUT_VLLM = f"""
import runpy, sys
class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm is not installed here")
sys.meta_path.insert(0, NoVllm())
sys.argv = ["gpu_check.py", "--cpu", "--budget-s", "60"]
runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
"""


def test_without_cuda_or_vllm_the_gpu_check_runs_the_cpu_checks_and_passes():
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert sum(line.startswith("PASS  round trip") for line in lines) == 7  # every layout
    assert any(line.startswith("PASS  worker store and load") for line in lines)
    assert not any(line.startswith("FAIL") for line in lines)
    assert "RESULT: PASS" in out.stdout and "device->host consecutive (store)" in out.stdout


def test_a_failed_check_makes_the_gpu_check_exit_non_zero(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses look themselves up
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(gpu_check, "check_round_trip", lambda *a: (False, "blocks differ"))
    assert gpu_check.main(["--cpu"]) == 1
    assert "FAIL  round trip LBHNC (CPU): blocks differ" in capsys.readouterr().out
