"""The PD row (prefill/decode disaggregation), the same views as the app's PD tab: time to first
token split into prefill, transfer wait and decode first token (``kvlens pd-proxy``'s phase
histogram, scraped by the ``kvlens-pd-proxy`` job) per prefiller → decoder pair and over time;
the engines' bytes/s sent and received, receive buffer used of capacity and its entries (a leak
gauge), transfers in flight, refusals and timeouts by reason. Proxy series are not ``vllm:``
series: the model and instance variables do not filter them."""

from __future__ import annotations

from dashboard import palette

from .panel_types import TABLE, Panel, Target, rate_sum, ratio

ROW = "PD"

PHASE = "kvlens_pd_proxy_phase_seconds"
_PHASES = tuple(palette.PHASE_LABELS)  # the proxy's label values, in order
_NOT_TTFT = 'phase!="ttft"'


def _mean_over_range(phase: str) -> str:
    """Per pair, the mean seconds of one phase over the dashboard's time range."""
    sel = f'{{phase="{phase}"}}'
    by = "sum by (prefiller, decoder)"
    return ratio(
        f"{by} (increase({PHASE}_sum{sel}[$__range]))", f"{by} (increase({PHASE}_count{sel}[$__range]))"
    )


def _phase_column(phase: str) -> tuple[str, dict]:
    """A table column in the phase's palette colour."""
    name = palette.PHASE_LABELS[phase]
    return (
        f"^{name}$",
        {
            "color": {"mode": "fixed", "fixedColor": palette.PHASES[name]},
            "custom.cellOptions": {"type": "color-background"},
        },
    )


_ABOUT = (
    " prefill: the prefiller computing the prompt; transfer wait: from its answer until every "
    "prefiller rank's notification reached the proxy (the KV is in the decoder's buffer); decode first "
    "token: the decoder's first streamed token. From kvlens pd-proxy's /metrics (job kvlens-pd-proxy)."
)

PD_PANELS: tuple[Panel, ...] = (
    Panel(
        ROW,
        "PD time to first token, split per pair",
        "s",
        tuple(Target(_mean_over_range(p)) for p in _PHASES),
        "Per prefiller → decoder pair, the mean seconds of each phase of a PD request's time to "
        "first token over the time range." + _ABOUT,
        kind=TABLE,
        width=12,
        transformations=(
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True},
                    "renameByName": {
                        f"Value #{chr(ord('A') + i)}": palette.PHASE_LABELS[p] for i, p in enumerate(_PHASES)
                    },
                },
            },
        ),
        overrides=tuple(_phase_column(p) for p in _PHASES),
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD time to first token, split over time",
        "s",
        (
            Target(
                ratio(
                    rate_sum(f"{PHASE}_sum", by="phase", matchers=_NOT_TTFT),
                    rate_sum(f"{PHASE}_count", by="phase", matchers=_NOT_TTFT),
                ),
                "{{phase}}",
            ),
        ),
        "The mean seconds of each phase, all pairs together, stacked: their sum is the mean time to "
        "first token." + _ABOUT,
        width=12,
        stack=True,
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD bytes sent and received",
        "Bps",
        (
            Target(rate_sum("vllm:kvlens_pd_sent_bytes_total", by="instance"), "sent {{instance}}"),
            Target(rate_sum("vllm:kvlens_pd_received_bytes_total", by="instance"), "received {{instance}}"),
        ),
        "Bytes of KV per second each prefiller sent and each decoder received (all ranks).",
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD receive buffer: used and capacity",
        "bytes",
        (
            Target("sum by (instance) (vllm:kvlens_pd_buffer_used_bytes)", "used {{instance}}"),
            Target("sum by (instance) (vllm:kvlens_pd_buffer_capacity_bytes)", "capacity {{instance}}"),
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
        (Target("sum by (instance) (vllm:kvlens_pd_buffer_entries)", "{{instance}}"),),
        "Transfers held in each decoder's buffer. A leak gauge: back to 0 once nothing is in flight "
        "(an entry nobody claims is freed after pd_unclaimed_timeout_sec, counted as expired).",
        needs_pd=True,
    ),
    Panel(
        ROW,
        "PD transfers in flight",
        "short",
        (
            Target("sum by (side) (vllm:kvlens_pd_transfers_in_flight)", "{{side}}"),
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
