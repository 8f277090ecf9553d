"""Which KVLens instances can share KV, why others cannot, how their tiers are, and what the
what-if curves advise: the analysis behind ``kvlens doctor``, from the series each instance
serves on ``/metrics``. Pure (parsed samples in, findings out), so the dashboard can use it.

Two engines exchange KV only when their chunk keys agree (``key_fingerprint``: model, weights,
dtype, KV layout, parallel size, key version), they cut prompts into the same chunks
(``chunk_size``) and they reach a common store (``storage``: the same disk directory on the
same host, or the same Redis under the same key prefix). ``vllm:kvlens_info`` carries each.
Only instances with a KVLens tier take part: a PD engine keeps none (``local_cpu: False``, its
only job is to hand KV over or receive it), so it is told as PD only, never as an instance that
cannot share through stores, and an instance without a tier is not "CPU only".

PD (prefill/decode disaggregation): whether each prefiller can pair with each decoder is
``doctor_pd.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .doctor_pd import USUAL_ROLE, PDPair, Probe, pd_missing_partner, pd_pairs, pd_summary
from .instances import INFO as INFO
from .instances import TIER_HEALTH as TIER_HEALTH
from .instances import WHATIF as WHATIF
from .instances import Instance as Instance
from .instances import Sample as Sample
from .instances import instances as instances

HEALTH_WORDS = {2: "healthy", 1: "failing (still used)", 0: "skipped (unusable)"}
GROW_GAIN = 0.05  # a doubled tier that hits this much more is worth growing
SHRINK_LOSS = 0.01  # a halved tier that hits at most this much less could be smaller


def why_no_instance(samples: Iterable[Sample]) -> str:
    """Why a URL's samples describe no KVLens engine. vLLM publishes a connector's series with
    the engine's steps, so a KVLens engine that has served nothing yet shows its zeroed families
    but no ``vllm:kvlens_info``: that is not "KVLens is not loaded"."""
    if any(name.startswith("vllm:kvlens_") for name, _, _ in samples):
        return (
            "KVLens is loaded, but has not published vllm:kvlens_info yet: vLLM publishes it when the "
            "engine first steps (serve it one request, then run doctor again)"
        )
    return "no vllm:kvlens_info series: KVLens is not loaded there"


def differences(a: Instance, b: Instance) -> list[str]:
    """Why ``a`` and ``b`` cannot share KV; empty when they can."""
    why = []
    ia, ib = a.info, b.info
    if ia.get("key_fingerprint") != ib.get("key_fingerprint"):
        parts = [
            (label, words)
            for label, words in (
                ("model_identity", "model weights differ"),
                ("quantization", "quantization differs"),
                ("kv_cache_dtype", "KV cache dtype differs"),
            )
            if ia.get(label) != ib.get(label)
        ]
        if parts:
            why += [f"{words} ({ia.get(label) or '?'} vs {ib.get(label) or '?'})" for label, words in parts]
        else:
            why.append(
                "keys differ with the same model: KV layout, parallel size (world size), compute dtype, "
                "LoRA or key version (KVLens " + f"{ia.get('version', '?')} vs {ib.get('version', '?')})"
            )
    if ia.get("chunk_size") != ib.get("chunk_size"):
        why.append(f"chunk sizes differ ({ia.get('chunk_size')} vs {ib.get('chunk_size')})")
    if not a.stores & b.stores:
        why.append(f"no common store ({_stores_words(a)} vs {_stores_words(b)})")
    return why


def _stores_words(inst: Instance) -> str:
    return ",".join(sorted(inst.stores)) or ("CPU only" if inst.has_tier else "no KVLens tier")


def sharing_groups(found: list[Instance]) -> list[list[Instance]]:
    """Instances connected by pairs that can share (through a common store), in order found."""
    groups: list[list[Instance]] = []
    for inst in found:
        joined = [g for g in groups if any(not differences(inst, other) for other in g)]
        merged = [inst] + [i for g in joined for i in g]
        groups = [g for g in groups if g not in joined] + [merged]
    return [
        sorted(g, key=lambda i: found.index(i))
        for g in sorted(groups, key=lambda g: min(map(found.index, g)))
    ]


def summary(inst: Instance) -> str:
    """What an instance is, in one line: its tiers and role, or what it does in PD."""
    if inst.pd_role in USUAL_ROLE:
        return pd_summary(inst)
    tiers = f"tiers {inst.info['tiers']}" if inst.has_tier else "no KVLens tier"
    return f"{tiers}, role {inst.info.get('role', '?')}"


def tier_findings(inst: Instance) -> list[str]:
    return [
        f"{tier} tier: {HEALTH_WORDS.get(int(level), f'health {level:g}')}"
        for tier, level in sorted(inst.health.items())
    ]


def whatif_advice(inst: Instance) -> list[str]:
    out = []
    for tier, curve in sorted(inst.whatif.items()):
        now = curve.get(1.0)
        if now is None:
            continue
        bigger = [(f, r) for f, r in sorted(curve.items()) if f > 1 and r - now >= GROW_GAIN]
        half = curve.get(0.5)
        if bigger:
            factor, ratio = bigger[0]
            out.append(
                f"{tier} tier: {factor:g}x its size would hit {ratio:.0%} of tokens, not {now:.0%}; grow it"
            )
        elif half is not None and now - half <= SHRINK_LOSS and now > 0:
            out.append(
                f"{tier} tier: half its size would still hit {half:.0%} (now {now:.0%}); it could shrink"
            )
        else:
            out.append(
                f"{tier} tier: sized about right (hits {now:.0%}; a larger one would gain < {GROW_GAIN:.0%})"
            )
    return out


@dataclass(slots=True)
class Diagnosis:
    instances: list[Instance]
    unreachable: dict[str, str]  # url -> why
    groups: list[list[Instance]]
    apart: list[tuple[Instance, Instance, list[str]]]  # pairs in different groups, and why
    pd: list[PDPair] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "instances": [
                {
                    "url": i.url,
                    "engine": i.engine,
                    "summary": f"{i.name}: {summary(i)}",
                    "identity": dict(i.info),  # its kvlens_info labels
                    "tiers": tier_findings(i),
                    "advice": whatif_advice(i),
                }
                for i in self.instances
            ],
            "unreachable": self.unreachable,
            "share_groups": [[i.name for i in g] for g in self.groups],
            "cannot_share": [{"a": a.name, "b": b.name, "why": why} for a, b, why in self.apart],
            "pd_pairs": [
                {
                    "prefiller": p.sender.name,
                    "decoder": p.receiver.name,
                    "can_pair": p.can_pair,
                    "differences": p.differences,
                    "unreachable": p.unreachable,
                    "reachability_checked": p.checked,
                    "warnings": p.warnings,
                    "verdict": p.verdict(),
                }
                for p in self.pd
            ],
            "pd_missing_partner": pd_missing_partner(self.instances),
        }


def diagnose(
    found: list[Instance], unreachable: Mapping[str, str] | None = None, probe: Probe | None = None
) -> Diagnosis:
    groups = sharing_groups([i for i in found if i.has_tier])  # PD-only engines share no store
    apart = []
    heads = [g[0] for g in groups]
    for i, a in enumerate(heads):
        for b in heads[i + 1 :]:
            apart.append((a, b, differences(a, b)))
    return Diagnosis(found, dict(unreachable or {}), groups, apart, pd_pairs(found, probe))


def text(d: Diagnosis) -> str:
    lines = []
    for url, why in d.unreachable.items():
        lines.append(f"{url}: not read ({why})")
    if not d.instances:
        lines.append("no KVLens instance found")
        return "\n".join(lines)
    if d.groups:
        lines.append("groups that can share KV:")
    for n, group in enumerate(d.groups, 1):
        first = group[0].info
        what = f"fingerprint {first.get('key_fingerprint')}, chunk size {first.get('chunk_size')}"
        lines.append(f"  group {n} ({what}): " + ", ".join(i.name for i in group))
    if d.apart:
        lines.append("cannot share:")
        for a, b, why in d.apart:
            lines.append(f"  {a.name} / {b.name}: " + "; ".join(why))
    lines += [p.verdict() for p in d.pd]
    if missing := pd_missing_partner(d.instances):
        lines.append(missing)
    for inst in d.instances:
        findings = tier_findings(inst) + whatif_advice(inst)
        lines.append(f"{inst.name}: {summary(inst)}")
        lines += [f"  {f}" for f in findings]
    return "\n".join(lines)
