"""The PD row (prefill/decode disaggregation), the same views as the app's PD tab: time to first
token split into prefill, transfer wait, decode first token and the proxy's own time, over one set
of requests (``kvlens pd-proxy``'s phase histogram, scraped by the ``kvlens-pd-proxy`` job) per
prefiller → decoder pair, and each phase over time; each prefiller's bytes/s sent and each
decoder's received, its receive buffer used of capacity and its entries (a leak gauge),
transfers in flight, refusals and timeouts by reason. Engines are told apart by
``vllm:kvlens_info{pd_role}`` (every engine exports both sides' series, at 0). Proxy series are
not ``vllm:`` series: the model and instance variables do not filter them."""

from __future__ import annotations

import re

from dashboard import palette

from .panel_types import TABLE, Panel, Target, rate_sum, ratio

ROW = "PD"

PHASE = "kvlens_pd_proxy_phase_seconds"
_PHASES = tuple(palette.PHASE_LABELS)  # the proxy's label values, in order
_PAIR = "prefiller, decoder"


def _count(phase: str) -> str:
    return f'sum by ({_PAIR}) ({PHASE}_count{{phase="{phase}"}})'


def _mean(phase: str) -> str:
    """Per pair, the mean seconds of one phase since the proxy started."""
    return ratio(f'sum by ({_PAIR}) ({PHASE}_sum{{phase="{phase}"}})', _count(phase))


# Pairs whose every phase was timed for the same requests (as many prefills, transfer waits and
# first tokens as times to first token: every request streamed, none ended early). Elsewhere the
# means are over different requests and would not add up.
_ONE_POPULATION = f"\nand on ({_PAIR})\n".join(f"({_count(p)} == {_count('ttft')})" for p in _PHASES)


def _split_part(expr: str) -> str:
    return f"({expr})\nand on ({_PAIR})\n({_ONE_POPULATION})"


# The split's parts, in order (each a column in its colour), the proxy's own time between the phases
# (the rest of the time to first token), the time to first token and the requests.
SPLIT_TARGETS: tuple[tuple[str, str], ...] = (
    *((palette.PHASE_LABELS[p], _split_part(_mean(p))) for p in _PHASES),
    (
        palette.PROXY,
        _split_part(f"{_mean('ttft')}\n- " + "\n- ".join(f"({_mean(p)})" for p in _PHASES)),
    ),
    (palette.TTFT, _split_part(_mean("ttft"))),
    ("requests", _split_part(_count("ttft"))),
)


def _column(name: str) -> tuple[str, dict]:
    """A table column in the part's palette colour."""
    return (
        f"^{re.escape(name)}$",
        {
            "color": {"mode": "fixed", "fixedColor": palette.SPLIT[name]},
            "custom.cellOptions": {"type": "color-background"},
        },
    )


def _side(expr: str, role: str) -> str:
    """The engines of one PD role only (every engine exports both sides' series, at 0)."""
    return f'{expr}\nand on (instance)\nvllm:kvlens_info{{pd_role="{role}"}}'


_ABOUT = (
    " prefill: the prefiller computing the prompt; transfer wait: from its answer until every "
    "prefiller rank's notification reached the proxy (the KV is in the decoder's buffer); decode first "
    "token: the decoder's first streamed token; proxy (tokenize, relay): the proxy's own time between "
    "them. From kvlens pd-proxy's /metrics (job kvlens-pd-proxy)."
)

PD_PANELS: tuple[Panel, ...] = (
    Panel(
        ROW,
        "PD time to first token, split per pair",
        "s",
        tuple(Target(expr) for _, expr in SPLIT_TARGETS),
        "Per prefiller → decoder pair, since the proxy started, where a request's time to first token "
        "goes: each part a mean over the same requests, adding up to the time to first token beside "
        "them. Only pairs whose requests were all streamed and reached their first token: the proxy "
        "times decode first token and time to first token for streamed requests only, so elsewhere "
        "the phases' means are over different requests (the app splits those pairs' streamed "
        "requests from the proxy's records)." + _ABOUT,
        kind=TABLE,
        width=12,
        transformations=(
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True},
                    "renameByName": {
                        f"Value #{chr(ord('A') + i)}": name for i, (name, _) in enumerate(SPLIT_TARGETS)
                    },
                },
            },
        ),
        overrides=tuple(_column(name) for name in palette.SPLIT),
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD time to first token, phases over time",
        "s",
        (
            Target(
                ratio(rate_sum(f"{PHASE}_sum", by="phase"), rate_sum(f"{PHASE}_count", by="phase")),
                "{{phase}}",
            ),
        ),
        "The mean seconds of each phase over the requests that reached it, all pairs together: prefill "
        "and transfer wait over every request, decode first token and ttft (the time to first token) "
        "over streamed requests only. Lines, not a stack: their requests differ." + _ABOUT,
        width=12,
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD bytes sent and received",
        "Bps",
        (
            Target(
                _side(rate_sum("vllm:kvlens_pd_sent_bytes_total", by="instance"), "sender"),
                "prefiller {{instance}} sent",
            ),
            Target(
                _side(rate_sum("vllm:kvlens_pd_received_bytes_total", by="instance"), "receiver"),
                "decoder {{instance}} received",
            ),
        ),
        "Bytes of KV per second each prefiller sent and each decoder received (all ranks).",
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD receive buffer: used and capacity",
        "bytes",
        (
            Target(
                _side("sum by (instance) (vllm:kvlens_pd_buffer_used_bytes)", "receiver"),
                "decoder {{instance}} used",
            ),
            Target(
                _side("sum by (instance) (vllm:kvlens_pd_buffer_capacity_bytes)", "receiver"),
                "decoder {{instance}} capacity",
            ),
        ),
        "Each decoder's PD receive buffer (pd_buffer_size per rank, all ranks): bytes held by "
        "transfers received and not yet loaded or expired. A full buffer refuses transfers at once "
        "(buffer_full) and the decoder recomputes.",
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD buffer entries",
        "short",
        (
            Target(
                _side("sum by (instance) (vllm:kvlens_pd_buffer_entries)", "receiver"), "decoder {{instance}}"
            ),
        ),
        "Transfers held in each decoder's buffer. A leak gauge: back to 0 once nothing is in flight "
        "(an entry nobody claims is freed after pd_unclaimed_timeout_sec, counted as expired).",
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD transfers in flight",
        "short",
        (
            Target('sum (vllm:kvlens_pd_transfers_in_flight{side="send"})', "sending (prefillers)"),
            Target('sum (vllm:kvlens_pd_transfers_in_flight{side="receive"})', "receiving (decoders)"),
            Target("sum (kvlens_pd_proxy_in_flight)", "proxy requests"),
        ),
        "Transfers under way: send (prefillers), receive (decoders); and the requests the proxy has "
        "in flight.",
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD transfers refused or timed out, by reason",
        "cps",
        (
            Target(
                rate_sum("vllm:kvlens_pd_failed_transfers_total", by="side, reason"), "{{side}} {{reason}}"
            ),
            Target(
                rate_sum("kvlens_pd_proxy_wait_timeouts_total", by="prefiller, decoder"),
                "proxy wait timeout {{prefiller}} → {{decoder}}",
            ),
        ),
        "Transfers refused or ended early per second, by side and reason (buffer_full, too_large, "
        "mismatch:<fields>, unreachable, timeout, peer_closed, checksum, shutdown, expired); and the "
        "proxy's waits for notifications that ran past its bound (the decoder then recomputes).",
        width=16,
        needs_pd=True,
    ),
)
