"""The connector hands telemetry typed records and never spells a metric key: every field of
every record reaches a series on /metrics, and no connector module builds a wire key."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import types
import typing
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from connector.engine import snapshots
from connector.engine.outcomes import Stage, TierState, TierTraffic
from telemetry.metrics import METRICS, RANK_SEP, SEP, PromRecorder
from telemetry.scheduler_recorder import SchedulerRecorder
from telemetry.settings import TelemetrySettings
from telemetry.worker_recorder import WorkerRecorder

REPO = Path(__file__).resolve().parents[2]
SETTINGS = TelemetrySettings.from_env(None, {"KVLENS_TRACING": "0", "KVLENS_METRICS": "1"})
# Fields of the kv_transfer_params response object that share a metric's short name.
RESPONSE_FIELDS = {
    ("connector/scheduler/responses.py", "hit_tokens"),
    ("connector/scheduler/pd_usage.py", "hit_tokens"),  # the response's field, counting PD's tokens
    ("connector/engine/tracker.py", "hit_tokens"),
    ("connector/engine/tracker.py", "failed_blocks"),
    ("connector/engine/tracker.py", "recomputed_tokens"),
    ("connector/engine/outcomes.py", "recomputed_tokens"),  # a blended response's kvlens.blend
}


class Filler:
    """Builds a record with a distinct value in every field, and remembers what it put where."""

    def __init__(self) -> None:
        self._numbers = itertools.count(7001, 13)
        self.expected: list[tuple[str, object]] = []  # (record.field, value that must show)

    def build(self, cls: type, path: str = "") -> object:
        hints = typing.get_type_hints(cls, vars(snapshots))
        values = {}
        for f in dataclasses.fields(cls):
            values[f.name] = self._value(hints[f.name], f"{path}{cls.__name__}.{f.name}")
        return cls(**values)

    def _value(self, hint: object, where: str) -> object:
        args = typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: fill X
            hint = next(a for a in args if a is not type(None))
            args = typing.get_args(hint)
        if typing.get_origin(hint) is tuple:
            item = args[0]
            if dataclasses.is_dataclass(item):
                return (self.build(item, f"{where}[]."),)
            if item is int:
                return (self._value(int, f"{where}[]"),)
            text = f"v{next(self._numbers)}"
            self.expected.append((where, text))
            return (text,)
        if dataclasses.is_dataclass(hint):
            return self.build(hint, f"{where}.")
        if isinstance(hint, type) and issubclass(hint, TierState):
            self.expected.append((where, TierState.FAILING.level))
            return TierState.FAILING
        if hint is int:
            n = next(self._numbers)
            self.expected.append((where, n))
            return n
        if hint is float:
            x = next(self._numbers) / 8
            self.expected.append((where, x))
            return x
        if hint is str:
            text = f"v{next(self._numbers)}"
            self.expected.append((where, text))
            return text
        raise AssertionError(f"{where}: no filler for {hint!r}; teach this test")


def exposed(payloads: list[dict]) -> tuple[set, set]:
    """Sample values and label values on a registry fed with ``payloads``."""
    registry = CollectorRegistry()
    types_ = {c: partial(c, registry=registry) for c in (Counter, Gauge, Histogram)}
    rec = PromRecorder(types_, ["model_name", "engine"], {0: ["m", "0"]}, None, registry)
    for data in payloads:
        rec.observe(data, 0)
    text = generate_latest(registry).decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return {s.value for s in samples}, {v for s in samples for v in s.labels.values()}


def shows(expected: list[tuple[str, object]], values: set, labels: set) -> list[str]:
    def seen(v: object) -> bool:  # a number as a sample's value or as label text
        if isinstance(v, int | float):
            return float(v) in values or str(v) in labels or f"{v:g}" in labels
        return str(v) in labels

    return [where for where, v in expected if not seen(v)]


def test_every_field_of_the_schedulers_records_reaches_a_series():
    filler = Filler()
    sizes = filler.build(snapshots.SchedulerSizes)
    insight = filler.build(snapshots.InsightSnapshot)
    rec = SchedulerRecorder(SETTINGS, "m", "0", 128, True)
    payload = rec.stats(sizes, lambda: insight, True, {}, {})
    values, labels = exposed([payload])
    missing = shows(filler.expected, values, labels)
    assert not missing, missing


def test_every_field_of_the_workers_records_reaches_a_series():
    filler = Filler()
    sizes = filler.build(snapshots.WorkerSizes)
    rec = WorkerRecorder(SETTINGS, rank=0, block_nbytes=1, sizes=lambda: sizes)
    values, labels = exposed([rec.stats()])
    assert not shows(filler.expected, values, labels)


def test_every_field_of_a_tiers_traffic_reaches_a_series():
    traffic = TierTraffic(7001, 7014, 7027)
    for i, stage in enumerate(Stage):
        traffic.add_moved(stage, 8001 + 13 * i, 0.5 + i)
    rec = SchedulerRecorder(SETTINGS, "m", "0", 128, True)
    rec.traffic_reported({"disk": traffic})
    values, labels = exposed([rec.stats(snapshots.SchedulerSizes(0, 0, 0, 0, 0, 0), None, True, {}, {})])
    expected = [(f, getattr(traffic, f)) for f in ("stored_chunks", "stored_tokens", "stored_bytes")]
    for stage, moved in traffic.moved.items():
        expected += [
            (f"{stage}.nbytes", moved.nbytes),
            (f"{stage}.seconds", moved.seconds),
            (stage, stage.value),
        ]
    assert not shows(expected, values, labels)


def test_every_record_type_is_checked_here():
    records = {
        name
        for name, obj in vars(snapshots).items()
        if dataclasses.is_dataclass(obj) and obj.__module__ == snapshots.__name__
    }
    checked = {"SchedulerSizes", "TierGauge", "TierRetention", "InsightSnapshot", "InstanceInfo"}
    checked |= {"WhatIfPoint", "WorkerSizes"}
    checked |= {"KnownLabels"}  # test_metrics.py: every known label value exists from start-up
    assert records == checked, records ^ checked


def hand_built_keys(path: Path, rel: str) -> list[str]:
    """String constants (f-string parts too) that spell a metric's wire key or short key."""
    keys = set(METRICS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        text = node.value
        head = text.split(SEP, 1)[0].split(RANK_SEP, 1)[0]
        wire = head in keys and (SEP in text or RANK_SEP in text)
        bare = text in keys and (rel, text) not in RESPONSE_FIELDS
        if wire or bare:
            found.append(f"{rel}:{node.lineno}: {text!r}")
    return found


def test_no_connector_module_builds_a_telemetry_key():
    found = [
        hit
        for path in sorted((REPO / "connector").rglob("*.py"))
        for hit in hand_built_keys(path, str(path.relative_to(REPO)))
    ]
    assert not found, found


def test_the_key_check_catches_hand_built_keys(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('a[f"whatif_hit_ratio|{t}|{f:g}"] = 1\na["tier_used_bytes|cpu"] = 2\nb = {"info": 1}\n')
    assert len(hand_built_keys(module, "connector/m.py")) == 3


def test_tier_gauges_of_a_shared_store_carry_its_storage_label():
    from connector.engine.outcomes import TierState
    from connector.engine.snapshots import SchedulerSizes, TierGauge
    from telemetry.encoding import scheduler_gauges

    disk = TierGauge("disk", TierState.HEALTHY, 3, 30, 100, 0, 0, storage="disk:ab12")
    cpu = TierGauge("cpu", TierState.HEALTHY, 1, 10, 50, 0, 0)
    sizes = SchedulerSizes(0, 0, 0, 0, 0, 0, 0, (disk, cpu))
    gauges = scheduler_gauges(sizes, None)
    assert gauges["tier_chunks|disk|disk:ab12"] == 3 and gauges["tier_capacity_bytes|disk|disk:ab12"] == 100
    assert gauges["tier_used_bytes|cpu|"] == 10 and gauges["pinned_chunks|disk"] == 0


def test_every_field_of_the_tenants_usage_reaches_a_series():
    from connector.engine.tenants import TenantUsage

    usage = TenantUsage(
        {"salt:aa": 7001},
        {"salt:aa": 7014},
        {"user:bb": 7027},
        {("salt:aa", "cpu"): 7040},
        {"salt_too_long": 7053},
    )
    rec = SchedulerRecorder(SETTINGS, "m", "0", 128, True)
    sizes = snapshots.SchedulerSizes(0, 0, 0, 0, 0, 0)
    values, labels = exposed([rec.stats(sizes, None, True, {}, {}, usage)])
    expected = [(f.name, v) for f in dataclasses.fields(usage) for v in getattr(usage, f.name).values()]
    shown = [("tenant", "salt:aa"), ("tenant", "user:bb"), ("reason", "salt_too_long")]
    assert not shows([*expected, *shown], values, labels)
    again = rec.stats(
        sizes, None, True, {}, {}, TenantUsage({"salt:aa": 5}, {}, {}, {("salt:aa", "cpu"): 7040})
    )
    assert again["counters"] == {"tenant_lookup_tokens|salt:aa": 5} and not again["gauges"]  # unchanged
