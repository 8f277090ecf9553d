"""KVLens: an observability-first, LMCache-compatible KV-cache connector for vLLM v1.

``KVLensConnector`` is imported lazily so that tools in this package (the tiny-model
builder, the launcher) and the pure engine do not pay for importing vLLM.
"""

from typing import Any

__all__ = ["KVLensConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVLensConnector":
        from .kv_connector import KVLensConnector

        return KVLensConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
