"""``kvlens doctor``: who can share KV, why not, tier health and what-if advice, from /metrics."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from connector.ops import doctor
from connector.ops.cli import main

BASE = {
    "version": "0.1.0",
    "chunk_size": "256",
    "key_fingerprint": "aaaaaaaaaaaa",
    "tiers": "cpu+remote",
    "role": "kv_both",
    "storage": "remote:redis://r:6379/0/kvlens",
    "model_identity": "ckpt:1111",
    "quantization": "none",
    "kv_cache_dtype": "auto",
}


def _samples(info=None, health=None, whatif=None, engine="0"):
    out = [(doctor.INFO, {**BASE, **(info or {}), "engine": engine, "model_name": "m"}, 1.0)]
    for tier, level in (health or {"cpu": 2, "remote": 2}).items():
        out.append((doctor.TIER_HEALTH, {"tier": tier, "engine": engine}, float(level)))
    for tier, curve in (whatif or {}).items():
        for factor, ratio in curve.items():
            out.append((doctor.WHATIF, {"tier": tier, "budget_factor": factor, "engine": engine}, ratio))
    return out


def _one(**kw):
    (inst,) = doctor.instances(kw.pop("url", "http://a"), _samples(**kw))
    return inst


@pytest.mark.parametrize(
    "change, words",
    [
        ({"model_identity": "ckpt:2222", "key_fingerprint": "bbbbbbbbbbbb"}, "model weights differ"),
        ({"quantization": "fp8", "key_fingerprint": "bbbbbbbbbbbb"}, "quantization differ"),
        ({"kv_cache_dtype": "fp8_e4m3", "key_fingerprint": "bbbbbbbbbbbb"}, "KV cache dtype differ"),
        ({"key_fingerprint": "bbbbbbbbbbbb"}, "same model: KV layout, parallel size"),
        ({"chunk_size": "512"}, "chunk sizes differ (256 vs 512)"),
        ({"storage": "disk:1234abcd"}, "no common store"),
    ],
)
def test_each_part_of_the_key_that_differs_is_named(change, words):
    a, b = _one(), _one(url="http://b", info=change)
    (why,) = doctor.differences(a, b)
    assert words in why
    assert not doctor.differences(a, _one(url="http://c"))


def test_instances_group_by_who_can_share_and_each_group_is_explained():
    a, b = _one(url="http://a"), _one(url="http://b")
    c = _one(url="http://c", info={"key_fingerprint": "cccccccccccc", "quantization": "fp8"})
    d = doctor.diagnose([a, b, c])
    assert [[i.url for i in g] for g in d.groups] == [["http://a", "http://b"], ["http://c"]]
    ((x, y, why),) = d.apart
    assert (x.url, y.url) == ("http://a", "http://c") and "quantization differs (none vs fp8)" in why[0]
    text = doctor.text(d)
    assert "group 1" in text and "cannot share" in text


def test_a_data_parallel_server_is_one_instance_per_engine():
    samples = _samples(engine="0") + _samples(engine="1")
    found = doctor.instances("http://dp", samples)
    assert [i.engine for i in found] == ["0", "1"] and found[1].name == "http://dp (engine 1)"
    assert doctor.instances("http://none", [("vllm:num_requests_running", {}, 0.0)]) == []


def test_tier_health_in_words():
    inst = _one(health={"cpu": 2, "disk": 1, "remote": 0})
    assert doctor.tier_findings(inst) == [
        "cpu tier: healthy",
        "disk tier: failing (still used)",
        "remote tier: skipped (unusable)",
    ]


def test_whatif_advice_grows_shrinks_or_keeps_a_tier():
    grow = {"0.5": 0.2, "1": 0.3, "2": 0.32, "4": 0.5}
    shrink = {"0.5": 0.6, "1": 0.6, "2": 0.6}
    keep = {"0.5": 0.4, "1": 0.5, "2": 0.52}
    inst = _one(whatif={"cpu": grow, "disk": shrink, "remote": keep})
    cpu, disk, remote = doctor.whatif_advice(inst)
    assert "4x its size would hit 50%" in cpu and "grow" in cpu
    assert "could shrink" in disk
    assert "sized about right" in remote


class _Metrics(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def _serve(body: str):
    handler = type("H", (_Metrics,), {"body": body.encode()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_doctor_command_reads_metrics_and_says_who_cannot_be_read(capsys):
    labels = ",".join(f'{k}="{v}"' for k, v in {**BASE, "engine": "0", "model_name": "m"}.items())
    text = f"# TYPE vllm:kvlens_info gauge\nvllm:kvlens_info{{{labels}}} 1.0\n"
    good, empty = _serve(text), _serve("# nothing here\n")
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in (good, empty)]
        code = main(["doctor", *urls, "http://127.0.0.1:1", "--json"])
        result = json.loads(capsys.readouterr().out)
    finally:
        good.shutdown()
        empty.shutdown()
    assert code == 2 and result["share_groups"] == [[urls[0]]]
    assert (
        "KVLens is not loaded" in result["unreachable"][urls[1]]
        and "http://127.0.0.1:1" in result["unreachable"]
    )


def test_an_engine_that_has_not_stepped_yet_is_not_said_to_run_no_kvlens(capsys):
    """vLLM publishes KVLens's series with the engine's steps: before its first request an engine
    serves KVLens's zeroed families but no vllm:kvlens_info."""
    fresh = _serve('# TYPE vllm:kvlens_lookups_total counter\nvllm:kvlens_lookups_total{engine="0"} 0.0\n')
    try:
        url = f"http://127.0.0.1:{fresh.server_address[1]}"
        code = main(["doctor", url])
        out = capsys.readouterr().out
    finally:
        fresh.shutdown()
    assert code == 2 and "not loaded" not in out
    assert f"{url}: not read (KVLens is loaded, but has not published vllm:kvlens_info yet" in out
    assert "serve it one request, then run doctor again" in out
