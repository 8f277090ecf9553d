"""Clears through a running engine: applied by the scheduler between steps, safe for loads in
flight, scoped to namespaces; namespace records written beside the chunks."""

import os
import threading
import time

import pytest

from connector.config.loading import load_config
from connector.engine.block_events import BlocksCleared, BlocksRemoved
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU, DISK, Eviction
from connector.engine.keys import key_fingerprint, storage_name
from connector.engine.namespace_records import Selector
from connector.scheduler.admin import ClearTicket
from connector.scheduler.connector_scheduler import ConnectorScheduler
from connector.tiers.disk import DiskTier
from connector.tiers.store_records import DiskRecords

from .fakes import BLOCK, BLOCK_BYTES, IDENTITY, LAYERS, admit_fully, blocks, request, step

PROMPT = list(range(1000, 1600))  # two whole chunks and a tail


def _scheduler(tmp_path, **extra) -> ConnectorScheduler:
    settings = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 1, **extra}
    config = load_config({f"lmcache.{k}": v for k, v in settings.items()}, env={})
    facts = EngineFacts(
        IDENTITY.key(),
        "bfloat16",
        BLOCK,
        LAYERS,
        BLOCK_BYTES,
        "L",
        1,
        "kv_both",
        kv_events=True,
        identity=IDENTITY,
    )
    return ConnectorScheduler(config, facts)


class Worker:
    """What the workers do with a plan's disk writes and evictions (files only)."""

    def __init__(self, s: ConnectorScheduler) -> None:
        self.disk = DiskTier(s.config.local_disk, "L", grace_s=0)
        self.cpu_evicted: list[str] = []

    def run(self, plan) -> None:
        for w in plan.writes:
            if isinstance(w, Eviction):
                if w.tier == CPU:
                    self.cpu_evicted.append(w.name)
                else:
                    self.disk.delete(storage_name(w.name, 0))
            elif DISK in w.tiers:
                self.disk.put(storage_name(w.name, 0), memoryview(os.urandom(64)), w.namespace)


def _hashed(rid, tokens, **kw):
    return request(
        rid, tokens, block_hashes=[f"{rid}-{i}".encode() for i in range(len(tokens) // BLOCK)], **kw
    )


def _store(s, worker, rid, **kw):
    req = _hashed(rid, PROMPT, **kw)
    _, plan = admit_fully(s, req, blocks(10, 5))
    worker.run(plan)
    s.finish(req)
    return plan


def _clear_while_stepping(s, worker, selector, steps_before_done=None):
    """The endpoint's thread runs the clear; this thread is the engine, stepping."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(s.admin.clear(selector)))
    thread.start()
    deadline = time.monotonic() + 20
    while thread.is_alive() and time.monotonic() < deadline:
        if steps_before_done is not None:
            steps_before_done()
        worker.run(s.build_plan(step()))
        time.sleep(0.005)
    thread.join(1)
    assert not thread.is_alive(), "the clear did not finish"
    worker.run(s.build_plan(step()))  # evictions released at the last step go out with this one
    return out


def test_a_salt_clear_takes_only_that_tenants_chunks_from_every_tier(tmp_path):
    s = _scheduler(tmp_path)
    worker = Worker(s)
    plain = _store(s, worker, "a")
    salted = _store(s, worker, "b", cache_salt="tenant-b")
    mine = {j.name for j in salted.stores}
    theirs = {j.name for j in plain.stores}
    s.block_events.take()

    out = _clear_while_stepping(s, worker, Selector(salt="tenant-b"))

    assert out["engine"]["applied"] and out["namespaces"] == [salted.stores[0].namespace]
    assert out["engine"]["index_dropped"] == {CPU: len(mine), DISK: len(mine)}
    assert set(s.tiers[CPU].keys()) == set(s.tiers[DISK].keys()) == theirs
    assert set(worker.cpu_evicted) == mine  # the workers drop their copies through the plan
    on_disk = {r.digest for r in DiskRecords(s.config.local_disk).chunks()}
    assert on_disk == theirs and out[DISK]["chunks"] == len(mine)
    removed = [e for e in s.block_events.take() if isinstance(e, BlocksRemoved)]
    assert {e.medium for e in removed} == {CPU, DISK} and len(removed) == 2 * len(mine)
    assert "tenant-b" not in str(out)


def test_clearing_everything_tells_routers_all_blocks_are_cleared(tmp_path):
    s = _scheduler(tmp_path)
    worker = Worker(s)
    _store(s, worker, "a")
    s.block_events.take()
    out = _clear_while_stepping(s, worker, Selector())
    assert len(s.tiers[CPU]) == len(s.tiers[DISK]) == 0
    assert list(DiskRecords(s.config.local_disk).chunks()) == [] and out[DISK]["chunks"] == 2
    events = s.block_events.take()
    assert isinstance(events[0], BlocksCleared)


def test_chunks_pinned_for_a_pending_load_are_deleted_only_after_the_load_is_reported(tmp_path):
    s = _scheduler(tmp_path)
    worker = Worker(s)
    plan = _store(s, worker, "a")
    names = {j.name for j in plan.stores}
    waiting = _hashed("w", PROMPT)
    assert s.lookup(waiting, 0) == 512  # pinned, not yet scheduled
    seen_while_pinned = []

    def engine_check():
        if s.admin._waiting:  # applied, not released: no lookup finds them, nothing deleted yet
            seen_while_pinned.append(
                (len(s.tiers[CPU]), {r.digest for r in DiskRecords(s.config.local_disk).chunks()})
            )
            if len(seen_while_pinned) == 5:
                s.prefix.lookup(waiting, 0)  # a new lookup of the same prompt: it finds nothing
                s.lookups.pop("w", None)
                s.pins.release("w")  # the load reported (here: dropped)

    out = _clear_while_stepping(s, worker, Selector(), engine_check)
    assert out["engine"]["waited_for"] == 1
    assert seen_while_pinned[0] == (0, names)  # out of the index at once, files still there
    assert list(DiskRecords(s.config.local_disk).chunks()) == []


def test_a_stalled_load_holds_a_deletion_at_most_the_limit(tmp_path, monkeypatch):
    from connector.scheduler import admin

    monkeypatch.setattr(admin, "DEFER_LIMIT_S", 0.3)
    s = _scheduler(tmp_path)
    worker = Worker(s)
    _store(s, worker, "a")
    s.lookup(_hashed("w", PROMPT), 0)  # pins forever
    started = time.monotonic()
    _clear_while_stepping(s, worker, Selector())
    assert 0.3 <= time.monotonic() - started < 5
    assert list(DiskRecords(s.config.local_disk).chunks()) == []


def test_the_engine_keeps_stepping_while_a_clear_is_queued_or_waiting(tmp_path):
    s = _scheduler(tmp_path)
    assert not s.has_pending_work()
    admin_ticket = ClearTicket(Selector(), frozenset())
    s.admin.submit(admin_ticket)
    assert s.has_pending_work()
    s.build_plan(step())  # applied, nothing pinned: released at the second quiet step
    assert admin_ticket.applied.is_set() and s.has_pending_work()
    s.build_plan(step())
    s.build_plan(step())
    assert admin_ticket.released.is_set() and not s.has_pending_work()


def test_stores_after_the_clear_was_applied_stay(tmp_path):
    s = _scheduler(tmp_path)
    worker = Worker(s)
    _store(s, worker, "a")
    stored_after = []

    def engine_check():
        if s.admin._waiting and not stored_after:
            time.sleep(1.1)  # a later second than the clear's
            req = _hashed("late", list(range(7000, 7600)))
            _, plan = admit_fully(s, req, blocks(30, 5))
            worker.run(plan)
            stored_after.extend(j.name for j in plan.stores)

    _clear_while_stepping(s, worker, Selector(), engine_check)
    left = {r.digest for r in DiskRecords(s.config.local_disk).chunks()}
    assert left == set(stored_after) and set(s.tiers[DISK].keys()) == left


def test_each_storing_namespace_gets_one_record_beside_the_chunks(tmp_path):
    s = _scheduler(tmp_path)
    worker = Worker(s)
    a = _store(s, worker, "a").stores[0].namespace
    b = _store(s, worker, "b", cache_salt="tenant-b", kv_transfer_params={"lmcache.tag.team": "blue"})
    b = b.stores[0].namespace
    store = DiskRecords(s.config.local_disk)
    deadline = time.monotonic() + 10
    while len(store.namespaces()[0]) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    records = {r.fingerprint: r for r in store.namespaces()[0]}
    assert set(records) == {a, b} and a == key_fingerprint(s.state.base_namespace)
    salted = records[b]
    assert salted.salted and salted.tag_names == ("team",) and salted.identity == IDENTITY
    folder = tmp_path / "disk" / ".kvlens-namespaces"  # records, and first-chunk marks in marks/
    raw = b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())
    assert b"tenant-b" not in raw and b"blue" not in raw


def test_the_endpoint_serves_clears_and_namespaces_on_loopback(tmp_path, monkeypatch, capsys):
    """No token configured: the engine writes one for its port that `kvlens` on this host reads;
    a request without it is refused."""
    import json
    import socket
    import urllib.request

    from connector.ops.cli import main

    monkeypatch.setenv("KVLENS_ADMIN_TOKEN_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("KVLENS_ADMIN_TOKEN", raising=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = _scheduler(tmp_path, **{"extra_config.admin_port": port})
    try:
        worker = Worker(s)
        fp = _store(s, worker, "a").stores[0].namespace
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/kvlens/namespaces", timeout=5)
        assert e.value.code == 401
        assert main(["inspect", url, "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)["namespaces"]
        assert row["this_engine"] and row["fingerprint"] == fp
        token = (tmp_path / "run" / f"admin-{port}.token").read_text().strip()
        bad = urllib.request.Request(url + "/kvlens/clear", data=b"{}", method="POST")
        bad.add_header("Authorization", f"Bearer {token}")
        bad.add_header("Content-Type", "application/json")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bad, timeout=5)
        assert e.value.code == 400 and "say what" in json.loads(e.value.read())["error"]
        monkeypatch.setenv("KVLENS_ADMIN_TOKEN", "not-the-token")
        assert main(["inspect", url]) == 1
        assert "HTTP 401" in capsys.readouterr().err
    finally:
        s.shutdown()
    assert not (tmp_path / "run" / f"admin-{port}.token").exists()  # removed at shutdown


def test_an_eviction_decided_after_the_last_plan_keeps_the_engine_stepping_until_it_goes_out(tmp_path):
    """A report that drops a chunk (a rank's write failed) arrives with the last step of a burst:
    the workers learn of it only from the next plan. A served engine would otherwise go idle
    with a worker holding a chunk the index no longer counts (the leak gauges disagree)."""
    from connector.engine.outcomes import FailureReason, StoreFailure, WorkerReport

    s = _scheduler(tmp_path)
    worker = Worker(s)
    plan = _store(s, worker, "a")
    s.on_worker_report(WorkerReport(pending_writes=0))
    assert not s.has_pending_work()
    name = next(w.name for w in plan.writes if CPU in w.tiers)
    s.on_worker_report(WorkerReport(store_failures=[StoreFailure("", name, CPU, FailureReason.IO_ERROR, "")]))
    assert s.has_pending_work()
    worker.run(s.build_plan(step()))
    assert worker.cpu_evicted == [name] and not s.has_pending_work()
