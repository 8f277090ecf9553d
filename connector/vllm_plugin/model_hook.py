"""Remembers the model vLLM's loader built in this process, for the blender (issue 39).

vLLM hands a connector its KV caches, never its model; the blender runs the model's own layers.
Wrapped, once vLLM imports ``vllm.model_executor.model_loader.base_loader``:
``BaseModelLoader.load_model``, which every loader of vLLM's (default, dummy, sharded) inherits
or calls, returns the ``nn.Module`` it built; when the engine being loaded has KVLens as its
connector, a weak reference to it is kept here. The wrapper calls the original and only
records: nothing about the load changes, and a failure to record is logged, never raised.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .weights_hook import after_import, uses_kvlens

logger = logging.getLogger("vllm.kvlens")

TARGET = "vllm.model_executor.model_loader.base_loader"
_latest: weakref.ReferenceType[Any] | None = None


def install() -> None:
    after_import(TARGET, _patch)


def loaded_model() -> Any | None:
    """The model last loaded in this process by an engine with KVLens, if still alive."""
    return _latest() if _latest is not None else None


def remember(model: Any) -> None:
    global _latest
    _latest = weakref.ref(model)


def _patch(module: ModuleType) -> None:
    base = module.BaseModelLoader
    if not getattr(base.load_model, "_kvlens_model", False):
        base.load_model = _remembering_load(base.load_model)


def _remembering_load(load_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load_model)
    def wrapper(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        model = load_model(self, vllm_config, *args, **kwargs)
        try:
            if uses_kvlens(vllm_config):
                remember(model)
        except Exception:  # noqa: BLE001 - a plugin must never stop vLLM
            logger.exception("KVLens plugin: the loaded model was not remembered")
        return model

    wrapper._kvlens_model = True  # type: ignore[attr-defined]
    return wrapper
