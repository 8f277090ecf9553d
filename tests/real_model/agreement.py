"""When two greedy answers count as the same: token for token, or parting only where vLLM alone
itself nearly tied.

Two correct ways to compute the same prompt (its KV loaded instead of computed, the first answer
token prefilled instead of decoded, the weights split over ranks, another process's memory
layout) sum in another order. In bf16 that moves a logit by a step or two of its precision (0.25 nat
for logits between 32 and 64), so where vLLM alone's best and second-best next tokens are that
close (often exactly equal: bf16 logits tie), either may come out, and from there the answers go
their own ways. Measured here: vLLM alone, two processes, the same
prompt, bf16: "from 9:00 to 11:00 PM." in one, "from 9:00 to 11:00, and is closed" in the other.
A wrong KV block does not part at a near tie: it changes the answer where vLLM alone was sure.
So an answer is the same as vLLM alone's if it is equal, or if at the first token where they
part, the token it chose is one vLLM alone ranked within ``NEAR_TIE_NATS`` of its own choice
(compared no further: after that the two continue different texts).
"""

from __future__ import annotations

from dataclasses import dataclass

# bf16 keeps 8 bits of mantissa: a logit between 32 and 64 nats is a multiple of 0.25, so two
# orders of summation move it by whole steps of 0.25 (measured: PD answers parting from vLLM
# alone's at margins of 0, 0 and 0.25, three of seven chats); near means within two such steps.
# fp32 steps are 65,536 times finer.
NEAR_TIE_NATS = {"bfloat16": 0.5, "float32": 0.01}


@dataclass(frozen=True)
class Parting:
    position: int
    chosen: int  # the token this answer chose there
    expected: int  # vLLM alone's
    # vLLM alone's logprob of its token minus that of the chosen one (None: not in its top n)
    margin: float | None


def parting(answer: list[int], expected: list[int], top: list[list[list[float]]]) -> Parting | None:
    """Where ``answer`` first parts from vLLM alone's ``expected`` (``top``: vLLM alone's top n
    [token, logprob] pairs per position); None when equal."""
    if answer == expected:
        return None
    i = next(
        (i for i, (a, b) in enumerate(zip(answer, expected, strict=False)) if a != b),
        min(len(answer), len(expected)),
    )
    if i >= len(answer) or i >= len(expected):  # one ended (end of turn) where the other went on
        chosen = answer[i] if i < len(answer) else -1
        return Parting(i, chosen, expected[i] if i < len(expected) else -1, None)
    ranked = {int(token): logprob for token, logprob in top[i]}
    margin = (
        ranked[expected[i]] - ranked[answer[i]] if answer[i] in ranked and expected[i] in ranked else None
    )
    return Parting(i, answer[i], expected[i], margin)


def same_answers(
    answers: list[list[int]], expected: list[list[int]], tops: list[list[list[list[float]]]], dtype: str
) -> list[str]:
    """What is wrong with ``answers`` (empty: each equals vLLM alone's or parts at a near tie)."""
    wrong = []
    for n, (answer, want, top) in enumerate(zip(answers, expected, tops, strict=True)):
        p = parting(answer, want, top)
        if p is not None and (p.margin is None or p.margin > NEAR_TIE_NATS[dtype]):
            wrong.append(f"prompt {n}: {p}")
    return wrong


def partings(answers: list[list[int]], expected: list[list[int]], tops) -> list[Parting]:
    return [p for a, e, t in zip(answers, expected, tops, strict=True) if (p := parting(a, e, t)) is not None]
