"""A real Prometheus server (Debian's ``prometheus``) for the tests: temporary config and
storage, 127.0.0.1 only, stopped in teardown. Every wait is bounded."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_api_client import PrometheusConnect
from urllib3.util.retry import Retry

from tests.telemetry.serve import free_port

_DURATION = re.compile(r"(\[|offset |for: )(\d+)([smh])")
_SECONDS = {"s": 1, "m": 60, "h": 3600}


def scale_durations(rules_text: str, factor: int) -> str:
    """Alert rules with every range, offset and ``for:`` divided by ``factor`` (at least 1 s),
    so that a test sees in seconds what production sees in minutes."""

    def shorter(m: re.Match[str]) -> str:
        seconds = max(1, int(m.group(2)) * _SECONDS[m.group(3)] // factor)
        return f"{m.group(1)}{seconds}s"

    return _DURATION.sub(shorter, rules_text)


class PrometheusServer:
    def __init__(
        self,
        workdir: Path,
        scrape_configs: list[dict[str, Any]],
        rules: list[Path] = (),
        interval: str = "1s",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {
                "scrape_interval": interval,
                "evaluation_interval": interval,
                "scrape_timeout": interval,
            },
            "rule_files": [str(r) for r in rules],
            "scrape_configs": scrape_configs,
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.client = PrometheusConnect(self.url, retry=Retry(total=0), timeout=10)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout}s: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def query(self, expr: str) -> list[dict]:
        return self.client.custom_query(expr)

    def query_range(self, expr: str, start: float, end: float, step: str = "1s") -> list[dict]:
        import datetime as dt

        def t(x: float) -> dt.datetime:
            return dt.datetime.fromtimestamp(x, dt.timezone.utc)

        return self.client.custom_query_range(expr, t(start), t(end), step)

    def firing(self, alertname: str) -> list[dict[str, str]]:
        """Labels of the alerts of that name firing now."""
        return [r["metric"] for r in self.query(f'ALERTS{{alertname="{alertname}", alertstate="firing"}}')]

    def wait_for(self, predicate, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise TimeoutError(f"{what} not seen within {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def finite_values(result: list[dict]) -> list[float]:
    """Every finite value of an instant (``value``) or range (``values``) query result."""
    out = []
    for series in result:
        points = series.get("values") or ([series["value"]] if "value" in series else [])
        out += [float(v) for _, v in points if math.isfinite(float(v))]
    return out
