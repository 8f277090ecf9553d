"""A client cannot aim the prefiller at a host of its choice: a disagg_spec naming a receiver the
operator did not list (pd_allowed_receivers; loopback always) is refused before any connection,
counted as spec_refused:receiver_not_allowed, its proxy still told, the request served."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from connector.config.pd import PDConfig
from connector.engine.facts import EngineFacts
from connector.scheduler.pd_prefiller import PDPrefiller

FACTS = EngineFacts("model", "bf16", 128, 4, 1000, "layout", 1, "kv_producer")


def _prefiller(*allowed: str) -> PDPrefiller:
    pd = PDConfig(
        enabled=True,
        role="sender",
        buffer_size=1 << 20,
        proxy_host="h",
        proxy_port=1,
        allowed_receivers=allowed,
    )
    return PDPrefiller(pd, FACTS, "space")


def _request(rid: str, host: str, port: int = 7300) -> SimpleNamespace:
    spec = {
        "req_id": rid,
        "receiver_host": host,
        "receiver_init_port": [port],
        "receiver_alloc_port": [port + 100],
    }
    return SimpleNamespace(request_id=rid, kv_transfer_params={"ret_first_tok": True, "disagg_spec": spec})


@pytest.mark.parametrize(
    "host",
    [
        "169.254.169.254",
        "10.1.2.3",
        "192.168.0.1",
        "metadata.google.internal",
        "fd00::1",
        "redis.internal",
        "0.0.0.0",
    ],
)
def test_a_spec_naming_a_host_the_operator_did_not_list_is_refused_before_any_connection(host, monkeypatch):
    def no_connection(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a refused spec must not connect anywhere")

    monkeypatch.setattr(socket, "create_connection", no_connection)
    prefiller = _prefiller("10.0.0.7:7300")
    req = _request("r-1", host)
    prefiller.note(req)
    (job,) = prefiller.plan({"r-1": SimpleNamespace(prefill_done=True)}, {"r-1": req})
    assert job.refused == "receiver_not_allowed" and job.host == "" and job.chunks == ()
    assert job.notify and job.req_id == "r-1"  # the proxy waiting on it still hears
    assert prefiller.take_refusals() == {"receiver_not_allowed": 1}


def test_a_listed_receiver_gets_a_send_job_and_loopback_always_does():
    prefiller = _prefiller("10.0.0.7:7300")
    for rid, host, port in (("a", "10.0.0.7", 7300), ("b", "127.0.0.1", 9), ("c", "localhost", 7)):
        prefiller.note(_request(rid, host, port))
    assert prefiller.take_refusals() == {}
    prefiller.note(_request("d", "10.0.0.7", 7301))  # the listed host on another port
    assert prefiller.take_refusals() == {"receiver_not_allowed": 1}
