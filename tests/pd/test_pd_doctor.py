"""``kvlens doctor`` on the real 1P1D pair (issue 37 items 2, 6): it says the two can pair, speaks
of PD only (no sharing groups for engines without a tier), and leaves the decoder's failure
counters where they were though it connects to each of its PD ports."""

from __future__ import annotations

import pytest

from connector.ops.cli import main
from tests.telemetry.serve import prompt_tokens, sum_samples, wait_until

from .conftest import CHUNK

pytestmark = pytest.mark.integration


def _received(pair, series: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return sum_samples(pair.decoder.samples(), series, side="receive", **labels)


def test_doctor_on_the_pair_says_they_can_pair_and_counts_no_failure(pd_pair, capsys):
    p, d = pd_pair.prefiller.url, pd_pair.decoder.url
    if main(["doctor", p, d]) == 2:  # engines that have served nothing yet (this test ran first)
        out = capsys.readouterr().out
        assert "KVLens is loaded, but has not published vllm:kvlens_info yet" in out
        assert "not loaded" not in out
    pd_pair.run(prompt_tokens(CHUNK + 8, seed=137), 6)  # each engine steps: its series are published
    capsys.readouterr()
    failed_before = _received(pd_pair, "vllm:kvlens_pd_failed_transfers_total")
    ok_before = _received(pd_pair, "vllm:kvlens_pd_transfers_total", outcome="ok")
    for _ in range(3):
        assert main(["doctor", p, d]) == 0
    out = capsys.readouterr().out
    # The decoder publishes its PD series when it steps: a transfer after doctor's runs makes it,
    # and once that transfer shows, so would any failure doctor's connections were counted as.
    got = pd_pair.run(prompt_tokens(CHUNK + 8, seed=131), 6)
    received = got["decode"]["kv_transfer_params"]["kvlens"]["pd"]
    assert received["outcome"] == "loaded", (received, got["prefill"]["kv_transfer_params"])
    wait_until(
        lambda: _received(pd_pair, "vllm:kvlens_pd_transfers_total", outcome="ok") > ok_before,
        what="the transfer published",
    )
    assert _received(pd_pair, "vllm:kvlens_pd_failed_transfers_total") == failed_before
    ports = ",".join(map(str, [*pd_pair.init_ports, *pd_pair.alloc_ports]))
    said = out.splitlines()[:3]
    assert said[0] == (
        f"PD {p} -> {d}: can pair (decoder ports 127.0.0.1:{ports} and proxy 127.0.0.1:{pd_pair.proxy_port} "
        "reachable from here)"
    )
    assert said[1].startswith(f"{p}: PD prefiller, no KVLens tier; notifies the proxy at 127.0.0.1:")
    assert said[2].startswith(f"{d}: PD decoder, no KVLens tier; receives on 127.0.0.1 (init ports ")
    assert "share" not in out and "CPU only" not in out
