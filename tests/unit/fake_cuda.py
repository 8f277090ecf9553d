"""A simulated device for ``connector.worker.cuda_copies.StreamApi``: streams of queued work, events,
and cross-stream waits, run only when a test lets the device run.

It shows what a device run would do with the order KVLens gives its work: which copy each
kernel waits for, and what the host reads before the device got there. Work is queued
callables (the copies themselves are CPU torch or numpy copies). Where one stream's work may
run before another's, ``prefer`` picks which runs first, so a missing wait shows as a wrong
byte. What it does not model: on a GPU a task's host part (and any error it raises) runs when
it is submitted, its copies later; here both run when the device reaches the task.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class Deadlock(AssertionError):
    pass


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.stream: FakeStream | None = None
        self.position = 0

    def record(self, stream: FakeStream) -> None:
        self.stream, self.position = stream, stream.queued

    def complete(self) -> bool:
        return self.stream is None or self.stream.done >= self.position

    def query(self) -> bool:
        self.gpu.queries += 1
        if self.gpu.runs_while_polled:  # time passes while the host polls
            self.gpu.step()
        return self.complete()


class FakeStream:
    def __init__(self, gpu: FakeGpu, name: str) -> None:
        self.gpu = gpu
        self.name = name
        self.ops: deque[tuple[str, object]] = deque()
        self.queued = 0  # ops ever queued
        self.done = 0  # ops finished

    def _push(self, kind: str, item: object) -> None:
        self.ops.append((kind, item))
        self.queued += 1

    def wait_stream(self, other: FakeStream) -> None:
        event = FakeEvent(self.gpu)
        event.record(other)
        self.wait_event(event)

    def wait_event(self, event: FakeEvent) -> None:
        self._push("wait", event)

    def runnable(self) -> bool:
        if not self.ops:
            return False
        kind, item = self.ops[0]
        return kind == "run" or item.complete()  # type: ignore[attr-defined]

    def run_one(self) -> None:
        kind, item = self.ops.popleft()
        if kind == "run":
            item()  # type: ignore[operator]
        self.done += 1


class FakeGpu:
    """``StreamApi``; ``forward`` is the forward pass's stream, where a test queues kernels."""

    def __init__(self, prefer: str = "forward") -> None:
        self.forward = FakeStream(self, "forward")
        self.streams = [self.forward]
        self.prefer = prefer  # "forward": its kernels run as early as allowed; "copies": the copies do
        self.runs_while_polled = False
        self.queries = 0

    # StreamApi
    def new_stream(self) -> FakeStream:
        stream = FakeStream(self, f"copies{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def forward_stream(self) -> FakeStream:
        return self.forward

    def enqueue(self, stream: FakeStream, task: Callable[[], None]) -> None:
        stream._push("run", task)

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    # the test's side
    def launch(self, kernel: Callable[[], None]) -> None:
        """Queue a forward-pass kernel (attention reading a layer, a write of new KV)."""
        self.forward._push("run", kernel)

    def step(self) -> bool:
        order = self.streams if self.prefer == "forward" else self.streams[::-1]
        for stream in order:
            if stream.runnable():
                stream.run_one()
                return True
        return False

    def run(self) -> None:
        while self.step():
            pass
        stuck = [s.name for s in self.streams if s.ops]
        if stuck:
            raise Deadlock(f"streams wait on each other: {stuck}")

    @property
    def idle(self) -> bool:
        return not any(s.ops for s in self.streams)
