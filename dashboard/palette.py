"""One colour per source and per tier, the same in every chart of the app and every panel of the
Grafana bundle (``grafana.build`` reads this module). Pure: no Streamlit, no Altair.

A series is coloured by its name alone, never by which other series a chart holds:

- a source of prompt tokens (``vLLM prefix cache``, ``computed``, KVLens as a whole, what a PD
  decoder received from a prefiller) or a tier
  (``cpu``, ``disk``, ``remote``) has its own hue; a series that names a tier takes the tier's
  hue, whatever else it says (``KVLens cpu``, ``store cpu``, ``evicted disk``, ``cpu 2``);
- several series of one source or tier in one chart (``KVLens, tokens`` and ``KVLens,
  requests``; ``store cpu`` and ``load cpu``) are shades of its hue, by a fixed table of words;
- quantiles, operations, miss reasons and leak gauges take fixed colours from the rest of the
  palette; any other name (an instance, a tenant) a colour chosen by a stable hash of the name.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from .catalog import LEAK_GAUGES, MISS_REASONS, PD_REASONS

KVLENS = "KVLens"
VLLM_PREFIX_CACHE = "vLLM prefix cache"
COMPUTED = "computed"
# On a PD decoder: prompt tokens whose KV a prefiller computed and sent, loaded from the
# decoder's receive buffer (vllm:kvlens_pd_loaded_tokens_total; vLLM's source "p2p").
PD_RECEIVED = "received from a prefiller (PD)"

TIERS: dict[str, str] = {
    "cpu": "#4C78A8",  # blue
    "disk": "#F58518",  # orange
    "remote": "#B279A2",  # purple
}

SOURCES: dict[str, str] = {
    KVLENS: "#1D3F6E",  # KVLens as a whole: a navy, darker than its cpu tier's blue
    VLLM_PREFIX_CACHE: "#54A24B",  # green
    COMPUTED: "#8C8C8C",  # grey: prefill that nothing saved
    "vLLM external hits": "#72B7B2",  # teal: vLLM's count of what it asked KVLens for
    "failed": "#E45756",  # red: loads that failed, tokens recomputed after one
    PD_RECEIVED: "#A0C814",  # lime: no tier's, vLLM's or phase's hue, nor one of OTHERS
}

# The parts of a PD request's time to first token (the proxy's phases, and what the proxy spent
# between them), each its own colour in every chart and panel that shows them: hues no source,
# tier or quantile has.
PREFILL, TRANSFER_WAIT, DECODE_FIRST_TOKEN = "prefill", "transfer wait", "decode first token"
PROXY = "proxy (tokenize, relay)"
TTFT = "time to first token"
PHASES: dict[str, str] = {
    PREFILL: "#6A3D9A",  # dark violet: the prefiller computing the prompt
    TRANSFER_WAIT: "#E7298A",  # deep pink: waiting for the prefiller's notifications
    DECODE_FIRST_TOKEN: "#1B9E77",  # dark green-teal: the decoder's first token
}
SPLIT: dict[str, str] = {
    **PHASES,
    PROXY: "#C9B37E",  # khaki: the rest of the time to first token (tokenize, the proxy's relay)
}
# The proxy's label values of its phases (kvlens_pd_proxy_phase_seconds{phase}) -> their names.
PHASE_LABELS: dict[str, str] = {
    "prefill": PREFILL,
    "transfer_wait": TRANSFER_WAIT,
    "decode_first_token": DECODE_FIRST_TOKEN,
}

# Names vLLM gives the same sources (vllm:prompt_tokens_cached_by_source_total{source}).
ALIASES: dict[str, str] = {"device": VLLM_PREFIX_CACHE, "host": "cpu", "p2p": PD_RECEIVED}

# Shades of one hue for several series of one source or tier: 0 the hue itself, 1 lighter,
# 2 darker, 3 lightest. A word not listed gets a shade by hash.
SHADE_OF_WORD: dict[str, int] = {
    "": 0,
    "tokens": 0,
    "requests": 1,
    "store": 0,
    "stored": 0,
    "load": 1,
    "loaded": 0,
    "used": 0,
    "capacity": 1,
    "evicted": 0,
    "demoted": 1,
    "quota": 2,
    "saved": 0,
    "held at lookup": 1,
    "looked up": 3,
    "0": 0,
    "1": 1,
    "2": 2,
    "3": 3,
}

# The colours left once sources and tiers have theirs (no blue, orange, green, purple or grey).
OTHERS: tuple[str, ...] = (
    "#499894",  # teal
    "#EECA3B",  # yellow
    "#D37295",  # magenta
    "#9D755D",  # brown
    "#B6992D",  # olive
    "#86BCB6",  # light teal
    "#79706E",  # warm grey
    "#FABFD2",  # light pink
    "#D7B5A6",  # tan
    "#FF9D9A",  # salmon
    "#E45756",  # red
    "#17BECF",  # cyan
    "#843C39",  # maroon
    "#7B4173",  # plum
)

QUANTILES = {"p50": "#499894", "p90": "#EECA3B", "p95": "#EECA3B", "p99": "#E45756"}
OPERATIONS = ("lookup", "load", "store", "exists", "get", "put", "delete")
# Fixed colours for names from a known, closed set: the n-th name of a set gets the n-th of OTHERS.
# Reasons: why a request missed (the catalog's), why a store was skipped, why a block failed to
# load (the names KVLens exports, connector/engine/outcomes.py). The skip and failure names
# follow the miss reasons, so that the names one chart shows never share a colour.
SKIP_REASONS = ("consumer_role", "force_skip_save", "skip_save", "priority_limit")
FAILURE_REASONS = (
    "missing",
    "corrupt",
    "io_error",
    "timeout",
    "queue_full",
    "dependency_failed",
    "prefix_failed",
    "not_loadable",
)
REASONS = (*MISS_REASONS, *SKIP_REASONS, *FAILURE_REASONS, *PD_REASONS)
VOCABULARIES: tuple[tuple[str, ...], ...] = (OPERATIONS, LEAK_GAUGES)


def _distinct_within(groups: Iterable[Iterable[str]]) -> dict[str, str]:
    """A colour per name, each the first of OTHERS that no name of its group has yet."""
    colours: dict[str, str] = {}
    for group in groups:
        names = list(group)
        used = {colours[n] for n in names if n in colours}
        free = [c for c in OTHERS if c not in used]
        for n in names:
            if n not in colours:
                colours[n] = free.pop(0)
    return colours


# The reasons one chart shows side by side: misses; skipped stores (two share miss reasons'
# names); failed loads (and tier_unhealthy, a miss reason too).
REASON_COLOURS = _distinct_within(
    (
        MISS_REASONS,
        (*SKIP_REASONS, "unsupported_input", "invalid_params"),
        (*FAILURE_REASONS, "tier_unhealthy"),
        PD_REASONS,  # refused or failed PD transfers
    )
)

_FIXED: dict[str, str] = {}


def _mix(hex_colour: str, towards: int, share: float) -> str:
    rgb = [int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]
    mixed = [round(c + (towards - c) * share) for c in rgb]
    return "#" + "".join(f"{c:02X}" for c in mixed)


def shade(hex_colour: str, index: int) -> str:
    """The ``index``-th shade (0-3) of a hue."""
    return (
        hex_colour,
        _mix(hex_colour, 255, 0.45),
        _mix(hex_colour, 0, 0.35),
        _mix(hex_colour, 255, 0.7),
    )[index % 4]


def _stable(name: str) -> int:
    return zlib.crc32(name.encode())


def _shade_index(words: str) -> int:
    words = words.strip(" ,")
    return SHADE_OF_WORD[words] if words in SHADE_OF_WORD else _stable(words) % 4


def _from_vocabularies(name: str) -> str | None:
    if name in REASON_COLOURS:
        return REASON_COLOURS[name]
    for vocabulary in VOCABULARIES:
        if name in vocabulary:
            return OTHERS[vocabulary.index(name) % len(OTHERS)]
    return None


def colour(series: str) -> str:
    """The colour of the series named ``series``: the same in every chart, whatever else it holds."""
    name = " ".join(series.split())
    name = ALIASES.get(name, name)
    if name in _FIXED:
        return _FIXED[name]
    if name in SOURCES:
        return SOURCES[name]
    words = name.replace(",", " ").split()
    tier = next((w for w in words if w in TIERS), None)
    if tier is not None:
        rest = " ".join(w for w in words if w not in (tier, KVLENS))
        return shade(TIERS[tier], _shade_index(rest))
    for source, hue in SOURCES.items():
        if name.startswith(source + ",") or name.startswith(source + " "):
            rest = name[len(source) :]
            # "KVLens lookup", "failed blocks corrupt": the operation's, the reason's colour
            last = rest.split()[-1] if rest.split() else ""
            found = _from_vocabularies(rest.strip(" ,")) or (
                _from_vocabularies(last) if last in REASONS else None
            )
            return found if found is not None else shade(hue, _shade_index(rest))
    found = _from_vocabularies(name)
    return found if found is not None else OTHERS[_stable(name) % len(OTHERS)]


_FIXED.update(
    {
        **QUANTILES,
        **SPLIT,
        TTFT: "#2F2F2F",  # near black: the whole of which the split's parts are parts
        "ttft": "#2F2F2F",  # the proxy's label value for it
        **{label: PHASES[name] for label, name in PHASE_LABELS.items()},
        "looked up": shade(SOURCES[KVLENS], 3),
        "held at lookup": shade(SOURCES[KVLENS], 1),
        "loaded": SOURCES[KVLENS],
        "recomputed after a failed load": SOURCES["failed"],
        "tokens recomputed": SOURCES["failed"],
        "requests with a failed load": SOURCES["failed"],
    }
)


def scale(series: Iterable[str]) -> tuple[list[str], list[str]]:
    """The domain (each name once, in first-seen order) and the colours to give a chart's colour
    scale, so that each name gets ``colour(name)`` however many others the chart has."""
    domain = list(dict.fromkeys(str(s) for s in series))
    return domain, [colour(s) for s in domain]
