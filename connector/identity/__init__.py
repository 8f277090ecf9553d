"""What a chunk key says about the engine that computed it, read from vLLM's objects and files.

- ``checkpoint.py``: the model's identity from the content of its weight files and adapters.
- ``weights_digests.py``: each weight file hashed once and remembered per file version.
- ``kv_settings.py``: the engine settings that change KV values (LongRoPE factors, ...).

Only ``connector/vllm_compat.py`` and the scheduler's lookup use these.
"""
