"""Which KVLens instances can share KV, why others cannot, how their tiers are, and what the
what-if curves advise: the analysis behind ``kvlens doctor``, from the series each instance
serves on ``/metrics``. Pure (parsed samples in, findings out), so the dashboard can use it.

Two engines exchange KV only when their chunk keys agree (``key_fingerprint``: model, weights,
dtype, KV layout, parallel size, key version), they cut prompts into the same chunks
(``chunk_size``) and they reach a common store (``storage``: the same disk directory on the
same host, or the same Redis under the same key prefix). ``vllm:kvlens_info`` carries each.

PD (prefill/decode disaggregation): a prefiller (``pd_role`` sender) and a decoder (receiver)
pair when their keys agree (key space), their TP sizes, block sizes, chunk sizes and record
layouts are equal (rank r sends rank r its records as they are), each is in its role, the decoder
has one init and one alloc port per rank reachable from here, and the prefiller's proxy
(``pd_proxy_host:pd_proxy_port``) is reachable from here. Reachability is a TCP connect made by
the caller's ``probe`` (``tcp_probe``); without one it is not checked.

A diagnosis must not count as a failure on the decoder. Doctor does not speak the PD handshake
(``pd.probe.probe_receiver``): it has no PD key, and a handshake it cannot finish against a keyed
decoder is an ``auth_failed`` there (a TLS decoder would need the CA too), while identities are
compared from ``vllm:kvlens_info`` anyway. It connects and closes before sending a byte, which
no transfer ever does, and the receiver takes such a connection as a probe, counted nowhere
(``pd/receiver.py`` ``_closes_unheard``; load balancers' and Kubernetes's TCP checks look the
same). So one check serves keyed, loopback, unauthenticated and TLS decoders alike.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

INFO = "vllm:kvlens_info"
TIER_HEALTH = "vllm:kvlens_tier_health"
WHATIF = "vllm:kvlens_whatif_hit_ratio"
HEALTH_WORDS = {2: "healthy", 1: "failing (still used)", 0: "skipped (unusable)"}
GROW_GAIN = 0.05  # a doubled tier that hits this much more is worth growing
SHRINK_LOSS = 0.01  # a halved tier that hits at most this much less could be smaller

Sample = tuple[str, Mapping[str, str], float]  # name, labels, value


@dataclass(frozen=True, slots=True)
class Instance:
    """One engine behind one URL (a data-parallel server has one per engine)."""

    url: str
    engine: str
    info: Mapping[str, str]  # vllm:kvlens_info's labels
    health: Mapping[str, float] = field(default_factory=dict)  # tier -> 2 / 1 / 0
    whatif: Mapping[str, Mapping[float, float]] = field(default_factory=dict)  # tier -> factor -> ratio

    @property
    def name(self) -> str:
        return self.url if self.engine in ("", "0") else f"{self.url} (engine {self.engine})"

    @property
    def stores(self) -> set[str]:
        return {s for s in self.info.get("storage", "").split(",") if s}

    @property
    def pd_role(self) -> str:
        return self.info.get("pd_role", "")


def instances(url: str, samples: Iterable[Sample]) -> list[Instance]:
    """The KVLens engines one URL's samples describe (none: KVLens is not running there)."""
    info: dict[str, dict[str, str]] = {}
    health: dict[str, dict[str, float]] = {}
    whatif: dict[str, dict[str, dict[float, float]]] = {}
    for name, labels, value in samples:
        engine = labels.get("engine", "")
        if name == INFO and value:
            info[engine] = {k: v for k, v in labels.items() if k not in ("engine", "model_name")}
        elif name == TIER_HEALTH and "tier" in labels:
            health.setdefault(engine, {})[labels["tier"]] = value
        elif name == WHATIF and "tier" in labels and "budget_factor" in labels:
            try:
                factor = float(labels["budget_factor"])
            except ValueError:
                continue
            whatif.setdefault(engine, {}).setdefault(labels["tier"], {})[factor] = value
    return [
        Instance(url, engine, labels, health.get(engine, {}), whatif.get(engine, {}))
        for engine, labels in sorted(info.items())
    ]


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
        why.append(
            "no common store ("
            + (",".join(sorted(a.stores)) or "CPU only")
            + " vs "
            + (",".join(sorted(b.stores)) or "CPU only")
            + ")"
        )
    return why


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


# ---- PD pairing --------------------------------------------------------------------------------
Probe = Callable[[str, int], str | None]  # (host, port) -> None when it accepts a connection, else why
SENDER, RECEIVER = "sender", "receiver"
_ANY_HOST = ("", "0.0.0.0", "::", "[::]")
# (label, words) of the identity fields a prefiller and a decoder must have equal
_PD_EQUAL = (
    ("tp_size", "TP size"),
    ("block_size", "block size"),
    ("chunk_size", "chunk size"),
    ("record_layout", "record layout"),
)


def tcp_probe(host: str, port: int, timeout_s: float = 2.0) -> str | None:
    """None when ``host:port`` accepts a TCP connection, else the OS's reason. Nothing is sent: a
    PD receiver takes a connection closed before its first byte as a probe, not a failure."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


@dataclass(slots=True)
class PDPair:
    sender: Instance
    receiver: Instance
    differences: list[str]  # why they cannot pair (identity, roles, ports)
    unreachable: list[str]  # what cannot be reached from here (None probe: not checked)
    checked: bool  # whether reachability was probed
    warnings: list[str] = field(default_factory=list)  # what the pair exposes (no key beyond loopback)

    @property
    def can_pair(self) -> bool:
        return not self.differences and not self.unreachable

    def verdict(self) -> str:
        head = f"PD {self.sender.name} -> {self.receiver.name}:"
        if self.differences:
            return f"{head} CANNOT pair: " + "; ".join(self.differences)
        if self.unreachable:
            return f"{head} identities match, but not reachable from here: " + "; ".join(self.unreachable)
        said = f"{head} can pair" + ("" if self.checked else " (ports not probed)")
        return "; ".join([said, *self.warnings])


def _split_ports(value: str) -> list[int]:
    out = []
    for part in value.split(","):
        try:
            out.append(int(part))
        except ValueError:
            continue
    return out


def pd_differences(sender: Instance, receiver: Instance) -> list[str]:
    """Why ``sender`` cannot hand its prompts' KV to ``receiver``; empty when it can."""
    s, r = sender.info, receiver.info
    why = []
    if sender.pd_role != SENDER:
        why.append(f"{sender.name} is not a PD sender (pd_role {sender.pd_role or 'unset: PD off'})")
    if receiver.pd_role != RECEIVER:
        why.append(f"{receiver.name} is not a PD receiver (pd_role {receiver.pd_role or 'unset: PD off'})")
    if s.get("key_fingerprint") != r.get("key_fingerprint"):
        parts = [
            f"{words} ({s.get(label) or '?'} vs {r.get(label) or '?'})"
            for label, words in (
                ("model_identity", "model weights differ"),
                ("quantization", "quantization differs"),
                ("kv_cache_dtype", "KV cache dtype differs"),
            )
            if s.get(label) != r.get(label)
        ]
        key = f"key space differs ({s.get('key_fingerprint') or '?'} vs {r.get('key_fingerprint') or '?'})"
        why.append(key + (": " + ", ".join(parts) if parts else ""))
    for label, words in _PD_EQUAL:
        if s.get(label) != r.get(label):
            why.append(f"{words} differs ({s.get(label) or '?'} vs {r.get(label) or '?'})")
    if receiver.pd_role == RECEIVER:
        ranks = _tp(r)
        for label in ("pd_init_ports", "pd_alloc_ports"):
            ports = _split_ports(r.get(label, ""))
            if ranks and len(ports) != ranks:
                why.append(
                    f"{receiver.name} has {len(ports)} {label[3:-1].replace('_', ' ')}s for {ranks} ranks"
                )
    if sender.pd_role == SENDER and not s.get("pd_proxy"):
        why.append(f"{sender.name} names no proxy (pd_proxy_host, pd_proxy_port)")
    if (s.get("pd_auth") == "key") != (r.get("pd_auth") == "key"):
        keyed = sender if s.get("pd_auth") == "key" else receiver
        why.append(f"only {keyed.name} has a PD key (pd_auth_key): the handshake fails as auth_failed")
    if (s.get("pd_tls") == "on") != (r.get("pd_tls") == "on"):
        why.append(f"TLS differs (pd_tls {s.get('pd_tls') or 'off'} vs {r.get('pd_tls') or 'off'})")
    return why


def pd_warnings(sender: Instance, receiver: Instance) -> list[str]:
    """What a pair that can pair exposes: PD without a key beyond loopback."""
    return [
        f"{i.name} runs PD UNAUTHENTICATED (pd_allow_unauthenticated: true): anyone who reaches "
        "its PD ports can hand a decoder KV or receive a prefiller's; set pd_auth_key on both"
        for i in (sender, receiver)
        if i.info.get("pd_auth") == "unauthenticated"
    ]


def _tp(info: Mapping[str, str]) -> int:
    try:
        return int(info.get("tp_size", "") or 0)
    except ValueError:
        return 0


def _host_port(value: str) -> tuple[str, int] | None:
    host, _, port = value.rpartition(":")
    try:
        return (host.strip("[]"), int(port)) if host else None
    except ValueError:
        return None


def pd_reachability(sender: Instance, receiver: Instance, probe: Probe) -> list[str]:
    """The decoder's init and alloc ports and the prefiller's proxy that refuse a connection from
    here (a decoder bound on every interface is tried at its URL's host)."""
    r = receiver.info
    host = r.get("pd_host", "")
    if host in _ANY_HOST:
        host = urlsplit(receiver.url).hostname or ""
    out = []
    for label in ("pd_init_ports", "pd_alloc_ports"):
        for port in _split_ports(r.get(label, "")):
            if (why := probe(host, port)) is not None:
                out.append(f"decoder {label[3:-1].replace('_', ' ')} {host}:{port} ({why})")
    proxy = _host_port(sender.info.get("pd_proxy", ""))
    if proxy is not None and (why := probe(*proxy)) is not None:
        out.append(f"proxy {proxy[0]}:{proxy[1]} ({why})")
    return out


def pd_pairs(found: list[Instance], probe: Probe | None = None) -> list[PDPair]:
    """Every PD sender with every PD receiver among ``found``, in order found."""
    senders = [i for i in found if i.pd_role == SENDER]
    receivers = [i for i in found if i.pd_role == RECEIVER]
    out = []
    for s in senders:
        for r in receivers:
            why = pd_differences(s, r)
            unreachable = pd_reachability(s, r, probe) if probe is not None and not why else []
            out.append(PDPair(s, r, why, unreachable, probe is not None and not why, pd_warnings(s, r)))
    return out


def pd_missing_partner(found: list[Instance]) -> str | None:
    """A sentence when PD instances were given without a partner of the other role."""
    roles = {i.pd_role for i in found}
    if SENDER in roles and RECEIVER not in roles:
        return "PD: a prefiller (pd_role sender) but no decoder (pd_role receiver) among the URLs"
    if RECEIVER in roles and SENDER not in roles:
        return "PD: a decoder (pd_role receiver) but no prefiller (pd_role sender) among the URLs"
    return None


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
    groups = sharing_groups(found)
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
        lines.append(f"{inst.name}: tiers {inst.info.get('tiers', '?')}, role {inst.info.get('role', '?')}")
        lines += [f"  {f}" for f in findings]
    return "\n".join(lines)
