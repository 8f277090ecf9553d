"""The KVLens engines behind vLLM server URLs, read from the series they serve on ``/metrics``:
what ``kvlens doctor`` (``doctor.py``, ``doctor_pd.py``) reasons about. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

INFO = "vllm:kvlens_info"
TIER_HEALTH = "vllm:kvlens_tier_health"
WHATIF = "vllm:kvlens_whatif_hit_ratio"

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

    @property
    def has_tier(self) -> bool:
        return bool(self.info.get("tiers"))


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
