"""How the dashboard is served: the repository's Streamlit config binds it to 127.0.0.1, and a
real ``streamlit run`` from the repository root listens there and nowhere else."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import tomllib

from .promql import REPO
from .serving import listening_addresses


def test_the_repository_config_binds_streamlit_to_loopback():
    config = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
            return r.read().strip() == b"ok"
    except OSError:
        return False


def test_streamlit_run_from_the_repository_root_listens_on_loopback_only(closed_port, tmp_path):
    """The command the README gives, with no address flag: the config file decides."""
    cmd = [sys.executable, "-m", "streamlit", "run", "dashboard/app.py", "--server.headless=true"]
    cmd += [f"--server.port={closed_port}", "--browser.gatherUsageStats=false"]
    env = {**os.environ, "KVLENS_DASHBOARD_METRICS": f"127.0.0.1:{closed_port}"}
    with open(tmp_path / "streamlit.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _healthy(closed_port):
            log = (tmp_path / "streamlit.log").read_text()
            assert proc.poll() is None and time.monotonic() < deadline, log
            time.sleep(0.3)
        assert listening_addresses(closed_port) == {"127.0.0.1"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
