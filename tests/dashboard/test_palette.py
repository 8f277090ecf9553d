"""One colour per source and per tier: every chart the app draws gives a series the colour the
palette names for it, whichever other series exist, and the Grafana bundle gives the same."""

from __future__ import annotations

import itertools
import json
import math

import pandas as pd
import pytest

from dashboard import charts, overview, palette, views
from dashboard.catalog import VLLM_PREFIX_HITS, VLLM_PREFIX_QUERIES, VLLM_PROMPT_BY_SOURCE, kvlens

from .frames import frame, series

SOURCES_AND_TIERS = ("vLLM prefix cache", "computed", "KVLens", "cpu", "disk", "remote")


def encoded_colours(chart) -> dict[str, str]:
    """Name -> colour as the chart's spec encodes it (every layer's colour scale)."""
    spec = chart.to_dict()
    out: dict[str, str] = {}
    for part in [spec, *spec.get("layer", [])]:
        channel = part.get("encoding", {}).get("color", {})
        if "field" not in channel:  # no colour, or one fixed colour (a rule, a label)
            continue
        scale = channel.get("scale", {})
        assert "domain" in scale and "range" in scale, f"a colour channel without a fixed scale: {part}"
        assert len(scale["domain"]) == len(scale["range"])
        out.update(zip(scale["domain"], scale["range"], strict=True))
    assert out, "no colour channel"
    return out


def wide(*names: str) -> pd.DataFrame:
    return pd.DataFrame({n: [1.0, 2.0] for n in names}, index=[0.0, 10.0])


def token_frame(with_vllm: bool, tiers: tuple[str, ...]) -> pd.DataFrame:
    """vLLM's prompt tokens by source and KVLens's loads per tier, growing over 4 reads."""
    rows = series(VLLM_PROMPT_BY_SOURCE, [0, 100, 200, 300], source="local_compute")
    if with_vllm:
        rows += series(VLLM_PROMPT_BY_SOURCE, [0, 50, 100, 150], source="local_cache_hit")
        rows += series(VLLM_PREFIX_QUERIES, [0, 100, 200, 300])
        rows += series(VLLM_PREFIX_HITS, [0, 50, 100, 150])
    for tier in tiers:
        rows += series(kvlens("load_tokens"), [0, 10, 20, 30], tier=tier)
        rows += series(kvlens("hit_tokens"), [0, 10, 20, 30], tier=tier)
        rows += series(kvlens("evictions"), [0, 1, 2, 3], tier=tier)
    rows += series(kvlens("lookup_tokens"), [0, 100, 200, 300])
    rows += series(kvlens("lookup_requests"), [0, 1, 2, 3])
    rows += series(kvlens("hit_requests"), [0, 1, 1, 2])
    return frame(*rows)


def app_charts(f: pd.DataFrame) -> dict[str, dict[str, str]]:
    """The colours of the charts the Overview and Hits tabs draw from ``f``, by chart."""
    return {
        "hit rate": encoded_colours(charts.line(overview.hit_rates(f), charts.RATIO, zero_to_one=True)),
        "token sources": encoded_colours(
            charts.line(overview.token_sources(f), charts.TOKENS_PER_S, stack=True)
        ),
        "token totals": encoded_colours(charts.bars(overview.token_totals(f), charts.TOKENS)),
        "hits by tier": encoded_colours(
            charts.line(views.rate(f, kvlens("hit_tokens"), ("tier",)), charts.TOKENS_PER_S, stack=True)
        ),
        "evictions": encoded_colours(
            charts.line(views.rate(f, kvlens("evictions"), ("tier",)), charts.COUNT)
        ),
    }


def hue(name: str) -> str:
    """The source or tier a series name belongs to."""
    for tier in palette.TIERS:
        if tier in name.replace(",", " ").split():
            return tier
    return name.split(",")[0]


def test_a_source_keeps_its_colour_whichever_other_series_a_chart_holds():
    one = app_charts(token_frame(with_vllm=True, tiers=("cpu",)))
    other = app_charts(token_frame(with_vllm=False, tiers=("disk", "cpu", "remote")))
    seen: dict[str, set[str]] = {}
    for drawn in (one, other):
        for chart_colours in drawn.values():
            for name, colour in chart_colours.items():
                seen.setdefault(hue(name) if hue(name) in SOURCES_AND_TIERS else name, set()).add(colour)
    assert seen["cpu"] == {palette.TIERS["cpu"]}, seen["cpu"]  # "KVLens cpu", "cpu", in 2 sets
    assert seen["disk"] == {palette.TIERS["disk"]} and seen["remote"] == {palette.TIERS["remote"]}
    assert seen["computed"] == {palette.SOURCES["computed"]}
    assert seen["vLLM prefix cache"] == {palette.SOURCES["vLLM prefix cache"]}
    # the same name in both frames, in every chart: the same colour
    for chart in one:
        for name in one[chart].keys() & other[chart].keys():
            assert one[chart][name] == other[chart][name], (chart, name)


def test_computed_keeps_its_colour_with_or_without_the_prefix_cache_beside_it():
    """Without a fixed scale Vega gave colours by order of appearance: "computed" moved."""
    a = charts.line(wide("vLLM prefix cache", "KVLens cpu", "computed"), charts.TOKENS_PER_S)
    b = charts.line(wide("KVLens cpu", "computed"), charts.TOKENS_PER_S)
    assert encoded_colours(a)["computed"] == encoded_colours(b)["computed"] == palette.SOURCES["computed"]


def test_sources_and_tiers_have_distinct_colours_and_series_of_one_chart_differ():
    fixed = [palette.colour(n) for n in SOURCES_AND_TIERS + ("vLLM external hits", palette.PD_RECEIVED)]
    assert len(set(fixed)) == len(fixed)
    for names in (
        ("KVLens, tokens", "KVLens, requests", "vLLM prefix cache, tokens"),
        ("vLLM prefix cache", "KVLens cpu", "KVLens disk", "KVLens remote", palette.PD_RECEIVED, "computed"),
        ("device", "host", "disk", "p2p"),  # vLLM's cached tokens by source
        tuple(f"{op} {t}" for op, t in itertools.product(("store", "load"), palette.TIERS)),
        tuple(f"{k} {t}" for k, t in itertools.product(("evicted", "demoted", "quota"), palette.TIERS)),
        ("p50", "p95", "p99"),
        ("lookup", "load", "store"),
        ("vLLM external hits", "KVLens held at lookup", "KVLens loaded", palette.PD_RECEIVED),
        tuple(palette.MISS_REASONS),  # one chart: misses by reason
        (
            "consumer_role",
            "force_skip_save",
            "skip_save",
            "priority_limit",
            "unsupported_input",
            "invalid_params",
        ),
        tuple(f"failed blocks {r}" for r in (*palette.FAILURE_REASONS, "tier_unhealthy")),
        palette.LEAK_GAUGES,
    ):
        colours = [palette.colour(n) for n in names]
        assert len(set(colours)) == len(colours), dict(zip(names, colours, strict=True))


def test_every_chart_kind_fixes_its_colour_scale():
    events = pd.DataFrame(
        {
            "time": pd.to_datetime([0, 1], unit="s", utc=True),
            "tier": ["disk", "cpu"],
            "reason_kind": ["corrupt", "missing"],
            "num_blocks": [4, 2],
            "request_id": ["a", "b"],
            "reason": ["corrupt: x", "missing: y"],
            "tokens_affected": [512, 256],
            "log": ["l", "l"],
        }
    )
    curves = pd.DataFrame(
        {
            "factor": [0.5, 1.0, 0.5, 1.0],
            "ratio": [0.2, 0.4, 0.1, 0.3],
            "series": ["cpu", "cpu", "disk", "disk"],
        }
    )
    table = pd.DataFrame(
        {"used_bytes": [1.0, 2.0], "capacity_bytes": [2.0, 4.0], "fill": [0.5, 0.5]},
        index=pd.Index(["cpu", "disk"], name="tier"),
    )
    assert encoded_colours(charts.event_timeline(events)) == {
        "corrupt": palette.colour("corrupt"),
        "missing": palette.colour("missing"),
    }
    assert encoded_colours(charts.whatif(curves)) == {
        "cpu": palette.TIERS["cpu"],
        "disk": palette.TIERS["disk"],
    }
    assert encoded_colours(charts.tier_fill(table).layer[1]) == {
        "cpu": palette.TIERS["cpu"],
        "disk": palette.TIERS["disk"],
    }


@pytest.mark.parametrize(
    ("name", "same_as"),
    [
        ("KVLens cpu", "cpu"),
        ("store disk", "disk"),
        ("saved, remote", "remote"),
        ("device", "vLLM prefix cache"),  # vLLM's own name for its prefix cache
        ("host", "cpu"),  # and for KVLens's CPU tier
        ("KVLens held at lookup", "held at lookup"),
        ("KVLens lookup", "lookup"),
        ("p2p", palette.PD_RECEIVED),  # vLLM's name for what a PD decoder received
    ],
)
def test_names_of_one_thing_share_its_colour(name, same_as):
    assert palette.colour(name) == palette.colour(same_as)


def test_grafana_gives_every_source_and_tier_the_apps_colour():
    from grafana.build import build_dashboard

    fixed: dict[str, set[str]] = {}
    for p in build_dashboard()["panels"]:
        for override in p.get("fieldConfig", {}).get("overrides", []):
            if override["matcher"]["id"] != "byName":
                continue
            for prop in override["properties"]:
                if prop["id"] == "color":
                    assert prop["value"]["mode"] == "fixed"
                    fixed.setdefault(override["matcher"]["options"], set()).add(prop["value"]["fixedColor"])
    for name in (
        "vLLM prefix cache",
        "computed",
        "KVLens cpu",
        "KVLens disk",
        "cpu",
        "disk",
        "remote",
        palette.PD_RECEIVED,  # where prompt tokens came from
        "p2p",  # vLLM's cached prompt tokens by source
    ):
        assert fixed.get(name) == {palette.colour(name)}, (name, fixed.get(name))
    for name, colours in fixed.items():
        assert colours == {palette.colour(name)}, json.dumps([name, sorted(colours)])


def _lab(hex_colour: str) -> tuple[float, float, float]:
    """CIE L*a*b* of an sRGB colour (D65)."""
    rgb = [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92 for c in rgb)
    xyz = (
        (r * 0.4124 + g * 0.3576 + b * 0.1805) / 0.95047,
        r * 0.2126 + g * 0.7152 + b * 0.0722,
        (r * 0.0193 + g * 0.1192 + b * 0.9505) / 1.08883,
    )
    f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in xyz]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def test_what_a_decoder_received_has_a_colour_of_its_own():
    """Its own hue, far (CIE76 distance over 30) from every tier's, every other source's
    (vLLM's among them), every PD phase's and every colour other series may take."""
    received = palette.colour(palette.PD_RECEIVED)
    assert palette.colour("p2p") == received
    others = {
        **palette.TIERS,
        **{k: v for k, v in palette.SOURCES.items() if k != palette.PD_RECEIVED},
        **palette.SPLIT,
        **palette.QUANTILES,
        **{f"other {i}": c for i, c in enumerate(palette.OTHERS)},
    }
    near = {name: math.dist(_lab(received), _lab(c)) for name, c in others.items()}
    assert min(near.values()) > 30, sorted(near.items(), key=lambda kv: kv[1])[:3]
