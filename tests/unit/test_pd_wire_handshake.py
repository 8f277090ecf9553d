"""PD handshake: a prefiller and a decoder that would key or lay out chunks differently never
exchange a byte of KV; both sides name every field that differs."""

from __future__ import annotations

import logging

import pytest

from connector.pd.identity import PeerIdentity
from connector.pd.probe import probe_receiver
from connector.pd.sender import PDSender

from .pd_wire_support import HOST, assert_idle, identity, receiver, records, send

FIELDS = {
    "tp_size": 2,
    "block_size": 32,
    "chunk_size": 512,
    "key_space": "ks-other-model",
    "record_layout": "fp16/l4/kvh2/hd64/v1",
}


def test_differences_names_fields_in_declaration_order():
    a = identity()
    assert a.differences(a) == []
    b = identity(tp=2, block_size=32, record_layout="x")
    assert a.differences(b) == ["tp_size", "block_size", "record_layout"]
    assert a.differences(identity(rank=1)) == ["tp_rank"]


@pytest.mark.parametrize("bad", [None, [], {"tp_size": 1}, {**identity().to_wire(), "tp_size": "1"}])
def test_a_malformed_identity_is_refused(bad):
    with pytest.raises(ValueError):
        PeerIdentity.from_wire(bad)
    assert PeerIdentity.from_wire(identity().to_wire()) == identity()


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_a_differing_field_is_refused_and_named_on_both_sides(field, caplog):
    changes = {"tp": FIELDS[field]} if field == "tp_size" else {field: FIELDS[field]}
    caplog.set_level(logging.WARNING, logger="connector.pd")
    with receiver() as rx:
        tx = PDSender(identity(**changes), 2.0, 5.0)
        try:
            outcome = send(tx, rx.init_ports[0], records(2, 4096, 10))
        finally:
            tx.close()
        assert not outcome.ok and outcome.reason == f"mismatch:{field}"
        assert rx.stats().failed == {"mismatch": 1}
        assert tx.stats().failed == {"mismatch": 1}
        assert_idle(rx)
    sides = [r.getMessage() for r in caplog.records if f"mismatch:{field}" in r.getMessage()]
    assert any("handshake refused on rank 0" in m for m in sides), sides  # the receiver's log
    assert any("PD receiver" in m for m in sides), sides  # the sender's log


def test_several_differing_fields_are_all_named():
    with receiver() as rx:
        tx = PDSender(identity(tp=4, block_size=32, key_space="other"), 2.0, 5.0)
        try:
            outcome = send(tx, rx.init_ports[0], records(1, 100, 100))
        finally:
            tx.close()
    assert outcome.reason == "mismatch:key_space,tp_size,block_size"


def test_rank_r_sends_only_to_rank_r():
    with receiver(tp=2) as rx:
        tx = PDSender(identity(rank=0, tp=2), 2.0, 5.0)
        try:
            outcome = send(tx, rx.init_ports[1], records(1, 100, 100))
        finally:
            tx.close()
        assert outcome.reason == "mismatch:tp_rank"
        assert_idle(rx)


def test_a_probe_of_the_alloc_port_tells_whether_the_two_can_pair_and_allocates_nothing():
    with receiver(buffer_bytes=1 << 16) as rx:
        good = probe_receiver(HOST, rx.alloc_ports[0], identity())
        assert good.ok and good.reason is None and good.identity == identity()
        assert good.capacity_bytes == 1 << 16 and good.free_bytes == 1 << 16
        bad = probe_receiver(HOST, rx.alloc_ports[0], identity(chunk_size=1024))
        assert not bad.ok and bad.reason == "mismatch:chunk_size"
        assert_idle(rx)
    gone = probe_receiver(HOST, rx.alloc_ports[0], identity(), timeout_s=1.0)
    assert not gone.ok and gone.reason == "unreachable"
