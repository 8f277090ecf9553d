"""Stand-ins for the vLLM request and scheduler-output objects the scheduler half reads, for
benchmarks that time it without vLLM (``planning.py``, ``lookup.py``)."""

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


def scheduler_output(
    new: Sequence = (), cached: Sequence = (), scheduled: dict | None = None
) -> SimpleNamespace:
    """One step: ``new`` (request, block ids) prefilled from the start, ``cached`` (request id,
    new block ids or None, computed tokens) continuing, ``scheduled`` tokens per request."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                block_ids=(b,),
                num_computed_tokens=0,
            )
            for r, b in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            resumed_req_ids=set(),
            new_block_ids=[c[1] for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
    )
