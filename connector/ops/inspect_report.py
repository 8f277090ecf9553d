"""What a store holds, summarised for ``kvlens inspect``: chunks, bytes, namespaces, ages and
damaged records. Pure: it reads the records ``store_records`` listed."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..engine.namespace_records import NamespaceRecord
from ..tiers.store_records import ChunkRecord
from .units import human_bytes

AGE_BUCKETS = (
    (60.0, "< 1 min"),
    (600.0, "< 10 min"),
    (3600.0, "< 1 h"),
    (86400.0, "< 1 day"),
    (7 * 86400.0, "< 7 days"),
    (math.inf, ">= 7 days"),
)
UNKNOWN_AGE = "unknown"
MAX_DAMAGED_LISTED = 20


@dataclass(slots=True)
class NamespaceUsage:
    fingerprint: str  # "" for records that predate namespace fingerprints
    record: NamespaceRecord | None  # None: no namespace record found for it
    chunks: set[str] = field(default_factory=set)
    records: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        r = self.record
        identity = r.identity if r is not None else None
        return {
            "fingerprint": self.fingerprint or None,
            "chunks": len(self.chunks),
            "records": self.records,
            "bytes": self.bytes,
            "described": r is not None,
            "model": r.weights if r is not None else None,
            "quantization": identity.quantization if identity is not None else None,
            "kv_cache_dtype": identity.kv_cache_dtype if identity is not None else None,
            "dtype": r.dtype if r is not None else None,
            "kv_layout": r.kv_layout if r is not None else None,
            "world_size": r.world_size if r is not None else None,
            "lora": r.lora if r is not None else None,
            "salted": r.salted if r is not None else None,
            "tags": list(r.tag_names) if r is not None else None,
            "chunk_size": (r.chunk_size or None) if r is not None else None,
        }


@dataclass(slots=True)
class InspectReport:
    where: str
    chunks: int = 0
    records: int = 0
    bytes: int = 0
    namespaces: list[NamespaceUsage] = field(default_factory=list)
    ages: dict[str, int] = field(default_factory=dict)  # records per age bucket
    damaged: int = 0
    damaged_examples: list[tuple[str, str]] = field(default_factory=list)  # (record, why)
    damaged_namespace_records: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "where": self.where,
            "chunks": self.chunks,
            "records": self.records,
            "bytes": self.bytes,
            "namespaces": [n.to_json() for n in self.namespaces],
            "age_histogram": self.ages,
            "damaged_records": self.damaged,
            "damaged_examples": [{"record": n, "why": w} for n, w in self.damaged_examples],
            "damaged_namespace_records": self.damaged_namespace_records,
        }


def summarise(
    where: str,
    chunks: Iterable[ChunkRecord],
    records: Iterable[NamespaceRecord],
    damaged_records: Iterable[str],
    now_s: float,
) -> InspectReport:
    report = InspectReport(where, damaged_namespace_records=sorted(damaged_records))
    described = {r.fingerprint: r for r in records}
    usage: dict[str, NamespaceUsage] = {}
    digests: set[str] = set()
    report.ages = {label: 0 for _, label in AGE_BUCKETS} | {UNKNOWN_AGE: 0}
    for chunk in chunks:
        report.records += 1
        report.bytes += chunk.stored_bytes
        digests.add(chunk.digest)
        report.ages[_age_bucket(chunk.written_s, now_s)] += 1
        if chunk.damage is not None:
            report.damaged += 1
            if len(report.damaged_examples) < MAX_DAMAGED_LISTED:
                report.damaged_examples.append((chunk.name, chunk.damage))
            continue
        ns = usage.get(chunk.namespace)
        if ns is None:
            ns = usage[chunk.namespace] = NamespaceUsage(chunk.namespace, described.get(chunk.namespace))
        ns.chunks.add(chunk.digest)
        ns.records += 1
        ns.bytes += chunk.stored_bytes
    for fp, record in described.items():  # described namespaces whose chunks are all gone
        usage.setdefault(fp, NamespaceUsage(fp, record))
    report.chunks = len(digests)
    report.namespaces = sorted(usage.values(), key=lambda n: (-n.bytes, n.fingerprint))
    return report


def _age_bucket(written_s: float | None, now_s: float) -> str:
    if written_s is None:
        return UNKNOWN_AGE
    age = max(now_s - written_s, 0.0)
    return next(label for limit, label in AGE_BUCKETS if age < limit)


def text(report: InspectReport) -> str:
    lines = [
        f"{report.where}: {report.chunks} chunks in {report.records} records, {human_bytes(report.bytes)}",
        "",
        "namespaces (key fingerprint: what the chunk records name):",
    ]
    header = (
        "fingerprint",
        "chunks",
        "bytes",
        "model",
        "quant",
        "kv dtype",
        "world",
        "lora",
        "salted",
        "tags",
    )
    rows = [header]
    others = []
    for ns in report.namespaces:
        d = ns.to_json()
        if ns.record is None:
            what = (
                "records written before they named their namespace"
                if not ns.fingerprint
                else "no namespace record"
            )
            others.append(
                f"  {ns.fingerprint or '(unknown)'}  {d['chunks']} chunks  {human_bytes(ns.bytes)}  ({what})"
            )
            continue
        rows.append(
            (
                ns.fingerprint,
                str(d["chunks"]),
                human_bytes(ns.bytes),
                _short(d["model"], 28),
                d["quantization"] or "?",
                d["kv_cache_dtype"] or "?",
                str(d["world_size"]),
                _short(d["lora"], 16) if d["lora"] else "-",
                "yes" if d["salted"] else "no",
                ",".join(d["tags"]) or "-",
            )
        )
    if len(rows) > 1:
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += others or ([] if len(rows) > 1 else ["  (none)"])
    lines += ["", "age of records (since written):"]
    lines += [
        f"  {label:<10} {count}" for label, count in report.ages.items() if count or label != UNKNOWN_AGE
    ]
    lines += ["", f"damaged records: {report.damaged}"]
    lines += [f"  {name}  {why}" for name, why in report.damaged_examples]
    if report.damaged > len(report.damaged_examples):
        lines.append(f"  ... and {report.damaged - len(report.damaged_examples)} more")
    if report.damaged_namespace_records:
        lines.append("unreadable namespace records: " + ", ".join(report.damaged_namespace_records))
    return "\n".join(lines)


def _short(value: str | None, n: int) -> str:
    if not value:
        return "?"
    return value if len(value) <= n else value[: n - 1] + "…"
