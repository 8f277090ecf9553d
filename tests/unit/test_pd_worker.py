"""A worker rank's PD work with fakes: gathered bytes stay alive until the sender is done, the proxy
hears once per transfer end (success or failure), nothing is sent over a failed load; records load
from the receive buffer into the blocks, a failure fails that chunk and every later one, and every
load is reported finished (vLLM's finished_recving) in the step that ran it, whatever happened."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import torch

from connector.engine.pd_jobs import PDChunkLoad, PDLoadJob, PDSendChunk, PDSendJob
from connector.worker.pd_worker import PDLoads, PDSends


class FakeSender:
    def __init__(self):
        self.transfers = []

    def send(self, transfer):
        self.transfers.append(transfer)

    def close(self, timeout_s):
        pass


class FakeNotifier:
    def __init__(self):
        self.notices = []

    def notify(self, req_id):
        self.notices.append(req_id)
        return True

    def close(self):
        pass


def job(rid="q", refused=None, blocks=((1, 2), (3,))):
    chunks = tuple(PDSendChunk(f"k{i}", b, 128 * len(b)) for i, b in enumerate(blocks))
    return PDSendJob(rid, "proxy-" + rid, "127.0.0.1", (7300,), (7400,), chunks, "space", True, None, refused)


def sends(limit=1 << 20):
    sender, notifier = FakeSender(), FakeNotifier()
    made = []
    s = PDSends(
        0, lambda space: made.append(space) or sender, lambda **kw: SimpleNamespace(**kw), notifier, limit
    )
    return s, sender, notifier, made


def gather(block_ids):
    return torch.full((2, len(block_ids), 8), block_ids[0], dtype=torch.uint8)


def outcome(ok, reason=None, nbytes=0):
    return SimpleNamespace(ok=ok, reason=reason, bytes=nbytes, seconds=0.01, peer="127.0.0.1:7300")


def test_gathered_bytes_stay_alive_until_on_done_then_the_proxy_hears_once():
    s, sender, notifier, made = sends()
    s.run([job()], gather, set())
    (t,) = sender.transfers
    assert made == ["space"] and (t.init_port, t.alloc_port, t.req_id) == (7300, 7400, "proxy-q")
    assert [(k, v.nbytes, n) for k, v, n in t.chunks] == [("k0", 32, 256), ("k1", 16, 128)]
    assert bytes(t.chunks[1][1]) == bytes([3] * 16) and s.holding == 1 and notifier.notices == []
    done = threading.Thread(target=t.on_done, args=(outcome(True, None, 48),))  # the sender's thread
    done.start()
    done.join()
    assert s.wait_reported(5)
    assert s.holding == 0 and s.pending_bytes == 0 and notifier.notices == ["proxy-q"]
    (report,) = s.take_reports()
    assert report.ok and report.bytes == 48 and report.notified is True


def test_a_failed_transfer_notifies_too():
    s, sender, notifier, _ = sends()
    s.run([job()], gather, set())
    sender.transfers[0].on_done(outcome(False, "unreachable"))
    assert s.wait_reported(5)
    assert notifier.notices == ["proxy-q"] and s.take_reports()[0].reason == "unreachable"


def test_nothing_is_sent_over_a_block_whose_load_failed_and_the_proxy_still_hears():
    s, sender, notifier, _ = sends()
    s.run([job()], gather, {3})
    assert s.wait_reported(5)
    assert sender.transfers == [] and notifier.notices == ["proxy-q"]
    assert s.take_reports()[0].reason == "load_failed"


def test_a_refused_spec_only_notifies():
    s, sender, notifier, _ = sends()
    s.run([job(refused="bad_host")], gather, set())
    assert s.wait_reported(5)
    assert sender.transfers == [] and notifier.notices == ["proxy-q"]


def test_senders_behind_by_a_whole_buffer_refuse_rather_than_grow():
    s, sender, notifier, _ = sends(limit=60)  # one job is 48 bytes
    s.run([job("a"), job("b")], gather, set())
    assert s.wait_reported(5)
    assert len(sender.transfers) == 1 and notifier.notices == ["proxy-b"]
    assert s.take_reports()[0].reason == "send_backlog"


class FakeCopier:
    """payload_view/scatter as kv_blocks.BlockCopier: [layers, blocks, block_bytes]."""

    def __init__(self):
        self.blocks = {}

    def payload_view(self, view):
        return torch.frombuffer(bytearray(view), dtype=torch.uint8).view(2, -1, 4)

    def scatter(self, payload, block_ids, first_block):
        if first_block + len(block_ids) > payload.shape[1]:
            raise ValueError("payload too short")
        for i, b in enumerate(block_ids):
            self.blocks[b] = payload[:, first_block + i].clone()


class FakeBuffer:
    def __init__(self, data):
        self.data = memoryview(data)
        self.closed = False

    def view(self, offset, length):
        if offset + length > len(self.data):
            raise ValueError("outside the buffer")
        return self.data[offset : offset + length]

    def close(self):
        self.closed = True


def test_records_load_into_blocks_and_a_bad_one_fails_it_and_every_later_chunk():
    data = np.arange(64, dtype=np.uint8).tobytes()
    buffer = FakeBuffer(data)
    attached = []
    loads = PDLoads(0, lambda name: attached.append(name) or buffer)
    good = PDChunkLoad("k0", (10, 11), 0, 256, (("buf", 0, 16),))
    bad = PDChunkLoad("k1", (12,), 0, 128, (("buf", 60, 16),))  # runs past the buffer
    later = PDChunkLoad("k2", (13,), 0, 128, (("buf", 0, 8),))
    copier = FakeCopier()
    failed = loads.run([PDLoadJob("d", (good, bad, later))], copier)
    assert failed == {12, 13} and set(copier.blocks) == {10, 11} and attached == ["buf"]
    assert loads.take_finished() == {"d"} and loads.take_finished() == set()  # reported in this step
    result = loads.take_results()["d"]
    assert not result.ok and result.reason == "load_failed" and result.failed_block_ids == {12, 13}
    loads.close()
    assert buffer.closed


def test_a_record_that_is_not_whole_blocks_fails_with_its_request_reported_finished():
    buffer = FakeBuffer(bytes(64))
    loads = PDLoads(0, lambda name: buffer)
    short = PDChunkLoad("k0", (10, 11), 0, 256, (("buf", 0, 12),))  # 12 bytes: 1.5 blocks of 8
    job = PDLoadJob("d", (short, PDChunkLoad("k1", (12,), 0, 77, (("buf", 16, 8),))))
    assert loads.run([job], FakeCopier()) == {10, 11, 12}
    assert loads.take_finished() == {"d"}
    assert loads.take_results()["d"].failed_block_ids == {10, 11, 12}


def test_blocks_of_records_lost_before_the_load_fail_after_what_loaded():
    buffer = FakeBuffer(np.arange(64, dtype=np.uint8).tobytes())
    loads = PDLoads(0, lambda name: buffer)
    good = PDChunkLoad("k0", (10, 11), 0, 256, (("buf", 0, 16),))
    gone = PDLoadJob("d", (good,), fail_blocks=(12, 13), fail_reason="claim_lost")
    lost = PDLoadJob("e", (), fail_blocks=(20,), fail_reason="claim_lost")
    copier = FakeCopier()
    assert loads.run([gone, lost], copier) == {12, 13, 20} and set(copier.blocks) == {10, 11}
    assert loads.take_finished() == {"d", "e"}
    results = loads.take_results()
    assert (results["d"].reason, results["d"].failed_block_ids) == ("claim_lost", {12, 13})
    assert (results["e"].reason, results["e"].failed_block_ids) == ("claim_lost", {20})


def test_a_load_that_raises_unexpectedly_still_ends_reported_with_every_block_failed():
    class BrokenCopier(FakeCopier):
        def scatter(self, payload, block_ids, first_block):
            raise TypeError("a defect")

    loads = PDLoads(0, lambda name: FakeBuffer(bytes(64)))
    job = PDLoadJob("d", (PDChunkLoad("k0", (10, 11), 0, 256, (("buf", 0, 16),)),), (12,), "claim_lost")
    assert loads.run([job], BrokenCopier()) == {10, 11, 12}
    assert loads.take_finished() == {"d"}
    assert loads.take_results()["d"].reason == "internal"
    assert loads.run([PDLoadJob("e", job.chunks)], None) == {10, 11}  # no KV cache registered
    assert loads.take_finished() == {"e"}


def test_a_notice_that_waits_never_holds_the_batch():
    release = threading.Event()

    class SlowNotifier(FakeNotifier):
        def notify(self, req_id):
            release.wait(5)  # an absent proxy: the notice waits for its timeout
            return super().notify(req_id)

    s = PDSends(0, lambda space: FakeSender(), lambda **kw: SimpleNamespace(**kw), SlowNotifier(), 1 << 20)
    started = time.monotonic()
    s.run([job(refused="bad_host"), job("b", refused="bad_host")], gather, set())
    assert time.monotonic() - started < 1.0 and s.take_reports() == []
    release.set()
    assert s.wait_reported(5) and len(s.take_reports()) == 2
