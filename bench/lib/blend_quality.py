"""How far a blended prompt's KV lands from a full prefill's, on a RAG-shaped prompt.

The prompt is LMCache's blend flow: a system prompt, documents of ``rag_set`` and a question,
joined by the separator's token ids (``" # # "``), inside the model's chat turns. The system
prompt and each document are computed alone at position 0 (as a first prompt that held them
would store them), the documents' K moved to where they sit now; the separators and the
question have no reused KV. What is measured against the full prefill of the same prompt: the
relative K and V error of the last layers, the next-token logits' distance (L2 and KL) and the
greedy answer from the KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from connector.config.blend import DEFAULT_SEPARATOR
from connector.worker.blend.assemble import LoadedChunk, blend_input
from connector.worker.blend.blender import BlendInput, BlendResult, blend
from connector.worker.blend.hf_llama import HFLlama, prefill_kv
from connector.worker.blend.selection import CheckLayer

from . import rag_set

LAST_LAYERS = 4  # the KV error is reported over these last layers
# The chat template's turns around the parts, so the instruct model answers (ChatML, SmolLM2's).
SYSTEM_TURN = "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n"
ANSWER_TURN = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class RagPrompt:
    token_ids: torch.Tensor  # [T]
    reused_parts: tuple[tuple[int, int], ...]  # (start, length) of the system prompt and documents


def rag_prompt(tokenizer, question: rag_set.Question, order: tuple[str, ...]) -> RagPrompt:  # type: ignore[no-untyped-def]
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    separator = ids(DEFAULT_SEPARATOR)
    texts = [SYSTEM_TURN.format(rag_set.SYSTEM_PROMPT), *(rag_set.document(k).render() for k in order)]
    tokens: list[int] = []
    parts = []
    for text in texts:
        part = ids(text)
        parts.append((len(tokens), len(part)))
        tokens += part + separator
    tokens += ids(rag_set.QUESTION_PREFIX + question.text + ANSWER_TURN)
    return RagPrompt(torch.tensor(tokens), tuple(parts))


@torch.no_grad()
def reused_input(model: HFLlama, prompt: RagPrompt) -> BlendInput:
    """Each reused part's KV computed alone at position 0, K moved to the part's start."""
    chunks = []
    for start, length in prompt.reused_parts:
        part_k, part_v, _ = prefill_kv(model.model, prompt.token_ids[start : start + length])
        chunks.append(LoadedChunk(start, 0, part_k, part_v))
    return blend_input(prompt.token_ids, chunks, model.rope_shift(), torch.float32)


@torch.no_grad()
def greedy_from_kv(
    model: HFLlama, keys: list[torch.Tensor], values: list[torch.Tensor], token_ids: torch.Tensor, steps: int
) -> list[int]:
    """Greedy tokens after the prompt whose KV (but the last token's) is given: the last token is
    computed over it, as vLLM computes it after a connector's load."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k[:-1].transpose(0, 1)[None], v[:-1].transpose(0, 1)[None], layer)
    position, token, out = token_ids.shape[0] - 1, token_ids[-1:], []
    for _ in range(steps):
        logits = model.model(
            input_ids=token[None],
            position_ids=torch.tensor([[position]]),
            past_key_values=cache,
            use_cache=True,
        ).logits[0, -1]
        token = logits.argmax().view(1)
        out.append(int(token))
        position += 1
    return out


@dataclass(frozen=True)
class Measure:
    ratio: float
    recomputed: int
    tokens: int
    k_error: float  # ||K - K_full|| / ||K_full|| over the last LAST_LAYERS layers
    v_error: float
    logits_l2: float
    logits_kl: float  # KL(full || blended) of the next-token distributions
    greedy: list[int]
    check_deviation_mean: float
    check_deviation_max: float
    result: BlendResult


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g - w).pow(2).sum()) for g, w in zip(got, want, strict=True))
    return (num / sum(float(w.pow(2).sum()) for w in want)) ** 0.5


@torch.no_grad()
def measure(
    model: HFLlama,
    reused: BlendInput,
    full: tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor],
    ratio: float,
    steps: int,
    check_layer: int = 1,
) -> Measure:
    result = blend(model, reused, [CheckLayer(check_layer, ratio)])
    keys, values, logits = full
    got = model.logits(result.last_hidden)
    log_full, log_got = torch.log_softmax(logits, -1), torch.log_softmax(got, -1)
    check = result.report.checks[0]
    return Measure(
        ratio=ratio,
        recomputed=result.report.recomputed,
        tokens=result.report.tokens,
        k_error=relative_error(result.keys[-LAST_LAYERS:], keys[-LAST_LAYERS:]),
        v_error=relative_error(result.values[-LAST_LAYERS:], values[-LAST_LAYERS:]),
        logits_l2=float((got - logits).norm()),
        logits_kl=float((log_full.exp() * (log_full - log_got)).sum()),
        greedy=greedy_from_kv(model, result.keys, result.values, reused.token_ids, steps) if steps else [],
        check_deviation_mean=check.deviation_mean,
        check_deviation_max=check.deviation_max,
        result=result,
    )
