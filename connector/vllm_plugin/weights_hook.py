"""Hashes the weight files as vLLM's default loader reads them (``identity/read_along.py``).

Wraps, in ``vllm.model_executor.model_loader.default_loader`` once vLLM imports it,
``BaseModelLoader.load_model`` (to know which engine is loading) and the weights iterators the
default loader calls with the list of files it reads. An iterator called while an engine with
KVLens loads gets a ``ReadAlong`` beside it: each tensor it yields advances the hash's gate,
and its end waits for the hash and remembers the digests, where the scheduler half finds them.

Nothing here may break the load: a read-along that cannot start or finish is logged and counted
(``COUNTS["fallback"]``), and the scheduler then hashes the files itself, as without the plugin.
With the digest cache off (``KVLENS_WEIGHTS_DIGESTS=off``) nothing is installed: the digests
would have no way to the scheduler.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import importlib.util
import logging
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from ..identity import read_along
from ..identity.weights_digests import DigestCache, default_cache_path

logger = logging.getLogger("vllm.kvlens")

TARGET = "vllm.model_executor.model_loader.default_loader"
# Iterators that take the weight files as their first argument and read each file whole.
ITERATORS = (
    "safetensors_weights_iterator",
    "multi_thread_safetensors_weights_iterator",
    "fastsafetensors_weights_iterator",
    "instanttensor_weights_iterator",
    "pt_weights_iterator",
    "multi_thread_pt_weights_iterator",
)
CONNECTOR = "KVLensConnector"

COUNTS: Counter[str] = Counter()  # this process's read-alongs: "finished", "fallback"
RECENT: deque[read_along.Outcome] = deque(maxlen=8)  # the last read-alongs' outcomes
_loading: contextvars.ContextVar[bool] = contextvars.ContextVar("kvlens_loading", default=False)


def install() -> None:
    if default_cache_path() is None:
        return
    after_import(TARGET, _patch)


def after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Calls ``patch(module)`` now if ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        _apply(patch, module)
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, patch))


def _apply(patch: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        patch(module)
    except Exception:  # noqa: BLE001 - a plugin must never stop vLLM
        COUNTS["fallback"] += 1
        logger.exception("KVLens plugin: cannot wrap %s", module.__name__)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self._patch = patch

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_patch(module: ModuleType) -> None:
            exec_module(module)
            _apply(self._patch, module)

        loader.exec_module = exec_then_patch
        return spec


def uses_kvlens(vllm_config: Any) -> bool:
    """Whether the engine's connector is KVLens (alone or inside vLLM's MultiConnector)."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        return False
    if kv.kv_connector == CONNECTOR:
        return True
    inner = (kv.kv_connector_extra_config or {}).get("connectors") or []
    return kv.kv_connector == "MultiConnector" and any(
        isinstance(c, dict) and c.get("kv_connector") == CONNECTOR for c in inner
    )


def _patch(module: ModuleType) -> None:
    base = module.BaseModelLoader
    if not getattr(base.load_model, "_kvlens", False):
        base.load_model = _marking_load(base.load_model)
    for name in ITERATORS:
        iterate = getattr(module, name, None)
        if iterate is not None and not getattr(iterate, "_kvlens", False):
            setattr(module, name, _reading_along(iterate))


def _marking_load(load_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load_model)
    def wrapper(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        token = _loading.set(uses_kvlens(vllm_config))
        try:
            return load_model(self, vllm_config, *args, **kwargs)
        finally:
            _loading.reset(token)

    wrapper._kvlens = True  # type: ignore[attr-defined]
    return wrapper


def _reading_along(iterate: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    @functools.wraps(iterate)
    def wrapper(files: list[str], *args: Any, **kwargs: Any) -> Iterator[Any]:
        if not _loading.get():
            return iterate(files, *args, **kwargs)
        return read_beside(iterate(files, *args, **kwargs), files)

    wrapper._kvlens = True  # type: ignore[attr-defined]
    return wrapper


def read_beside(weights: Iterator[Any], files: list[str]) -> Iterator[Any]:
    """``weights`` (vLLM's iterator over ``files``), with the files hashed beside it."""
    along = _start(files)
    if along is None:
        yield from weights
        return
    finished = False
    try:
        for item in weights:
            along.advance(_nbytes(item))
            yield item
        finished = True
    finally:
        if finished:
            _finish(along)
        else:
            _fallback(along.abort, "the load stopped before its last weight")


def _start(files: list[str]) -> read_along.ReadAlong | None:
    try:
        path = default_cache_path()
        if path is None:
            return None
        return read_along.ReadAlong(files, DigestCache(path), read_along.flock_claims(path + ".claims"))
    except Exception as e:  # noqa: BLE001
        _fallback(None, f"cannot start ({e!r})")
        return None


def _finish(along: read_along.ReadAlong) -> None:
    try:
        out = along.finish()
    except Exception as e:  # noqa: BLE001
        _fallback(None, f"cannot finish ({e!r})")
        return
    COUNTS["finished"] += 1
    RECENT.append(out)
    logger.info(
        "KVLens weights hashed beside vLLM's load: %d files (%.1f GB), waited %.2f s after its "
        "last read; %d remembered already, %d hashed by another rank, %d changed while read",
        out.hashed,
        out.hashed_bytes / 1e9,
        out.waited_s,
        out.remembered,
        out.claimed_elsewhere,
        out.changed,
    )


def _fallback(undo: Callable[[], None] | None, why: str) -> None:
    COUNTS["fallback"] += 1
    logger.warning(
        "KVLens plugin: weights not hashed beside vLLM's load: %s; the scheduler hashes them "
        "(fallback %d in this process)",
        why,
        COUNTS["fallback"],
    )
    if undo is not None:
        try:
            undo()
        except Exception:  # noqa: BLE001
            logger.exception("KVLens plugin: cannot stop the read-along")


def _nbytes(item: Any) -> int:
    try:
        return int(item[1].nbytes)
    except Exception:  # noqa: BLE001 - not a (name, tensor) pair: the gate opens at the end
        return 0
