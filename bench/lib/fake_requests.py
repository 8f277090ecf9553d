"""Stand-ins for the vLLM request objects the scheduler half reads, for benchmarks that time
it without vLLM (``planning.py``, ``lookup.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace


def request(rid: str, tokens: list[int], all_token_ids: Sequence[int] | None = None) -> SimpleNamespace:
    """A prompt-only request; ``all_token_ids`` defaults to ``tokens`` itself (appending to it
    stands for decoding)."""
    return SimpleNamespace(
        request_id=rid,
        all_token_ids=tokens if all_token_ids is None else all_token_ids,
        prompt_token_ids=tokens,
        num_tokens=len(tokens),
        num_prompt_tokens=len(tokens),
        kv_transfer_params=None,
        priority=0,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )
