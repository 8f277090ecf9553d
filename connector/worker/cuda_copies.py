"""Block copies on a CUDA stream of KVLens's own, ordered against the forward pass by events.

A task (one layer's loads or gathers) is queued on the copy stream behind everything the
forward pass's stream has queued so far: a gather then reads KV the forward pass wrote, and a
load cannot overwrite a block that a kernel still queued there reads (vLLM reuses freed
blocks, and with asynchronous scheduling the previous step may still be running). An event
recorded after the task marks its end: the forward pass's stream waits on it before a layer's
attention (``order_forward``) and, at the step's end, before the next step; the host polls
it, with a deadline, before it reads gathered bytes (``wait_host``). Nothing here blocks the
host on the step path.

The stream calls go through ``StreamApi`` (``TorchCuda`` in production), so the ordering is
tested on CPU against a simulated device (tests/unit/fake_cuda.py); that the copies
themselves are asynchronous and bit-exact on a real GPU is what scripts/gpu_check.py shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

POLL_S = 0.0002  # how often a host wait looks at an event


class Event(Protocol):
    def record(self, stream: Any) -> None: ...

    def query(self) -> bool: ...


class StreamApi(Protocol):
    """The few stream operations the copy runner uses."""

    def new_stream(self) -> Any: ...

    def forward_stream(self) -> Any:
        """The stream the forward pass queues on (the caller's current stream)."""
        ...

    def enqueue(self, stream: Any, task: Callable[[], None]) -> None:
        """Run ``task`` with ``stream`` current: the device work it queues goes there."""
        ...

    def new_event(self) -> Event: ...


class TorchCuda:
    """``StreamApi`` over ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def forward_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def enqueue(self, stream: torch.cuda.Stream, task: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            task()

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()


class EventDone:
    """The end of one task's device copies."""

    def __init__(self, event: Event) -> None:
        self.event = event

    def ready(self) -> bool:
        return self.event.query()


class CudaCopyStream:
    """A ``CopyRunner`` whose tasks queue their copies on one stream of its own."""

    copies_on_host = False

    def __init__(self, api: StreamApi) -> None:
        self._api = api
        self.stream = api.new_stream()
        self._last: EventDone | None = None

    def submit(self, task: Callable[[], None]) -> EventDone:
        self.stream.wait_stream(self._api.forward_stream())
        self._api.enqueue(self.stream, task)
        event = self._api.new_event()
        event.record(self.stream)
        self._last = EventDone(event)
        return self._last

    def order_forward(self, done: Any, timeout_s: float) -> str | None:
        self._api.forward_stream().wait_event(done.event)
        return None

    def wait_host(self, done: Any, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while not done.ready():
            if time.monotonic() > deadline:
                return f"the device did not finish KVLens's copies in {timeout_s:g} s"
            time.sleep(POLL_S)
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) for every queued copy: the buffers they use may be freed next."""
        if self._last is not None:
            self.wait_host(self._last, timeout_s)
