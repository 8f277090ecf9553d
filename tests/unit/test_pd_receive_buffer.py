"""The receive buffer: a free from the scheduler never waits for the buffer's lock (issue 36,
item 4)."""

from __future__ import annotations

import threading

from connector.pd.receive_buffer import ReceiveBuffer


def test_free_soon_never_waits_and_the_lock_holder_frees_the_slots_after():
    buffer = ReceiveBuffer(4096, 0)
    try:
        slots = buffer.allocate_all([1024, 1024])
        assert slots is not None
        entered, leave = threading.Event(), threading.Event()
        real = buffer._allocator.allocate_all

        def slow(lengths):  # type: ignore[no-untyped-def]
            entered.set()
            leave.wait(30)
            return real(lengths)

        buffer._allocator.allocate_all = slow  # type: ignore[method-assign]
        receiver = threading.Thread(target=buffer.allocate_all, args=([64],))
        receiver.start()
        assert entered.wait(5)
        done = threading.Event()
        threading.Thread(target=lambda: (buffer.free_soon(slots), done.set()), daemon=True).start()
        assert done.wait(2.0), "free_soon waited for the buffer's lock"
        assert buffer.used_bytes == 2048
        leave.set()
        receiver.join()
        assert buffer.used_bytes == 64
    finally:
        buffer.close()
