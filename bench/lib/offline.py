"""One vLLM engine with KVLens inside this process (``hit_profile.py``, ``telemetry_overhead.py``):
no HTTP, no API server, so the connector's hooks can be timed and switched from the inside."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from .servers import PINNED_ENV


def kvlens_llm(model: str, extra_config: dict[str, Any], **llm_args: Any) -> Any:
    """``vllm.LLM`` with its engine core and worker in this process, KVLens as its connector;
    the servers' pinned settings (worker cores, 1 GiB of KV memory) unless already set."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in {
        **PINNED_ENV,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
    }.items():
        os.environ.setdefault(key, value)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KVLensConnector",
        kv_connector_module_path="connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra_config,
    )
    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, kv_transfer_config=ktc, **llm_args)


class CallTimer:
    """Time spent inside the given functions, in all and by function, until ``unwrap``.

    ``clock`` is wall time for code on the step loop (waiting there delays the engine) or the
    thread's CPU time for background threads (their waits on I/O or the GIL cost nothing).
    """

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds = 0.0
        self.by_name: dict[str, float] = {}
        self._patched: list[tuple[object, str, object, bool]] = []

    def wrap(self, obj: object, *names: str) -> CallTimer:
        for name in names:
            own = name in vars(obj)  # a module's or class's own attribute, else a method via the class
            original = vars(obj)[name] if own else getattr(obj, name)
            target = getattr(obj, name)
            label = getattr(target, "__qualname__", name)

            @functools.wraps(target)
            def timed(*args, __target=target, __label=label, **kwargs):
                t = self.clock()
                try:
                    return __target(*args, **kwargs)
                finally:
                    dt = self.clock() - t
                    self.seconds += dt
                    self.by_name[__label] = self.by_name.get(__label, 0.0) + dt

            setattr(obj, name, timed)
            self._patched.append((obj, name, original, own))
        return self

    def unwrap(self) -> None:
        for obj, name, original, own in reversed(self._patched):
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)
        self._patched.clear()
