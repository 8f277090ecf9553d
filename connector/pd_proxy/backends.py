"""Where ``kvlens pd-proxy`` sends requests: its settings, the prefillers and decoders paired from
LMCache's example proxy's flags (the same flags mean the same thing, so it is a drop-in), and the
round-robin pick of one prefiller and one decoder per request."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, field


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def csv_strs(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def pair_hosts_and_ports(hosts: list[str], ports: list[int], count: int) -> list[tuple[str, int]]:
    """LMCache's pairing: one host and one port with ``count`` > 1 means ports counting up from it;
    one host or one port is shared by every entry of the other list; else the lists pair up."""
    if len(hosts) == 1 and len(ports) == 1:
        return [(hosts[0], ports[0] + i) for i in range(max(1, count))]
    if len(hosts) == 1:
        return [(hosts[0], p) for p in ports]
    if len(ports) == 1:
        return [(h, ports[0]) for h in hosts]
    if len(hosts) != len(ports):
        raise ValueError(f"{len(hosts)} hosts but {len(ports)} ports: give one of each, or equal lists")
    return list(zip(hosts, ports, strict=True))


@dataclass(frozen=True, slots=True)
class Backend:
    """One vLLM server; a decoder also has its PD receiver's ports, one per TP rank."""

    host: str
    port: int
    init_ports: tuple[int, ...] = ()
    alloc_ports: tuple[int, ...] = ()

    @property
    def name(self) -> str:  # the metrics label and the records' field
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ranks(self) -> int:
        return len(self.init_ports)


@dataclass(frozen=True, slots=True)
class ProxySettings:
    host: str = "localhost"
    port: int = 8000
    prefiller_host: list[str] = field(default_factory=lambda: ["localhost"])
    prefiller_port: list[int] = field(default_factory=lambda: [8100])
    num_prefillers: int = 1
    decoder_host: list[str] = field(default_factory=lambda: ["localhost"])
    decoder_port: list[int] = field(default_factory=lambda: [8200])
    decoder_init_port: list[int] = field(default_factory=lambda: [8300])
    decoder_alloc_port: list[int] = field(default_factory=lambda: [8400])
    num_decoders: int = 1
    proxy_host: str = "localhost"  # where the prefillers' ProxyNotif PUSHes arrive (ZMQ PULL)
    proxy_port: int = 8500
    notify_timeout_s: float = 5.0  # past it the decoder is asked anyway and recomputes
    no_pd: bool = False  # plain round-robin over --decoder-* (no prefiller, no transfer)
    backend_timeout_s: float = 600.0  # a backend silent this long (connect, or between bytes) fails
    max_request_bytes: int = 16 << 20
    records: int = 1000  # kept for GET /kvlens/pd/requests
    request_log: str | None = None

    def prefillers(self) -> list[Backend]:
        pairs = pair_hosts_and_ports(self.prefiller_host, self.prefiller_port, self.num_prefillers)
        return [Backend(h, p) for h, p in pairs]

    def decoders(self) -> list[Backend]:
        pairs = pair_hosts_and_ports(self.decoder_host, self.decoder_port, self.num_decoders)
        # as LMCache's proxy: receiver ports count up per decoder only in the one-host-one-port form
        counting = len(self.decoder_host) == 1 and len(self.decoder_port) == 1 and self.num_decoders > 1
        out = []
        for i, (h, p) in enumerate(pairs):
            step = i if counting else 0
            init = tuple(x + step for x in self.decoder_init_port)
            alloc = tuple(x + step for x in self.decoder_alloc_port)
            out.append(Backend(h, p, init, alloc))
        return out

    def problems(self) -> list[str]:
        found = []
        try:
            self.prefillers()
            self.decoders()
        except ValueError as e:
            found.append(f"--prefiller-*/--decoder-*: {e}")
        if len(self.decoder_init_port) != len(self.decoder_alloc_port):
            found.append(
                "--decoder-init-port and --decoder-alloc-port need one port each per decoder TP rank"
            )
        if not self.decoder_init_port:
            found.append("--decoder-init-port: at least one port (one per decoder TP rank)")
        if self.notify_timeout_s < 0:
            found.append("--notify-timeout: seconds, 0 or more")
        if self.max_request_bytes <= 0 or self.records < 0 or self.backend_timeout_s <= 0:
            found.append("--max-request-bytes and --backend-timeout must be positive, --records 0 or more")
        return found


def add_arguments(p: argparse.ArgumentParser) -> None:
    """LMCache's example proxy's flags (same names, defaults and forms), then KVLens's own."""
    d = ProxySettings()
    p.add_argument("--port", type=int, default=d.port, help="this proxy's HTTP port")
    p.add_argument("--host", default=d.host, help="this proxy's HTTP address")
    p.add_argument("--prefiller-host", type=csv_strs, default=d.prefiller_host, help="host[,host...]")
    p.add_argument("--prefiller-port", type=csv_ints, default=d.prefiller_port, help="port[,port...]")
    p.add_argument(
        "--num-prefillers",
        type=int,
        default=d.num_prefillers,
        help="with one prefiller host and port: this many on consecutive ports",
    )
    p.add_argument("--decoder-host", type=csv_strs, default=d.decoder_host, help="host[,host...]")
    p.add_argument("--decoder-port", type=csv_ints, default=d.decoder_port, help="port[,port...]")
    p.add_argument(
        "--decoder-init-port", type=csv_ints, default=d.decoder_init_port, help="one per decoder TP rank"
    )
    p.add_argument(
        "--decoder-alloc-port", type=csv_ints, default=d.decoder_alloc_port, help="one per decoder TP rank"
    )
    p.add_argument(
        "--num-decoders",
        type=int,
        default=d.num_decoders,
        help="with one decoder host and port: this many on consecutive ports (receiver ports count up alike)",
    )
    p.add_argument("--proxy-host", default=d.proxy_host, help="address the prefillers notify (ZMQ PULL)")
    p.add_argument("--proxy-port", type=int, default=d.proxy_port, help="port the prefillers notify")
    p.add_argument(
        "--notify-timeout",
        type=float,
        default=d.notify_timeout_s,
        help="seconds to wait for the prefiller's notifications after its answer; past it the decoder "
        "is asked anyway and recomputes what did not arrive (counted)",
    )
    p.add_argument(
        "--no-pd",
        action="store_true",
        help="no disaggregation: requests go round-robin to the --decoder-* servers as they are",
    )
    p.add_argument(
        "--backend-timeout",
        type=float,
        default=d.backend_timeout_s,
        help="seconds a backend may stay silent (connecting, or between bytes) before the client gets 504",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=d.max_request_bytes, help="larger request bodies get 413"
    )
    p.add_argument("--records", type=int, default=d.records, help="records kept for /kvlens/pd/requests")
    p.add_argument("--request-log", metavar="FILE", help="append one JSON line per request")


def settings_from_args(a: argparse.Namespace) -> ProxySettings:
    return ProxySettings(
        host=a.host,
        port=a.port,
        prefiller_host=a.prefiller_host,
        prefiller_port=a.prefiller_port,
        num_prefillers=a.num_prefillers,
        decoder_host=a.decoder_host,
        decoder_port=a.decoder_port,
        decoder_init_port=a.decoder_init_port,
        decoder_alloc_port=a.decoder_alloc_port,
        num_decoders=a.num_decoders,
        proxy_host=a.proxy_host,
        proxy_port=a.proxy_port,
        notify_timeout_s=a.notify_timeout,
        no_pd=a.no_pd,
        backend_timeout_s=a.backend_timeout,
        max_request_bytes=a.max_request_bytes,
        records=a.records,
        request_log=a.request_log,
    )


class RoundRobin:
    """The n-th request goes to prefiller n mod P and decoder n mod D (LMCache's order)."""

    def __init__(self, prefillers: list[Backend], decoders: list[Backend]) -> None:
        self.prefillers = prefillers
        self.decoders = decoders
        self._count = itertools.count()

    def pick(self) -> tuple[Backend | None, Backend]:
        n = next(self._count)
        prefiller = self.prefillers[n % len(self.prefillers)] if self.prefillers else None
        return prefiller, self.decoders[n % len(self.decoders)]
