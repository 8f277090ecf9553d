"""A retention ask the operator's rules refuse is counted, by reason, in the scheduler's stats."""

from telemetry.metrics import wire_key

from .test_scheduler_telemetry import admit, make, request


def test_a_refused_retention_ask_is_counted_by_reason(tmp_path):
    sched, tel = make(tmp_path)  # default settings: nobody may retain
    admit(
        sched, tel, request("a", [5] * 600, kv_transfer_params={"kvlens.retention_priority": 3}), range(0, 5)
    )
    admit(sched, tel, request("b", [6] * 600), range(10, 15))  # asked nothing: not counted
    counters = tel.stats()["counters"]
    assert counters[wire_key("retention_refused_requests", "not_allowed")] == 1
    assert counters.get(wire_key("retention_refused_requests", "capped"), 0) == 0
