"""Receive buffers are reused only when no view of them is left, and kept within their limit."""

from __future__ import annotations

import threading
import warnings

import torch

from connector.tiers.read_buffers import SIZE_STEP, ReadBuffers


def _tensor(view: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(view, dtype=torch.uint8)


def test_a_buffer_is_reused_once_no_view_of_it_is_left():
    pool = ReadBuffers()
    view = pool.take(1000)
    first = view.obj
    del view
    assert pool.take(900).obj is first  # the same size class
    assert pool.bytes == SIZE_STEP


def test_a_buffer_with_a_live_slice_or_tensor_is_never_handed_out_again():
    pool = ReadBuffers()
    view = pool.take(SIZE_STEP)
    first = view.obj
    sliced = view[10:20].toreadonly()
    tensor = _tensor(view[20:30].toreadonly())
    del view
    assert pool.take(SIZE_STEP).obj is not first
    del sliced
    assert pool.take(SIZE_STEP).obj is not first  # the tensor still reads it
    del tensor
    assert pool.take(SIZE_STEP).obj is first


def test_sizes_are_never_mixed():
    pool = ReadBuffers()
    small = pool.take(SIZE_STEP).obj
    assert len(pool.take(SIZE_STEP + 1)) == 2 * SIZE_STEP
    assert pool.take(2 * SIZE_STEP).obj is not small


def test_buffers_past_the_limit_are_not_kept():
    pool = ReadBuffers(max_bytes=2 * SIZE_STEP)
    held = [pool.take(SIZE_STEP) for _ in range(3)]
    assert pool.bytes == 2 * SIZE_STEP
    assert len({id(v.obj) for v in held}) == 3  # the third is memory of its own
    assert len(pool.take(4 * SIZE_STEP)) == 4 * SIZE_STEP  # larger than the limit: never kept
    assert pool.bytes == 2 * SIZE_STEP


def test_buffers_held_elsewhere_for_good_make_room_for_new_ones():
    pool = ReadBuffers(max_bytes=2 * SIZE_STEP)
    kept_by_someone = [pool.take(SIZE_STEP), pool.take(SIZE_STEP)]  # e.g. promoted to the CPU tier
    view = pool.take(SIZE_STEP)
    reused = view.obj
    del view
    assert pool.take(SIZE_STEP).obj is reused  # the pool now reuses the new one
    assert pool.bytes == 2 * SIZE_STEP
    assert all(bytes(v[:1]) == b"\0" for v in kept_by_someone)


def test_threads_taking_at_once_never_share_a_buffer():
    pool = ReadBuffers(max_bytes=8 * SIZE_STEP)
    errors: list[str] = []

    def work(mark: int) -> None:
        for _ in range(300):
            view = pool.take(SIZE_STEP)
            view[:] = bytes([mark]) * SIZE_STEP
            if bytes(view.obj).count(mark) != SIZE_STEP:  # the whole buffer, not only the view
                errors.append(f"thread {mark} saw another thread's bytes")
            del view

    threads = [threading.Thread(target=work, args=(m,)) for m in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_buffers_held_long_after_they_were_lent_are_no_longer_looked_at():
    pool = ReadBuffers()
    kept_by_someone = [pool.take(SIZE_STEP) for _ in range(10)]
    for _ in range(40):  # one buffer cycling: the ten held ones age and are forgotten
        view = pool.take(SIZE_STEP)
        del view
    assert pool.bytes == SIZE_STEP
    assert len({id(v.obj) for v in kept_by_someone}) == 10
