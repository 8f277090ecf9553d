"""The Overview's numbers, and its words, on hand-written sample frames with known answers: a
PD decoder's received tokens count as a source of their own and as supplied by KVLens."""

from __future__ import annotations

import pytest

from dashboard import overview, palette, text
from dashboard.catalog import PD_LOADED_TOKENS, VLLM_PREFILL_SECONDS_SUM, VLLM_PROMPT_BY_SOURCE
from dashboard.views import for_instances

from .frames import DECODER, PREFILLER, frame, pd_pair, row, series

HITS = "vllm:kvlens_hit_tokens_total"
LOOKUPS = "vllm:kvlens_lookup_tokens_total"


def test_hit_rate_is_missing_not_nan_when_nothing_was_looked_up():
    f = frame(*series(HITS, [0, 50, 50, 50], tier="cpu"), *series(LOOKUPS, [0, 100, 100, 100]))
    r = overview.hit_rates(f, window_s=10)
    assert list(r.index) == [10]
    assert r.loc[10, "KVLens, tokens"] == pytest.approx(0.5)


def test_savings_estimate_prefill_seconds_from_the_engines_measured_cost():
    f = frame(
        row(0, "vllm:kvlens_load_tokens_total", 0, tier="cpu"),
        row(10, "vllm:kvlens_load_tokens_total", 1000, tier="cpu"),
        row(0, "vllm:kvlens_load_tokens_total", 200, tier="disk"),
        row(10, "vllm:kvlens_load_tokens_total", 500, tier="disk"),
        row(10, VLLM_PROMPT_BY_SOURCE, 3000, source="local_compute"),
        row(10, VLLM_PREFILL_SECONDS_SUM, 3.0),  # batched requests' overlapping prefill times: unused
        row(0, "vllm:kvlens_prefill_seconds_per_token", 0.002),
        row(10, "vllm:kvlens_prefill_seconds_per_token", 0.0005),  # the latest measure counts
        row(10, LOOKUPS, 6000),
        row(10, HITS, 1500, tier="cpu"),
    )
    s = overview.savings(f)
    assert s.loaded_tokens == 1500  # since the server started
    assert s.loaded_tokens_window == 1000 + 300  # while the dashboard watched
    assert s.prefill_s_per_token == pytest.approx(0.0005)
    assert s.seconds_saved == pytest.approx(0.75)
    assert s.hit_rate == pytest.approx(0.25)


def test_savings_has_no_estimate_before_the_engine_measured_a_prefill():
    s = overview.savings(
        frame(
            row(0, "vllm:kvlens_load_tokens_total", 0, tier="cpu"),
            row(0, VLLM_PROMPT_BY_SOURCE, 3000, source="local_compute"),
            row(0, VLLM_PREFILL_SECONDS_SUM, 1.5),
        )
    )
    assert s.seconds_saved is None and s.hit_rate is None


def test_instance_table_has_one_row_per_instance():
    f = frame(
        row(0, LOOKUPS, 100, "a:1"),
        row(0, HITS, 50, "a:1", tier="cpu"),
        row(0, LOOKUPS, 100, "b:1"),
        row(0, HITS, 0, "b:1", tier="cpu"),
    )
    t = overview.instance_table(f)
    assert list(t.index) == ["a:1", "b:1"]
    assert list(t["KVLens hit rate"]) == [0.5, 0.0]


def test_a_decoders_received_tokens_count_as_supplied_by_kvlens_in_the_hit_rate_and_loaded():
    pair = pd_pair()  # two prompts of 2000 tokens; the decoder's prompts are 2001 long
    decoder = overview.savings(for_instances(pair, [DECODER]))
    assert (decoder.loaded_tokens, decoder.pd_loaded_tokens, decoder.supplied_tokens) == (0, 4000, 4000)
    assert decoder.supplied_tokens_window == 4000
    assert decoder.hit_rate == pytest.approx(4000 / 4002)
    prefiller = overview.savings(for_instances(pair, [PREFILLER]))
    assert prefiller.supplied_tokens == 0 and prefiller.hit_rate == 0
    both = overview.savings(pair)  # the prefiller looked its prompts up too, and computed them
    assert both.supplied_tokens == 4000 and both.hit_rate == pytest.approx(4000 / 8002)
    rates = overview.hit_rates(for_instances(pair, [DECODER]), window_s=10)
    assert rates.loc[20, "KVLens, tokens"] == pytest.approx(2000 / 2001)
    assert rates.loc[20, "KVLens, requests"] == pytest.approx(1.0)


def test_received_from_a_prefiller_is_a_source_of_its_own_where_prompt_tokens_came_from():
    pair = pd_pair()
    sources = overview.token_sources(pair, window_s=10)
    assert list(sources.columns) == [palette.PD_RECEIVED, palette.COMPUTED]
    assert sources.loc[20, palette.PD_RECEIVED] == pytest.approx(200)  # 2000 tokens in 10 s
    assert sources.loc[20, palette.COMPUTED] == pytest.approx(200.1)  # the prefiller's and the 1 token
    totals = overview.token_totals(pair)
    assert totals[palette.PD_RECEIVED] == 4000 and totals[palette.COMPUTED] == 4002


def test_the_per_instance_table_names_each_role_and_what_the_decoder_received():
    table = overview.instance_table(pd_pair())
    assert table.loc[PREFILLER, "PD role"] == "prefiller" and table.loc[DECODER, "PD role"] == "decoder"
    assert table.loc[DECODER, "tokens loaded by KVLens"] == 4000
    assert table.loc[DECODER, overview.RECEIVED_COLUMN] == 4000
    assert table.loc[DECODER, "KVLens hit rate"] == pytest.approx(4000 / 4002)
    assert (
        table.loc[PREFILLER, "KVLens hit rate"] == 0 and table.loc[PREFILLER, overview.RECEIVED_COLUMN] == 0
    )


def test_without_pd_there_is_no_pd_source_nor_column():
    """Every engine exports the PD series, at 0 where PD is off: no source, no column of zeros."""
    f = frame(
        *series(LOOKUPS, [0, 100, 200]),
        *series(HITS, [0, 50, 100], tier="cpu"),
        *series("vllm:kvlens_load_tokens_total", [0, 50, 100], tier="cpu"),
        *series(PD_LOADED_TOKENS, [0, 0, 0]),
    )
    assert palette.PD_RECEIVED not in overview.token_totals(f)
    assert palette.PD_RECEIVED not in overview.token_sources(f, window_s=10).columns
    assert list(overview.instance_table(f).columns)[:2] == ["KVLens hit rate", "tokens loaded by KVLens"]
    assert overview.savings(f).hit_rate == pytest.approx(0.5)


def test_a_prefix_both_held_in_a_tier_and_received_counts_once_at_most():
    f = frame(
        *series(LOOKUPS, [0, 2001], DECODER),
        *series(HITS, [0, 2000], DECODER, tier="cpu"),
        *series(PD_LOADED_TOKENS, [0, 2000], DECODER),
    )
    assert overview.savings(f).hit_rate == 1.0
    assert overview.hit_rates(f, window_s=10).loc[10, "KVLens, tokens"] == 1.0


def test_the_overview_says_what_received_from_a_prefiller_is():
    assert text.PD_SOURCE.startswith("Received from a prefiller (PD): on a PD decoder, prompt tokens")
    assert "p2p" in text.PD_SOURCE and "vllm:kvlens_pd_loaded_tokens_total" in text.PD_SOURCE
    assert text.loaded_help(1500, 6000).startswith(
        "1.5k loaded from KVLens's tiers and 6k received from a prefiller (PD), since the servers started."
    )
    assert text.overview_caption(30, with_pd=True).endswith(text.PD_SOURCE)
    assert "prefiller" not in text.overview_caption(30, with_pd=False)
