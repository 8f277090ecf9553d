"""One 1P1D pair of real ``vllm serve`` engines (tiny model, default settings besides PD) on
loopback, shared by every PD test module, a plain instance (no connector) for reference outputs,
and a minimal in-test proxy speaking LMCache's example proxy's protocol (tokens in, max_tokens 1
with the disagg_spec to the prefiller, wait for its ZMQ ProxyNotif, decode on the decoder).

Every engine start costs 30-90 s here, so the session starts the three at once and shares them.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from tests.telemetry.otlp_receiver import OtlpReceiver
from tests.telemetry.serve import VllmServer, base_env, free_port, sum_samples, wait_until

REPO = Path(__file__).resolve().parents[2]
CHUNK = 256  # KVLens's default chunk_size
TOKEN_BYTES = 4 * 2 * 2 * 64 * 2  # the tiny model: layers x (K, V) x kv heads x head size x bf16
DECODER_BUFFER = 4 * CHUNK * TOKEN_BYTES  # the decoder holds one prompt of up to 4 chunks at a time
UNCLAIMED_S = 15.0  # the decoder's pd_unclaimed_timeout_sec (default 60: too long for a test)
NOTIFY_WAIT_S = 60.0  # the in-test proxy's bound (LMCache's waits forever)


def pd_kv_config(role: str, **pd: Any) -> dict[str, Any]:
    kv_role = "kv_producer" if role == "sender" else "kv_consumer"
    # as LMCache's 1p1d example configurations: no CPU tier, the PD buffer is all there is
    extra = {"local_cpu": False, "enable_pd": True, "transfer_channel": "tcp", "pd_role": role, **pd}
    extra.setdefault("pd_buffer_device", "cpu")
    return {
        "kv_connector": "KVLensConnector",
        "kv_connector_module_path": "connector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {f"lmcache.{k}": v for k, v in extra.items()},
    }


class _Notice(msgspec.Struct, tag="ProxyNotif"):
    req_id: str


@dataclass
class PDPair:
    prefiller: VllmServer
    decoder: VllmServer
    plain: VllmServer | None  # an instance without KVLens, for reference outputs
    init_ports: list[int]
    alloc_ports: list[int]
    notices: Any  # zmq PULL socket
    spans: Any  # the OTLP receiver both engines export to (None: not traced)
    proxy_port: int = 0  # the prefiller's pd_proxy_port, where ``notices`` is bound
    seen: set[str] = field(default_factory=set)

    @contextlib.contextmanager
    def proxy_port_lent(self) -> Iterator[int]:
        """Frees the prefiller's pd_proxy_port for another proxy (a subprocess) inside the block;
        the in-test proxy binds it again after."""
        context = self.notices.context
        self.notices.close(linger=0)
        try:
            yield self.proxy_port
        finally:
            self.notices = context.socket(zmq.PULL)
            self.notices.bind(f"tcp://127.0.0.1:{self.proxy_port}")

    def wait_notice(self, req_id: str, timeout: float = NOTIFY_WAIT_S) -> float:
        """Seconds until the prefiller's ProxyNotif for ``req_id`` came (TimeoutError past)."""
        started = time.monotonic()
        while req_id not in self.seen:
            left = timeout - (time.monotonic() - started)
            if left <= 0:
                raise TimeoutError(f"no ProxyNotif for {req_id} within {timeout}s")
            if self.notices.poll(int(left * 1000)):
                msg = msgspec.msgpack.decode(self.notices.recv(), type=_Notice)
                self.seen.add(msg.req_id)
        return time.monotonic() - started

    def spec(self, req_id: str, host: str = "127.0.0.1", init=None, alloc=None) -> dict[str, Any]:
        return {
            "req_id": req_id,
            "receiver_host": host,
            "receiver_init_port": list(init or self.init_ports),
            "receiver_alloc_port": list(alloc or self.alloc_ports),
        }

    def run(
        self,
        prompt: list[int],
        max_tokens: int,
        traceparent: str | None = None,
        ignore_eos: bool = True,
        **spec: Any,
    ) -> dict[str, Any]:
        """One request through the in-test proxy (``traceparent`` passed to both sides): what each
        side answered, and the tokens."""
        req_id = f"pd-{uuid.uuid4().hex[:12]}"
        prefill = self.prefiller.complete(
            prompt,
            max_tokens=1,
            traceparent=traceparent,
            kv_transfer_params={"ret_first_tok": True, "disagg_spec": self.spec(req_id, **spec)},
            return_token_ids=True,
            ignore_eos=ignore_eos,
        )
        first = prefill["kv_transfer_params"]["first_tok"]
        waited = self.wait_notice(req_id)
        decode = self.decoder.complete(
            prompt + [first],
            max_tokens=max_tokens - 1,
            traceparent=traceparent,
            return_token_ids=True,
            ignore_eos=ignore_eos,
        )
        tokens = [first, *decode["choices"][0]["token_ids"]]
        return {"req_id": req_id, "prefill": prefill, "decode": decode, "tokens": tokens, "waited_s": waited}

    def idle(self) -> dict[str, float]:
        """The leak gauges of both engines once nothing is held (waits, bounded, for them)."""
        names = {
            "entries": (self.decoder, "vllm:kvlens_pd_buffer_entries", {}),
            "used": (self.decoder, "vllm:kvlens_pd_buffer_used_bytes", {}),
            "receiving": (self.decoder, "vllm:kvlens_pd_transfers_in_flight", {"side": "receive"}),
            "sending": (self.prefiller, "vllm:kvlens_pd_transfers_in_flight", {"side": "send"}),
        }

        def read() -> dict[str, float]:
            return {
                k: sum_samples(server.samples(), name, **labels)
                for k, (server, name, labels) in names.items()
            }

        try:
            return wait_until(
                lambda: (lambda g: g if not any(g.values()) else None)(read()), timeout=30, what="idle"
            )
        except TimeoutError:
            return read()

    def plain_tokens(self, prompt: list[int], max_tokens: int) -> list[int]:
        return self.plain.complete(prompt, max_tokens=max_tokens, return_token_ids=True)["choices"][0][
            "token_ids"
        ]


@contextlib.contextmanager
def started_pair(
    model: str,
    tmp: Path,
    decoder_buffer: int = DECODER_BUFFER,
    plain: bool = True,
    traced: bool = True,
    worker_process: bool = True,
) -> Iterator[PDPair]:
    """A prefiller, a decoder and (``plain``) an instance without KVLens, started at once and
    stopped on leaving; (``traced``) both PD engines export spans to an OTLP receiver. The PD
    engines and the plain one run vLLM's own process split unless ``worker_process`` is False
    (``VllmServer``): alike, since the split changes the worker's threads, and with them the
    random tiny model's bf16 outputs."""
    context = zmq.Context()
    notices = context.socket(zmq.PULL)
    proxy_port = notices.bind_to_random_port("tcp://127.0.0.1")
    init_ports, alloc_ports = [free_port()], [free_port()]
    spans = OtlpReceiver().__enter__() if traced else None
    env = base_env(
        PYTHONHASHSEED="0", OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_BSP_SCHEDULE_DELAY="200"
    )
    export = ("--otlp-traces-endpoint", spans.endpoint) if spans is not None else ()
    prefiller = VllmServer(
        model,
        pd_kv_config("sender", pd_proxy_host="127.0.0.1", pd_proxy_port=proxy_port, pd_buffer_size=64 << 20),
        tmp / "prefiller.log",
        env,
        export,
        worker_process=worker_process,
    )
    decoder = VllmServer(
        model,
        pd_kv_config(
            "receiver",
            pd_peer_host="127.0.0.1",
            pd_peer_init_port=init_ports,
            pd_peer_alloc_port=alloc_ports,
            pd_buffer_size=decoder_buffer,
            pd_unclaimed_timeout_sec=UNCLAIMED_S,
        ),
        tmp / "decoder.log",
        env,
        export,
        worker_process=worker_process,
    )
    reference = (
        VllmServer(model, None, tmp / "plain.log", env, worker_process=worker_process) if plain else None
    )
    servers = tuple(s for s in (prefiller, decoder, reference) if s is not None)
    try:
        for server in servers:
            server.wait_ready()
        pair = PDPair(prefiller, decoder, reference, init_ports, alloc_ports, notices, spans, proxy_port)
        yield pair
        notices = pair.notices  # bound again if it was lent
    finally:
        for server in servers:
            server.stop()
        notices.close(linger=0)
        context.term()
        if spans is not None:
            spans.__exit__(None, None, None)


@pytest.fixture(scope="package")  # stops after tests/pd's last test, not at the end of the run
def pd_pair(tiny_model, tmp_path_factory):
    with started_pair(tiny_model, tmp_path_factory.mktemp("pd")) as pair:
        yield pair
