"""``kvlens doctor`` on PD: whether a prefiller and a decoder can pair, and what differs when
not, from their vllm:kvlens_info labels; the decoder's ports and the proxy probed from here, and
a real receiver's failure counters left as they were by the probing."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from connector.ops import doctor, doctor_pd
from connector.ops.cli import main
from connector.pd.probe import probe_receiver

from .pd_wire_support import HOST, identity, receiver, tls_files_in, wait_until

IDENTITY = {
    "version": "0.1.0",
    "chunk_size": "256",
    "key_fingerprint": "aaaaaaaaaaaa",
    "tiers": "",  # PD engines run local_cpu: False and no other tier
    "storage": "",
    "model_identity": "ckpt:1111",
    "quantization": "none",
    "kv_cache_dtype": "auto",
    "tp_size": "2",
    "block_size": "16",
    "record_layout": "bfloat16/24x65536/0a1b2c3d",
    "pd_auth": "loopback",
    "pd_tls": "",
}
PREFILLER = {**IDENTITY, "role": "kv_producer", "pd_role": "sender", "pd_proxy": "10.0.0.9:7500"}
DECODER = {
    **IDENTITY,
    "role": "kv_consumer",
    "pd_role": "receiver",
    "pd_host": "10.0.0.2",
    "pd_init_ports": "7300,7301",
    "pd_alloc_ports": "7400,7401",
    "pd_buffer_size": "1073741824",
}


def _instance(url: str, labels: dict[str, str]) -> doctor.Instance:
    (inst,) = doctor.instances(url, [(doctor.INFO, {**labels, "engine": "0", "model_name": "m"}, 1.0)])
    return inst


def _pair(prefiller=None, decoder=None, probe=None) -> doctor_pd.PDPair:
    p = _instance("http://p:8100", {**PREFILLER, **(prefiller or {})})
    d = _instance("http://d:8200", {**DECODER, **(decoder or {})})
    (pair,) = doctor_pd.pd_pairs([p, d], probe)
    return pair


def _all_open(host: str, port: int) -> None:
    return None


def test_a_matching_prefiller_and_decoder_can_pair_and_every_port_is_probed():
    probed = []

    def probe(host, port):
        probed.append((host, port))

    pair = _pair(probe=probe)
    assert pair.can_pair and pair.verdict() == (
        "PD http://p:8100 -> http://d:8200: can pair (decoder ports 10.0.0.2:7300,7301,7400,7401 and "
        "proxy 10.0.0.9:7500 reachable from here)"
    )
    assert probed == [
        ("10.0.0.2", 7300),
        ("10.0.0.2", 7301),
        ("10.0.0.2", 7400),
        ("10.0.0.2", 7401),
        ("10.0.0.9", 7500),
    ]
    assert _pair().verdict().endswith("can pair (ports not probed)")


@pytest.mark.parametrize(
    ("prefiller", "decoder", "words"),
    [
        ({"tp_size": "1"}, {}, "TP size differs (1 vs 2)"),
        ({}, {"block_size": "32"}, "block size differs (16 vs 32)"),
        ({"chunk_size": "512"}, {}, "chunk size differs (512 vs 256)"),
        (
            {},
            {"record_layout": "float16/24x65536/0a1b2c3d"},
            "record layout differs (bfloat16/24x65536/0a1b2c3d vs float16",
        ),
        (
            {"key_fingerprint": "bbbbbbbbbbbb", "model_identity": "ckpt:2222"},
            {},
            "key space differs (bbbbbbbbbbbb vs aaaaaaaaaaaa): model weights differ (ckpt:2222 vs ckpt:1111)",
        ),
        ({"key_fingerprint": "bbbbbbbbbbbb"}, {}, "key space differs (bbbbbbbbbbbb vs aaaaaaaaaaaa)"),
        ({"pd_role": "receiver"}, {}, "http://p:8100 is not a PD sender (pd_role receiver)"),
        ({}, {"pd_role": ""}, "http://d:8200 is not a PD receiver (pd_role unset: PD off)"),
        ({}, {"pd_init_ports": "7300"}, "http://d:8200 has 1 init ports for 2 ranks"),
        ({}, {"pd_alloc_ports": ""}, "http://d:8200 has 0 alloc ports for 2 ranks"),
    ],
)
def test_each_field_that_differs_is_named_in_the_verdict(prefiller, decoder, words):
    p = _instance("http://p:8100", {**PREFILLER, **prefiller})
    d = _instance("http://d:8200", {**DECODER, **decoder})
    why = doctor_pd.pd_differences(p, d)
    assert len(why) == 1 and why[0].startswith(words), why
    if p.pd_role == "sender" and d.pd_role == "receiver":
        (pair,) = doctor_pd.pd_pairs([p, d], _all_open)
        assert not pair.can_pair and pair.verdict().startswith(
            "PD http://p:8100 -> http://d:8200: CANNOT pair: "
        )
        assert words in pair.verdict() and not pair.unreachable  # no probe for a pair that cannot pair


def test_ports_refused_from_here_are_named_and_a_wildcard_host_is_tried_at_the_url():
    refused = {("d", 7301): "Connection refused", ("10.0.0.9", 7500): "No route to host"}
    pair = _pair(decoder={"pd_host": "0.0.0.0"}, probe=lambda h, p: refused.get((h, p)))
    assert pair.unreachable == [
        "decoder init port d:7301 (Connection refused)",
        "proxy 10.0.0.9:7500 (No route to host)",
    ]
    assert not pair.can_pair
    assert pair.verdict() == (
        "PD http://p:8100 -> http://d:8200: identities match, but not reachable from here: "
        "decoder init port d:7301 (Connection refused); proxy 10.0.0.9:7500 (No route to host)"
    )


def test_every_sender_meets_every_receiver_and_a_missing_partner_is_said():
    p1, p2 = _instance("http://p1", PREFILLER), _instance("http://p2", {**PREFILLER, "tp_size": "4"})
    d = _instance("http://d", DECODER)
    plain = _instance("http://x", {**IDENTITY, "role": "kv_both"})
    pairs = doctor_pd.pd_pairs([p1, plain, p2, d])
    assert [(p.sender.url, p.receiver.url, p.can_pair) for p in pairs] == [
        ("http://p1", "http://d", True),
        ("http://p2", "http://d", False),
    ]
    assert doctor_pd.pd_missing_partner([p1, plain]).startswith(
        "PD: a prefiller (pd_role sender) but no decoder"
    )
    assert doctor_pd.pd_missing_partner([d]).startswith("PD: a decoder (pd_role receiver) but no prefiller")
    assert doctor_pd.pd_missing_partner([plain]) is None and doctor_pd.pd_pairs([plain]) == []
    text = doctor.text(doctor.diagnose([p1, d]))
    assert "PD http://p1 -> http://d: can pair (ports not probed)" in text


def test_tcp_probe_says_whether_a_port_accepts():
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        assert doctor_pd.tcp_probe("127.0.0.1", port) is None
    assert doctor_pd.tcp_probe("127.0.0.1", port) == "Connection refused"


def test_a_pd_pair_is_told_as_pd_only_never_as_instances_that_cannot_share_through_stores():
    p, d = _instance("http://p:8100", PREFILLER), _instance("http://d:8200", DECODER)
    diagnosis = doctor.diagnose([p, d], probe=_all_open)
    text = doctor.text(diagnosis)
    assert "share" not in text and "CPU only" not in text and "group" not in text, text
    assert diagnosis.groups == [] and diagnosis.apart == []
    assert text.splitlines() == [
        "PD http://p:8100 -> http://d:8200: can pair (decoder ports 10.0.0.2:7300,7301,7400,7401 and "
        "proxy 10.0.0.9:7500 reachable from here)",
        "http://p:8100: PD prefiller, no KVLens tier; notifies the proxy at 10.0.0.9:7500; no PD key "
        "(loopback only)",
        "http://d:8200: PD decoder, no KVLens tier; receives on 10.0.0.2 (init ports 7300,7301, alloc "
        "ports 7400,7401), buffer 1.0 GiB per rank; no PD key (loopback only)",
    ]
    result = diagnosis.to_json()
    assert result["share_groups"] == [] and result["cannot_share"] == []
    assert [i["summary"] for i in result["instances"]] == text.splitlines()[1:]


def test_pd_instances_beside_instances_with_tiers_leave_the_sharing_groups_to_those():
    p, d = (
        _instance("http://p", PREFILLER),
        _instance("http://d", {**DECODER, "pd_auth": "key", "pd_tls": "on"}),
    )
    store = {**IDENTITY, "tiers": "cpu+remote", "storage": "remote:redis://r/kvlens", "role": "kv_both"}
    a, b = _instance("http://a", store), _instance("http://b", store)
    c = _instance("http://c", {**store, "storage": ""})
    diagnosis = doctor.diagnose([p, a, d, b, c])
    assert [[i.url for i in g] for g in diagnosis.groups] == [["http://a", "http://b"], ["http://c"]]
    text = doctor.text(diagnosis)
    assert "http://a / http://c: no common store (remote:redis://r/kvlens vs CPU only)" in text
    (line,) = [x for x in text.splitlines() if x.startswith("http://d:")]
    assert line.startswith("http://d: PD decoder, no KVLens tier;") and line.endswith("; PD key, TLS")
    assert "http://a: tiers cpu+remote, role kv_both" in text


def test_an_engine_without_a_tier_is_not_cpu_only():
    none = _instance("http://n", {**IDENTITY, "role": "kv_both"})
    cpu = _instance("http://c", {**IDENTITY, "tiers": "cpu", "role": "kv_both"})
    assert doctor.differences(none, cpu) == ["no common store (no KVLens tier vs CPU only)"]
    assert doctor.summary(none) == "no KVLens tier, role kv_both"


# ---- the command, against fake instances serving /metrics ---------------------------------------
class _Metrics(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def _serve(labels: dict[str, str]) -> ThreadingHTTPServer:
    text = ",".join(f'{k}="{v}"' for k, v in {**labels, "engine": "0", "model_name": "m"}.items())
    body = f"# TYPE vllm:kvlens_info gauge\nvllm:kvlens_info{{{text}}} 1.0\n".encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_Metrics,), {"body": body}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def listeners():
    """Five listening ports on 127.0.0.1: the decoder's init and alloc ports (TP 2), the proxy's."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(5)]
    yield [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()


def test_the_doctor_command_gives_a_verdict_and_exits_1_when_a_pair_cannot_pair(capsys, listeners):
    i0, i1, a0, a1, proxy = listeners
    decoder = {
        **DECODER,
        "pd_host": "127.0.0.1",
        "pd_init_ports": f"{i0},{i1}",
        "pd_alloc_ports": f"{a0},{a1}",
    }
    good = _serve({**PREFILLER, "pd_proxy": f"127.0.0.1:{proxy}"})
    bad = _serve({**PREFILLER, "pd_proxy": f"127.0.0.1:{proxy}", "block_size": "32"})
    d = _serve(decoder)
    url = {s: f"http://127.0.0.1:{s.server_address[1]}" for s in (good, bad, d)}
    try:
        assert main(["doctor", url[good], url[d]]) == 0
        out = capsys.readouterr().out
        assert f"PD {url[good]} -> {url[d]}: can pair" in out and "not probed" not in out
        assert main(["doctor", url[good], url[bad], url[d], "--json"]) == 1
        pairs = json.loads(capsys.readouterr().out)["pd_pairs"]
    finally:
        for s in (good, bad, d):
            s.shutdown()
    assert [(p["prefiller"], p["can_pair"], p["reachability_checked"]) for p in pairs] == [
        (url[good], True, True),
        (url[bad], False, False),
    ]
    assert pairs[1]["differences"] == ["block size differs (32 vs 16)"]
    assert pairs[1]["verdict"] == f"PD {url[bad]} -> {url[d]}: CANNOT pair: block size differs (32 vs 16)"


def test_a_pair_where_only_one_side_has_a_pd_key_cannot_pair_and_tls_must_agree():
    pair = _pair(prefiller={"pd_auth": "key"}, decoder={"pd_auth": "loopback"})
    assert not pair.can_pair
    assert (
        "only http://p:8100 has a PD key (pd_auth_key): the handshake fails as auth_failed"
        in pair.differences
    )
    tls = _pair(prefiller={"pd_auth": "key", "pd_tls": "on"}, decoder={"pd_auth": "key"})
    assert tls.differences == ["TLS differs (pd_tls on vs off)"]
    assert _pair(prefiller={"pd_auth": "key"}, decoder={"pd_auth": "key"}).can_pair


def test_doctor_says_when_a_pair_runs_without_a_key_beyond_loopback():
    pair = _pair(prefiller={"pd_auth": "unauthenticated"}, decoder={"pd_auth": "unauthenticated"})
    assert pair.can_pair and len(pair.warnings) == 2
    assert "UNAUTHENTICATED (pd_allow_unauthenticated: true)" in pair.verdict()
    assert _pair(prefiller={"pd_auth": "key"}, decoder={"pd_auth": "key"}).warnings == []


# ---- a diagnosis is not a failure: doctor against a real PD receiver -----------------------------
@pytest.fixture
def tls_files(tmp_path):  # type: ignore[no-untyped-def]
    return tls_files_in(str(tmp_path))


@pytest.mark.parametrize("auth", ["loopback", "key", "key+tls"])
def test_a_doctor_run_leaves_every_failure_counter_of_the_receiver_where_it_was(auth, tls_files):
    """kvlens doctor connects to each of the decoder's ports and closes at once: the receiver
    must not count that as a failed transfer (peer_closed, or tls_failed on a TLS decoder), or
    every diagnosis feeds the "Refused or failed" panel and the KVLensPDTransfersRefused alert."""
    from connector.pd.auth import PDAuth
    from connector.pd.tls import ClientTLS, ServerTLS, TLSFiles

    key = PDAuth(b"operator's PD key, 32 characters") if auth != "loopback" else None
    server_tls = ServerTLS(TLSFiles(tls_files.cert, tls_files.key)) if auth == "key+tls" else None
    client_tls = ClientTLS(TLSFiles(ca_file=tls_files.cert)) if server_tls else None
    proxy = socket.create_server((HOST, 0))
    with receiver(tp=2, auth=key, tls=server_tls) as rx:
        decoder = {
            **DECODER,
            "pd_host": HOST,
            "pd_init_ports": ",".join(map(str, rx.init_ports)),
            "pd_alloc_ports": ",".join(map(str, rx.alloc_ports)),
            "pd_auth": auth.split("+")[0],
            "pd_tls": "on" if server_tls else "",
        }
        prefiller = {**PREFILLER, "pd_proxy": f"{HOST}:{proxy.getsockname()[1]}"}
        prefiller.update({k: decoder[k] for k in ("pd_auth", "pd_tls")})
        servers = [_serve(prefiller), _serve(decoder)]
        urls = [f"http://{HOST}:{s.server_address[1]}" for s in servers]
        before = rx.stats()
        try:
            for _ in range(3):
                assert main(["doctor", *urls]) == 0
        finally:
            for s in servers:
                s.shutdown()
            proxy.close()
        # A handshake on each port after doctor's connections: each port accepts in order, so once
        # it is answered the receiver has taken doctor's connection on that port too.
        for rank, ports in enumerate(zip(rx.init_ports, rx.alloc_ports, strict=True)):
            for port in ports:
                assert probe_receiver(HOST, port, identity(rank, 2), 10.0, key, client_tls).ok
        wait_until(lambda: rx.stats().connections == 0, what="every connection served")
        after = rx.stats()
    assert after.failed == before.failed == {}
    assert after.transfers == before.transfers


def test_only_a_connection_closed_before_its_first_byte_is_a_probe():
    import struct

    with receiver() as rx:
        for how in ("close", "reset"):
            s = socket.create_connection((HOST, rx.alloc_ports[0]))
            if how == "reset":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        half = socket.create_connection((HOST, rx.init_ports[0]))
        half.sendall(b"KP")  # a peer that began a frame and went: a failure, as before
        half.close()
        wait_until(lambda: rx.stats().failed, what="the half frame counted")
        assert probe_receiver(HOST, rx.alloc_ports[0], identity(), 10.0).ok  # the two probes were taken
        wait_until(lambda: rx.stats().connections == 0, what="every connection served")
        assert rx.stats().failed == {"peer_closed": 1}


def test_a_prefiller_that_names_no_proxy_can_pair_and_is_told_what_that_costs():
    pair = _pair(prefiller={"pd_proxy": ""}, probe=_all_open)
    assert pair.can_pair
    assert any("names no proxy" in w and "waits out its bound" in w for w in pair.warnings)


def test_a_decoder_bound_to_loopback_cannot_pair_with_a_prefiller_on_another_host():
    pair = _pair(decoder={"pd_host": "127.0.0.1"})  # _pair's URLs are http://p and http://d
    assert not pair.can_pair
    assert "binds its PD ports to loopback (127.0.0.1)" in pair.verdict()
    p = _instance("http://localhost:7100", PREFILLER)
    d = _instance("http://localhost:7200", {**DECODER, "pd_host": "127.0.0.1"})
    assert doctor_pd.pd_differences(p, d) == []  # one host: loopback is right
