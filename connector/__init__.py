"""KVLens: an observability-first, LMCache-compatible KV-cache connector for vLLM v1.

At the top, only what meets vLLM: the connector vLLM loads (kv_connector.py: it builds one of the
two halves), the metadata passed between them (metadata.py), vLLM's versions and settings
(vllm_compat.py), where KVLens's threads run in a worker (cpu_affinity.py) and the launcher.
Beside them: scheduler/ and worker/ (the halves, which never import each other), engine/ (pure
logic), config/, tiers/, identity/ (the model checkpoint's identity and the KV settings keys
depend on), pd/ (the PD data plane), ops/ (the ``kvlens`` command), pd_proxy/ (``kvlens
pd-proxy``, a program of its own) and real_model/ (set-up's conversion of the real model the demo
and the quality tests serve). tests/unit/test_codebase.py keeps these rules.

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
