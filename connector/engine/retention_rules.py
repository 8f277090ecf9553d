"""Who may retain, and how much: the operator's rules over what requests ask (``retention.py``).

A request's ``kvlens.retention_priority`` / ``kvlens.retain_for_s`` is only an ask. It is
granted when the operator lists the request's tenant in ``retention_allowed``: its tenant id
as the metrics show it (``default``, ``salt:3fa1c2d90b``, or one part of a combined id), one of
its tags as ``NAME=VALUE``, or ``*`` for every request. With the list empty (the default)
nobody retains: the ask is ignored and counted. A granted ask is capped at
``retention_max_priority`` and ``retention_max_seconds``; an ask without an end gets that end,
so no request retains indefinitely. Each tenant's retained bytes per tier are capped too
(``max_retained_share_per_tenant``, applied by ``RetentionBook``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .retention import MAX_PRIORITY, MAX_SECONDS, Retention

ANYONE = "*"
NOT_ALLOWED = "not_allowed"  # the tenant is not in retention_allowed: nothing retained
CAPPED = "capped"  # priority or seconds lowered to the operator's maximum
REFUSALS = (NOT_ALLOWED, CAPPED)  # metric label values


@dataclass(frozen=True, slots=True)
class RetentionRules:
    allowed: frozenset[str] = frozenset()  # nobody
    max_priority: int = MAX_PRIORITY
    max_seconds: float = MAX_SECONDS

    @classmethod
    def of(cls, allowed: Iterable[str], max_priority: int, max_seconds: float) -> RetentionRules:
        return cls(frozenset(allowed), max_priority, max_seconds)

    def allows(self, tenant: str, tags: Mapping[str, str]) -> bool:
        if ANYONE in self.allowed or tenant in self.allowed:
            return True
        if any(part in self.allowed for part in tenant.split(",")):
            return True
        return any(f"{name}={value}" in self.allowed for name, value in tags.items())

    def grant(
        self, asked: Retention | None, tenant: str, tags: Mapping[str, str]
    ) -> tuple[Retention | None, str | None]:
        """What the request gets, and why it got less than it asked (None: all it asked)."""
        if asked is None:
            return None, None
        if not self.allows(tenant, tags):
            return None, NOT_ALLOWED
        priority = min(asked.priority, self.max_priority)
        capped = priority < asked.priority or (asked.seconds or 0.0) > self.max_seconds
        if priority == 0:
            return None, CAPPED
        seconds = self.max_seconds if asked.seconds is None else min(asked.seconds, self.max_seconds)
        return Retention(priority, seconds), CAPPED if capped else None
