"""KVLens's vLLM plugin (entry point ``vllm.general_plugins: kvlens``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), before
any model is built, and again in an offline ``LLM(...)``'s one process. Each hook here must cost
nothing in a process or an engine that does not use it: ``register()`` imports no vLLM module;
a hook installs itself when vLLM imports the module it wraps, and acts only when the engine
being loaded has KVLens as its connector.

- ``weights_hook``: hashes the weight files beside the loader's read of them (the model
  identity's digests, ``connector/identity/read_along.py``), so the scheduler half does not
  read the checkpoint a second time.
- ``model_hook``: remembers the model the loader built (a weak reference), which the blender
  runs: vLLM hands a connector its KV caches, never its model.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.kvlens")


def register() -> None:
    """Installs every hook; a hook that fails to install is logged and left out."""
    from . import model_hook, weights_hook

    for hook in (weights_hook.install, model_hook.install):
        try:
            hook()
        except Exception:  # noqa: BLE001 - a plugin must never stop vLLM
            logger.exception("KVLens plugin: hook %s not installed", hook.__module__)
