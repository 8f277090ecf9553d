"""Whether PD prefillers and decoders can pair: the PD half of ``kvlens doctor``. Pure but for
``tcp_probe``.

A prefiller (``pd_role`` sender) and a decoder (receiver) pair when their keys agree (key space),
their TP sizes, block sizes, chunk sizes and record layouts are equal (rank r sends rank r its
records as they are), each is in its role, the decoder has one init and one alloc port per rank
reachable from here, and the prefiller's proxy (``pd_proxy_host:pd_proxy_port``) is reachable
from here. Reachability is a TCP connect made by the caller's ``probe`` (``tcp_probe``); without
one it is not checked. PD engines keep no KVLens tier, so ``doctor.py`` leaves them out of the
sharing groups and tells each by ``pd_summary``.

A diagnosis must not count as a failure on the decoder. Doctor does not speak the PD handshake
(``pd.probe.probe_receiver``): it has no PD key, and a handshake it cannot finish against a keyed
decoder is an ``auth_failed`` there (a TLS decoder would need the CA too), while identities are
compared from ``vllm:kvlens_info`` anyway. It connects and closes before sending a byte, which
no transfer ever does, and the receiver takes such a connection as a probe, counted nowhere
(``pd/receiver.py`` ``_closes_unheard``; load balancers' and Kubernetes's TCP checks look the
same). So one check serves keyed, loopback, unauthenticated and TLS decoders alike.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .instances import Instance
from .units import human_bytes

PROBE_TIMEOUT_S = 2.0  # per port: a connect that takes longer is "timed out" from here
Probe = Callable[[str, int], str | None]  # (host, port) -> None when it accepts a connection, else why
SENDER, RECEIVER = "sender", "receiver"
USUAL_ROLE = {SENDER: "kv_producer", RECEIVER: "kv_consumer"}
_AUTH_WORDS = {
    "key": "PD key",
    "loopback": "no PD key (loopback only)",
    "unauthenticated": "no PD key, UNAUTHENTICATED beyond loopback",
}
_ANY_HOST = ("", "0.0.0.0", "::", "[::]")
# (label, words) of the identity fields a prefiller and a decoder must have equal
_PD_EQUAL = (
    ("tp_size", "TP size"),
    ("block_size", "block size"),
    ("chunk_size", "chunk size"),
    ("record_layout", "record layout"),
)


def tcp_probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``host:port`` accepts a TCP connection, else the OS's reason. Nothing is sent: a
    PD receiver takes a connection closed before its first byte as a probe, not a failure."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


@dataclass(slots=True)
class PDPair:
    sender: Instance
    receiver: Instance
    differences: list[str]  # why they cannot pair (identity, roles, ports)
    unreachable: list[str]  # what cannot be reached from here (None probe: not checked)
    checked: bool  # whether reachability was probed
    warnings: list[str] = field(default_factory=list)  # what the pair exposes (no key beyond loopback)
    reached: str = ""  # what was probed, in words ("decoder ports h:p,p and proxy h:p")

    @property
    def can_pair(self) -> bool:
        return not self.differences and not self.unreachable

    def verdict(self) -> str:
        head = f"PD {self.sender.name} -> {self.receiver.name}:"
        if self.differences:
            return f"{head} CANNOT pair: " + "; ".join(self.differences)
        if self.unreachable:
            return f"{head} identities match, but not reachable from here: " + "; ".join(self.unreachable)
        where = f" ({self.reached} reachable from here)" if self.reached else ""
        said = f"{head} can pair" + (where if self.checked else " (ports not probed)")
        return "; ".join([said, *self.warnings])


def _split_ports(value: str) -> list[int]:
    out = []
    for part in value.split(","):
        try:
            out.append(int(part))
        except ValueError:
            continue
    return out


def pd_differences(sender: Instance, receiver: Instance) -> list[str]:
    """Why ``sender`` cannot hand its prompts' KV to ``receiver``; empty when it can."""
    s, r = sender.info, receiver.info
    why = []
    if sender.pd_role != SENDER:
        why.append(f"{sender.name} is not a PD sender (pd_role {sender.pd_role or 'unset: PD off'})")
    if receiver.pd_role != RECEIVER:
        why.append(f"{receiver.name} is not a PD receiver (pd_role {receiver.pd_role or 'unset: PD off'})")
    if s.get("key_fingerprint") != r.get("key_fingerprint"):
        parts = [
            f"{words} ({s.get(label) or '?'} vs {r.get(label) or '?'})"
            for label, words in (
                ("model_identity", "model weights differ"),
                ("quantization", "quantization differs"),
                ("kv_cache_dtype", "KV cache dtype differs"),
            )
            if s.get(label) != r.get(label)
        ]
        key = f"key space differs ({s.get('key_fingerprint') or '?'} vs {r.get('key_fingerprint') or '?'})"
        why.append(key + (": " + ", ".join(parts) if parts else ""))
    for label, words in _PD_EQUAL:
        if s.get(label) != r.get(label):
            why.append(f"{words} differs ({s.get(label) or '?'} vs {r.get(label) or '?'})")
    if receiver.pd_role == RECEIVER:
        ranks = _tp(r)
        for label in ("pd_init_ports", "pd_alloc_ports"):
            ports = _split_ports(r.get(label, ""))
            if ranks and len(ports) != ranks:
                why.append(
                    f"{receiver.name} has {len(ports)} {label[3:-1].replace('_', ' ')}s for {ranks} ranks"
                )
    if receiver.pd_role == RECEIVER and _on_other_hosts(sender, receiver):
        why.append(
            f"{receiver.name} binds its PD ports to loopback ({r.get('pd_host')}), which a prefiller on "
            f"another host ({sender.name}) cannot reach: bind pd_peer_host to an address it reaches "
            "(with a PD key)"
        )
    if (s.get("pd_auth") == "key") != (r.get("pd_auth") == "key"):
        keyed = sender if s.get("pd_auth") == "key" else receiver
        why.append(f"only {keyed.name} has a PD key (pd_auth_key): the handshake fails as auth_failed")
    if (s.get("pd_tls") == "on") != (r.get("pd_tls") == "on"):
        why.append(f"TLS differs (pd_tls {s.get('pd_tls') or 'off'} vs {r.get('pd_tls') or 'off'})")
    return why


def pd_warnings(sender: Instance, receiver: Instance) -> list[str]:
    """What a pair that can pair exposes or lacks: PD without a key beyond loopback; no proxy."""
    out = [
        f"{i.name} runs PD UNAUTHENTICATED (pd_allow_unauthenticated: true): anyone who reaches "
        "its PD ports can hand a decoder KV or receive a prefiller's; set pd_auth_key on both"
        for i in (sender, receiver)
        if i.info.get("pd_auth") == "unauthenticated"
    ]
    if sender.pd_role == SENDER and not sender.info.get("pd_proxy"):
        out.append(
            f"{sender.name} names no proxy (pd_proxy_host, pd_proxy_port): a proxy that waits for its "
            "notices (LMCache's, kvlens pd-proxy) waits out its bound on every request"
        )
    return out


def _on_other_hosts(sender: Instance, receiver: Instance) -> bool:
    """The decoder binds loopback and the two URLs name different hosts (neither a loopback name)."""
    if not _is_loopback(receiver.info.get("pd_host", "")):
        return False
    a, b = urlsplit(sender.url).hostname or "", urlsplit(receiver.url).hostname or ""
    return bool(a and b) and a.lower() != b.lower() and not (_is_loopback(a) or _is_loopback(b))


def _is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _tp(info: Mapping[str, str]) -> int:
    return _int(info.get("tp_size", ""))


def _int(value: str) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def _host_port(value: str) -> tuple[str, int] | None:
    host, _, port = value.rpartition(":")
    try:
        return (host.strip("[]"), int(port)) if host else None
    except ValueError:
        return None


def _decoder_host(receiver: Instance) -> str:
    """Where the decoder's ports are tried: its ``pd_host``, or its URL's host when it binds every
    interface."""
    host = receiver.info.get("pd_host", "")
    return urlsplit(receiver.url).hostname or "" if host in _ANY_HOST else host


def pd_reachability(sender: Instance, receiver: Instance, probe: Probe) -> list[str]:
    """The decoder's init and alloc ports and the prefiller's proxy that refuse a connection from
    here (a decoder bound on every interface is tried at its URL's host)."""
    r = receiver.info
    host = _decoder_host(receiver)
    out = []
    for label in ("pd_init_ports", "pd_alloc_ports"):
        for port in _split_ports(r.get(label, "")):
            if (why := probe(host, port)) is not None:
                out.append(f"decoder {label[3:-1].replace('_', ' ')} {host}:{port} ({why})")
    proxy = _host_port(sender.info.get("pd_proxy", ""))
    if proxy is not None and (why := probe(*proxy)) is not None:
        out.append(f"proxy {proxy[0]}:{proxy[1]} ({why})")
    return out


def _probed(sender: Instance, receiver: Instance) -> str:
    r = receiver.info
    ports = [*_split_ports(r.get("pd_init_ports", "")), *_split_ports(r.get("pd_alloc_ports", ""))]
    said = f"decoder ports {_decoder_host(receiver)}:{','.join(map(str, ports))}"
    proxy = _host_port(sender.info.get("pd_proxy", ""))
    return said + (f" and proxy {proxy[0]}:{proxy[1]}" if proxy is not None else "")


def pd_pairs(found: list[Instance], probe: Probe | None = None) -> list[PDPair]:
    """Every PD sender with every PD receiver among ``found``, in order found."""
    senders = [i for i in found if i.pd_role == SENDER]
    receivers = [i for i in found if i.pd_role == RECEIVER]
    out = []
    for s in senders:
        for r in receivers:
            why = pd_differences(s, r)
            checked = probe is not None and not why
            unreachable = pd_reachability(s, r, probe) if checked and probe is not None else []
            reached = _probed(s, r) if checked else ""
            out.append(PDPair(s, r, why, unreachable, checked, pd_warnings(s, r), reached))
    return out


def pd_summary(inst: Instance) -> str:
    """What a PD engine is, in one line: its part, its tiers (usually none), its ports or proxy,
    its key and TLS."""
    info = inst.info
    tiers = f"tiers {info['tiers']}" if inst.has_tier else "no KVLens tier"
    role = info.get("role", "?")
    head = "PD prefiller" if inst.pd_role == SENDER else "PD decoder"
    if role != USUAL_ROLE.get(inst.pd_role):
        head += f" (role {role})"
    if inst.pd_role == SENDER:
        proxy = info.get("pd_proxy")
        what = f"notifies the proxy at {proxy}" if proxy else "notifies no proxy"
    else:
        size = _int(info.get("pd_buffer_size", ""))
        what = (
            f"receives on {info.get('pd_host') or '?'} (init ports {info.get('pd_init_ports') or '-'}, "
            f"alloc ports {info.get('pd_alloc_ports') or '-'}), buffer "
            + (f"{human_bytes(size)} per rank" if size else "?")
        )
    guard = _AUTH_WORDS.get(info.get("pd_auth", ""), "")
    if info.get("pd_tls") == "on":
        guard = f"{guard}, TLS" if guard else "TLS"
    return "; ".join(part for part in (f"{head}, {tiers}", what, guard) if part)


def pd_missing_partner(found: list[Instance]) -> str | None:
    """A sentence when PD instances were given without a partner of the other role."""
    roles = {i.pd_role for i in found}
    if SENDER in roles and RECEIVER not in roles:
        return "PD: a prefiller (pd_role sender) but no decoder (pd_role receiver) among the URLs"
    if RECEIVER in roles and SENDER not in roles:
        return "PD: a decoder (pd_role receiver) but no prefiller (pd_role sender) among the URLs"
    return None
