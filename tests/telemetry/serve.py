"""Starts a real ``vllm serve`` (CPU) with KVLens for the telemetry tests, and talks to it.

The server runs in its own process group so that teardown can stop the API server, the
engine core and the workers together. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.lib.ports import free_port
from bench.lib.servers import in_engine_core

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0


def kv_transfer_config(**extra_config: Any) -> dict[str, Any]:
    """A --kv-transfer-config for KVLens with the recompute policy and ``lmcache.*`` settings."""
    return {
        "kv_connector": "KVLensConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {f"lmcache.{k}": v for k, v in extra_config.items()},
    }


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVLENS_", "LMCACHE_"))}
    env.update(
        {
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
        }
    )
    env.update(extra)
    return env


class VllmServer:
    def __init__(
        self,
        model: str,
        kv_config: dict[str, Any] | None,
        log_path: Path,
        env: dict[str, str],
        extra_args: tuple[str, ...] = (),
        *,
        host: str = "127.0.0.1",
        launcher: tuple[str, ...] = (),
        worker_process: bool = True,
    ) -> None:
        """``launcher`` prefixes the command (``ip netns exec NS``: another "host"), whose HTTP
        server then binds ``host``. ``worker_process``: vLLM's own deployment on CPU, the model's
        worker in a process of its own beside the engine core (scheduler half and worker half of
        KVLens in two processes, their metadata pickled between them); ``False`` runs the worker
        in the engine core, for a module whose subject is not that split (``in_engine_core``
        gives its threads the split's count and cores). Servers whose outputs a test compares
        run alike all the same: a random model's bf16 outputs flip on the last bit."""
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.model = model
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "connector.launcher",
            "serve",
            model,
            "--host",
            host,
            "--port",
            str(self.port),
            "--served-model-name",
            "tiny",
            "--enforce-eager",
            "--max-model-len",
            "4096",
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
            *(["--kv-transfer-config", json.dumps(kv_config)] if kv_config is not None else []),
            *extra_args,
        ]
        if not worker_process:
            cmd, env = in_engine_core(cmd, env)
        cmd = [*launcher, *cmd]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 8000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:  # the API server stops its engine core and workers itself
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        try:  # stragglers of the group (engine core, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

    # ---- HTTP ---------------------------------------------------------------------------
    def post(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method="POST",
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw.strip() else {}

    def complete(
        self, prompt: list[int], max_tokens: int = 4, traceparent: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        headers = {"traceparent": traceparent} if traceparent else {}
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            **extra,
        }
        return self.post("/v1/completions", body, headers)

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample on /metrics keyed by (name, sorted labels without model_name/engine)."""
        out = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                labels = tuple(
                    sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))
                )
                out[(s.name, labels)] = s.value
        return out


def sample(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def sum_samples(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.25, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"{what} not met within {timeout}s (last: {last!r})")


def traceparent(trace_id: str, span_id: str = "00f067aa0ba902b7") -> str:
    return f"00-{trace_id}-{span_id}-01"


def prompt_tokens(n: int, seed: int) -> list[int]:
    """Deterministic token ids inside the tiny model's vocabulary (no text, no tokenizer)."""
    x = seed * 7919 + 17
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (2**31)
        out.append(20 + x % 1200)
    return out


class EventStream:
    """A subscriber to vLLM's KV event publisher (ZMQ PUB: topic, sequence, msgpack batch).

    vLLM's publisher connects to a ``tcp://host:port`` endpoint (it binds only wildcards), so the
    subscriber binds on loopback and the publisher finds it by itself (ZMQ reconnects)."""

    def __init__(self) -> None:
        """Bound to a free port it keeps (``self.port``) before vLLM is told it
        (``vllm_args``): no other process can take it between the choice and the bind."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.events: list = []

    def vllm_args(self) -> tuple[str, str]:
        """The ``vllm serve`` arguments that point vLLM's KV event publisher here."""
        endpoint = f"tcp://127.0.0.1:{self.port}"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
        return ("--kv-events-config", json.dumps(config))

    def drain(self, seconds: float) -> list:
        poller = self._zmq.Poller()
        poller.register(self._sock, self._zmq.POLLIN)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if poller.poll(int(left * 1000)):
                *_, payload = self._sock.recv_multipart()
                self.events.extend(self._decode(payload).events)
        return self.events

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
