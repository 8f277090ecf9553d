"""Runs the blender on the model vLLM loaded (``VllmLlama``), on every rank at once, in a fresh
process, and prints what it found as JSON (the last stdout line):

    python vllm_backing.py SPEC.json   # {"model", "tokens", "engine": {...LLM kwargs}}

``prefill``: every token recomputed (no reused KV), so the blend is a full prefill by vLLM's own
modules: per layer this rank's K and V heads, and the last token's logits, which the test
compares with transformers' prefill of the same checkpoint.

``rewrite``: the blender's KV, written into vLLM's paged cache with the backend's own write
(``paged_write``), is KV vLLM decodes from. vLLM answers the prompt (greedy, top logprobs) and
keeps its full blocks in its prefix cache; their K and V are overwritten with zeros (the next
answer must change: vLLM reads them), then with the blender's K and V of those tokens, and vLLM
answers again from its prefix cache.

``select``: the tokens a check layer keeps are the same on every rank. The first tokens reuse
the full prefill's own KV, but for noise added to layer 0's K: on the first KV head only for
``ONE_HEAD`` tokens, smaller on every head for ``EVERY_HEAD`` tokens, whose deviation summed over
the heads is the larger. The ratio keeps as many tokens as ``EVERY_HEAD`` holds.
"""

from __future__ import annotations

import json
import sys


def full_blend(worker, token_ids: list[int]):
    """The blend of ``token_ids`` with nothing reused (every token recomputed) on this rank."""
    import torch

    from connector.worker.blend.blender import BlendInput, blend
    from connector.worker.blend.vllm_llama import VllmLlama

    backing = VllmLlama(worker.model_runner.model)
    ids = torch.tensor(token_ids)
    count = ids.shape[0]
    empty = [torch.zeros(count, layer._attn.num_kv_heads, layer._head_dim) for layer in backing.layers]
    prompt = BlendInput(ids, torch.arange(count), torch.zeros(count, dtype=torch.bool), empty, empty)
    with torch.inference_mode():
        result = blend(backing, prompt, [])
        return backing, result, backing.logits(result.last_hidden[None])[0]


REUSED = 280  # the tokens before it reuse KV in the selection check
ONE_HEAD = range(10, 20)  # noise 3.0 on K's first head: 9 x head size
EVERY_HEAD = range(40, 60)  # noise 2.5 on every head: 6.25 x head size x KV heads


def select_on_rank(worker, token_ids: list[int]) -> list[int]:
    """The tokens this rank recomputes after check layer 0, reusing noisy KV (``select``)."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    from connector.worker.blend.blender import BlendInput, blend
    from connector.worker.blend.selection import CheckLayer

    backing, full, _ = full_blend(worker, token_ids)
    keys = [k.clone() for k in full.keys]
    heads = keys[0].shape[1]
    first_head = get_tensor_model_parallel_rank() * heads  # this rank's heads among all
    if first_head == 0:
        keys[0][list(ONE_HEAD), 0] += 3.0
    keys[0][list(EVERY_HEAD)] += 2.5
    count = len(token_ids)
    reused = torch.arange(count) < REUSED
    prompt = BlendInput(torch.tensor(token_ids), torch.arange(count), reused, keys, full.values)
    with torch.inference_mode():
        result = blend(backing, prompt, [CheckLayer(0, ratio=len(EVERY_HEAD) / REUSED)])
    return list(result.report.recomputed_index)


def blend_on_rank(worker, token_ids: list[int]) -> dict:
    """On a worker (through ``collective_rpc``): the full-recompute blend of ``token_ids``."""
    from connector.vllm_plugin.model_hook import loaded_model

    model = worker.model_runner.model
    _, result, logits = full_blend(worker, token_ids)
    return {
        "remembered": loaded_model() is model,
        "keys": [k.tolist() for k in result.keys],
        "values": [v.tolist() for v in result.values],
        "logits": logits.tolist(),
        "recomputed": result.report.recomputed,
    }


def record_slots(worker) -> None:
    """Records the cache slots vLLM's first layer writes, in order (on this rank)."""
    from connector.worker.blend.paged_write import attention_modules

    attn = attention_modules(worker.model_runner.model)[0]
    update = attn.impl.do_kv_cache_update
    worker.kvlens_slots = slots = []

    def recording(layer, key, value, kv_cache, slot_mapping):
        slots.extend(int(s) for s in slot_mapping[: key.shape[0]])
        return update(layer, key, value, kv_cache, slot_mapping)

    attn.impl.do_kv_cache_update = recording


def overwrite(worker, token_ids: list[int], zeros: bool) -> int:
    """Writes, into the slots vLLM first wrote ``token_ids`` to, zeros or the blender's K and V."""
    import torch

    from connector.worker.blend.paged_write import attention_modules, write_layer

    slots = torch.tensor(worker.kvlens_slots[: len(token_ids)])
    modules = attention_modules(worker.model_runner.model)
    _, result, _ = full_blend(worker, token_ids)
    with torch.inference_mode():
        for attn, keys, values in zip(modules, result.keys, result.values, strict=True):
            if zeros:
                keys, values = torch.zeros_like(keys), torch.zeros_like(values)
            write_layer(attn, keys, values, slots)
    return len(slots)


def answer(llm, prompt: list[int]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    first = out.outputs[0]
    tops = [{str(t): lp.logprob for t, lp in step.items()} for step in first.logprobs]
    return {"tokens": list(first.token_ids), "tops": tops, "cached": out.num_cached_tokens}


def rewrite(llm, prompt: list[int], cached: int) -> dict:
    """vLLM's answers to ``prompt``: plain, over zeroed KV, over the blender's KV of its first
    ``cached`` tokens (whole blocks, found in vLLM's prefix cache)."""
    llm.collective_rpc(record_slots)
    plain = answer(llm, prompt)
    llm.collective_rpc(overwrite, args=(prompt[:cached], True))
    zeroed = answer(llm, prompt)
    written = llm.collective_rpc(overwrite, args=(prompt[:cached], False))
    blended = answer(llm, prompt)
    return {"plain": plain, "zeroed": zeroed, "blended": blended, "written": written}


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVLensConnector", kv_connector_module_path="connector", kv_role="kv_both"
        ),
        **spec.get("engine", {}),
    )
    ranks = llm.collective_rpc(blend_on_rank, args=(spec["tokens"],))
    selected = llm.collective_rpc(select_on_rank, args=(spec["tokens"],))
    rewritten = rewrite(llm, spec["tokens"], spec["cached"]) if spec.get("cached") else None
    print(json.dumps({"ranks": ranks, "selected": selected, "rewrite": rewritten}))
    sys.stdout.flush()
    import os

    os._exit(0)  # skip vLLM's teardown: nothing is left to flush


if __name__ == "__main__":
    main()
