"""KVLens dashboard: what the KV cache saves, where it misses, how fast it is, what leaks, what
failed, and why one request missed. Lays out what ``dashboard.sources/views/charts/failures/
request_records`` compute.

    streamlit run dashboard/app.py                                   # the demo server, 127.0.0.1:8000
    streamlit run dashboard/app.py -- --metrics HOST:PORT [--metrics HOST2:PORT] [--events LOG]
                                      [--requests REQUEST_LOG] [--allow-source-edits]
    streamlit run dashboard/app.py -- --prometheus http://127.0.0.1:9090
    streamlit run dashboard/app.py -- --metrics P:8100 --metrics D:8200 --pd-proxy PROXY:9000

Run from the repository root: its ``.streamlit/config.toml`` binds the app to 127.0.0.1.
What the app reads is fixed when it starts; flags and environment variables: see
``dashboard/settings.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

# `streamlit run` puts dashboard/ on sys.path; the repository root makes `dashboard` and
# `telemetry` importable without installing anything.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import streamlit as st  # noqa: E402
from streamlit import config as st_config  # noqa: E402

from dashboard import (  # noqa: E402
    blend_page,
    charts,
    failures,
    insights_page,
    logfiles,
    overview,
    pd_page,
    request_records,
    settings,
    sidebar,
    sources,
    tenants_page,
    text,
    views,
)
from dashboard.catalog import MISS_REASONS  # noqa: E402
from dashboard.layout import NO_TRAFFIC, chart, table  # noqa: E402
from dashboard.urls import NotHttpURL  # noqa: E402

ALL = "All instances (sum)"
ROWS = (
    "Overview",
    "Hits and misses",
    "Latency and throughput",
    "Tiers and leaks",
    "Failures",
    "Requests",
    "Insights",
    "Tenants",
    "PD",
    "Blending",
)


logger = logging.getLogger("kvlens.dashboard")


def _served() -> bool:
    """True when this file is what ``streamlit run`` runs (not a test's AppTest)."""
    return Path(sys.argv[0]).resolve() == Path(__file__).resolve() if sys.argv else False


def _argv() -> list[str]:
    """The flags after ``--`` when this file is what ``streamlit run`` runs."""
    return sys.argv[1:] if _served() else []


@contextlib.contextmanager
def guarded(what: str):
    """A failure in one part of the page is one line of text naming the error's class (its
    message may quote what a source sent); the details go to the server's log."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        logger.exception("%s could not be shown", what)
        st.error(f"{what} could not be shown: {type(e).__name__}")


@st.cache_resource(show_spinner=False)
def history(url: str, max_points: int) -> sources.MetricsHistory:
    return sources.MetricsHistory(url, max_points=max_points)


@st.cache_data(show_spinner=False, max_entries=4)
def request_log(paths: tuple[str, ...], stamp: tuple) -> tuple[pd.DataFrame, list[logfiles.LogStatus]]:
    """Read again only when a log grew or rotated (``stamp`` is part of the cache key)."""
    return request_records.load_requests(paths)


@st.cache_resource(show_spinner=False)
def prometheus(url: str) -> sources.PrometheusSource:
    return sources.PrometheusSource(url)


def load(cfg: settings.Settings) -> tuple[pd.DataFrame, list[sources.Status], float]:
    """The sample frame, each source's status, and the rate window in seconds."""
    if cfg.source == settings.PROMETHEUS:
        if not cfg.prometheus:
            return sources.empty_frame(), [sources.Status("(none)", sources.QUERY_FAILED, "no URL")], 30.0
        src = prometheus(cfg.prometheus)
        frame = src.frame(cfg.minutes)
        return frame, [src.status], max(30.0, 4 * sources.range_step(cfg.minutes))
    now = time.time()
    points = int(cfg.minutes * 60 / cfg.refresh_s) + 1
    held = [history(sources.metrics_url(e), points) for e in cfg.endpoints]
    statuses = [h.scrape(now) for h in held]
    return sources.combine(h.frame() for h in held), statuses, max(30.0, 3 * cfg.refresh_s)


WAITING = "Waiting for a second reading to compute rates."


def overview_view(frame: pd.DataFrame, fleet: pd.DataFrame, window: float) -> None:
    s = overview.savings(frame)
    with_pd = overview.received(fleet)
    a, b, c, d = st.columns(4)
    a.metric(
        "Prompt tokens KVLens held",
        text.percent(s.hit_rate),
        help=text.HELD_HELP + (" " + text.PD_SOURCE if with_pd else ""),
    )
    b.metric(
        "Prompt tokens loaded by KVLens",
        text.number(s.supplied_tokens),
        delta=f"+{text.number(s.supplied_tokens_window)} in range",
        delta_color="off",
        help=text.loaded_help(s.loaded_tokens, s.pd_loaded_tokens) if with_pd else None,
    )
    c.metric(
        "Prefill time saved (estimated)",
        text.seconds(s.seconds_saved),
        help="The connector's estimate (vllm:kvlens_prefill_seconds_saved_total) when it exports one; "
        "else tokens KVLens loaded from its tiers times the engine's measured prefill seconds per token "
        "(vllm:kvlens_prefill_seconds_per_token). Unknown until the engine has measured a prefill. "
        "An estimate: per-token prefill cost grows with context length. Tokens received from a "
        "prefiller (PD) are not counted: their prefill ran on the prefiller.",
    )
    d.metric("Requests with failed loads", text.number(s.failed_loads), help="Since the servers started.")
    left, right = st.columns(2)
    with left:
        st.subheader("Hit rate")
        chart(overview.hit_rates(frame, window), charts.RATIO, NO_TRAFFIC, zero_to_one=True)
    with right:
        st.subheader("Where prompt tokens came from")
        chart(overview.token_sources(frame, window), charts.TOKENS_PER_S, NO_TRAFFIC, stack=True)
    left, right = st.columns(2)
    with left:
        st.subheader("Prompt tokens since start, by source")
        totals = overview.token_totals(frame)
        if totals.sum() > 0:
            st.altair_chart(charts.bars(totals, charts.TOKENS), width="stretch")
        else:
            st.info("No prompt tokens yet.")
    with right:
        st.subheader("Per instance")
        percent = st.column_config.NumberColumn(format="percent")
        table(overview.instance_table(fleet), width="stretch", column_config={"KVLens hit rate": percent})
    st.caption(text.overview_caption(window, with_pd))


def hits_and_misses(frame: pd.DataFrame, window: float) -> None:
    left, right = st.columns(2)
    with left:
        st.subheader("Misses by reason")
        chart(views.misses_by_reason(frame, window), charts.REQUESTS_PER_S, "No misses in range.", stack=True)
    with right:
        st.subheader("Stores skipped by reason")
        chart(views.save_skips_by_reason(frame, window), charts.REQUESTS_PER_S, "No skipped stores in range.")
    left, right = st.columns(2)
    with left:
        st.subheader("KVLens hits by tier")
        hits = views.rate(frame, views.kvlens("hit_tokens"), ("tier",), window)
        chart(hits, charts.TOKENS_PER_S, NO_TRAFFIC, stack=True)
    with right:
        st.subheader("Misses since start")
        misses = views.total(frame, views.kvlens("miss_requests"), ("reason",))
        if misses.empty:
            st.info("No misses yet.")
        else:
            st.altair_chart(charts.bars(misses, charts.COUNT, "reason"), width="stretch")
    with st.expander("What each miss reason means"):
        st.markdown("\n".join(f"- **{r}**: {why}" for r, why in MISS_REASONS.items()))


def latency_and_throughput(frame: pd.DataFrame, window: float) -> None:
    cols = st.columns(3)
    for col, op in zip(cols, ("lookup", "load", "store"), strict=True):
        with col:
            st.subheader(f"{op.capitalize()} latency")
            chart(views.latency(frame, op, window), charts.MS, f"No {op}s in range.")
    left, right = st.columns(2)
    with left:
        st.subheader("Throughput by tier")
        speed = views.throughput_by_tier(frame, window)
        chart(speed, charts.bytes_unit(speed, per_s=True), "No loads or stores in range.")
        st.caption(
            "Bytes per second spent moving them, timed where they move: a store is the gather out of "
            "vLLM's KV cache plus the write to disk or remote; a load the read from disk or remote "
            "plus the copy into the KV cache. One rank's speed."
        )
    with right:
        st.subheader("Operations")
        chart(views.operations(frame, window), charts.OPS_PER_S, NO_TRAFFIC)
    if views.has_series(frame, views.kvlens("remote_seconds", "_count")):
        st.subheader("Remote tier (Redis) round trips")
        cols = st.columns(3)
        for col, op in zip(cols, ("exists", "get", "put"), strict=True):
            with col:
                st.caption(f"{op} ({'lookup' if op == 'exists' else 'load' if op == 'get' else 'store'})")
                chart(views.remote_round_trips(frame, op, window), charts.MS, f"No remote {op} in range.")
        chart(views.remote_errors(frame, window), charts.OPS_PER_S, "No remote errors in range.")
    st.subheader("Background write queue")
    queue = views.gauge(frame, views.kvlens("pending_writes"), ("instance",))
    chart(queue, charts.COUNT, "No background writer reported.")
    st.caption(
        "Chunk writes and deletes queued for the disk and remote tiers' background writers (the "
        "busiest rank, as last reported). Each tier holds at most extra_config.max_pending_write_bytes "
        "of queued writes (default 512 MiB); a store that does not fit is dropped and counted as "
        "failed (queue_full). An idle engine keeps stepping until this is 0."
    )


def tiers_and_leaks(frame: pd.DataFrame, fleet: pd.DataFrame, window: float, idle_for_s: float) -> None:
    flags = views.leak_flags(fleet, idle_for_s)
    for f in flags:
        st.error(
            f"Possible leak on {f.instance}: {f.gauge} = {f.value:g} while the engine has been idle "
            f"for {f.idle_s:.0f} s (nothing running or waiting)."
        )
    if not flags:
        st.success(f"No leak: every leak gauge returns to 0 once an engine is idle for {idle_for_s:.0f} s.")
    tiers = views.tier_table(frame)
    left, right = st.columns(2)
    with left:
        st.subheader("Tiers: used of capacity")
        if tiers.empty:
            st.info("No tier reported yet.")
        else:
            st.altair_chart(charts.tier_fill(tiers), width="stretch")
            fill = st.column_config.NumberColumn(format="percent")
            table(tiers, width="stretch", column_config={"fill": fill})
    with right:
        st.subheader("Evictions")
        evictions = views.rate(frame, views.kvlens("evictions"), ("tier",), window)
        chart(evictions, charts.Unit("chunks/s", ",.3~f"), "No evictions reported.")
    left, right = st.columns(2)
    with left:
        st.subheader("Leak gauges")
        chart(views.leak_gauges(frame), charts.COUNT, "No leak gauges reported.")
    with right:
        st.subheader("Pinned bytes")
        pinned = views.gauge(frame, views.kvlens("pinned_bytes"), ("tier",))
        chart(pinned, charts.bytes_unit(pinned), "No pinned bytes reported.")
    left, right = st.columns(2)
    with left:
        st.subheader("Retained bytes")
        retained = views.gauge(frame, views.kvlens("retention_bytes"), ("tier", "retention"))
        chart(retained, charts.bytes_unit(retained), "No retained chunks reported.")
        st.caption(
            "Bytes per tier and retention class: 0 normal, 1-3 the priority requests asked for "
            "(kvlens.retention_priority, kvlens.retain_for_s); retained chunks are evicted last, "
            "within max_retained_share."
        )
    with right:
        st.subheader("Retained chunks evicted or demoted")
        taken = views.join(
            views.rate(frame, views.kvlens("retained_evictions"), ("tier",), window, prefix="evicted "),
            views.rate(frame, views.kvlens("retention_demotions"), ("tier",), window, prefix="demoted "),
            views.rate(frame, views.kvlens("quota_evictions"), ("tier",), window, prefix="quota "),
        )
        chart(taken, charts.Unit("chunks/s", ",.3~f"), "No retained chunk was evicted.")
        st.caption(
            "evicted: nothing unretained was left to evict; demoted: beyond max_retained_share; "
            "quota: a tenant at its tenant_quota_bytes replaced its own chunks."
        )
    left, right = st.columns(2)
    with left:
        st.subheader("Tier health")
        health = views.gauge(frame, views.kvlens("tier_health"), ("tier",))
        chart(health, charts.COUNT, "No tier health reported.")
        st.caption("2 healthy, 1 failing (errors seen, still used), 0 skipped (probed with backoff).")
    with right:
        st.subheader("Suspect blocks")
        suspects = views.gauge(frame, views.kvlens("suspect_blocks"), ("instance",))
        chart(suspects, charts.COUNT, "No suspect blocks reported.")
        st.caption(
            "vLLM blocks whose load failed and that no step has rewritten yet: nothing is stored over them."
        )


def failures_view(frame: pd.DataFrame, window: float, logs: tuple[str, ...]) -> None:
    st.subheader("Failed blocks by reason")
    chart(views.failures(frame, window), charts.BLOCKS_PER_S, "No failed blocks in range.")
    events, statuses = failures.load_events(logs)
    for s in statuses:
        message = text.log_message(s)
        if message:
            st.info(message)
        if message := text.skipped_message(s):
            st.warning(message)
    if events.empty:
        return
    st.subheader("Failed loads")
    st.altair_chart(charts.event_timeline(events), width="stretch")
    cols = st.columns(4)
    tiers = cols[0].multiselect("Tier", sorted(events["tier"].unique()), key="ev_tier")
    reasons = cols[1].multiselect("Reason", sorted(events["reason_kind"].unique()), key="ev_reason")
    chosen_logs = cols[2].multiselect("Log", sorted(events["log"].unique()), key="ev_log")
    request = cols[3].text_input("Request id contains", key="ev_request")
    shown = failures.filter_events(events, tiers, reasons, request, chosen_logs)
    table(
        shown.rename(columns={"num_blocks": "blocks", "tokens_affected": "tokens recomputed"}),
        width="stretch",
        hide_index=True,
    )
    table(failures.summary(shown), width="stretch", hide_index=True)


def requests_view(logs: tuple[str, ...]) -> None:
    if not logs:
        st.info(text.REQUEST_LOG_OFF)
        return
    frame, statuses = request_log(logs, logfiles.stamp(logs))
    for s in statuses:
        if message := text.request_log_message(s):
            st.info(message)
        if message := text.skipped_message(s):
            st.warning(message)
    if frame.empty:
        return
    st.caption(f"{len(frame):,} finished requests logged (newest first).")
    request_search(frame)
    misses_by_reason(frame)
    st.subheader("Latest requests")
    table(frame.head(200), width="stretch", hide_index=True)


def request_search(frame: pd.DataFrame) -> None:
    st.subheader("Why did this request miss?")
    wanted = st.text_input("Request id (exact or prefix)", key="rq_id").strip()
    if not wanted:
        return
    found = request_records.find_request(frame, wanted)
    if found.empty:
        st.info(
            f"No logged request matches {wanted!r}: it has not finished yet, or the request log's "
            "sampling (KVLENS_REQUEST_LOG_SAMPLE) left it out."
        )
        return
    for _, row in found.head(5).iterrows():
        st.text(request_records.explain(row))
    table(found, width="stretch", hide_index=True)


def misses_by_reason(frame: pd.DataFrame) -> None:
    st.subheader("Requests by miss reason")
    counts = request_records.miss_reason_counts(frame)
    if counts.empty:
        st.info("No logged request missed: KVLens supplied every prompt it had stored.")
        return
    left, right = st.columns([1, 2])
    table(where=left, data=counts, width="stretch", hide_index=True)
    labels = dict(zip(counts["miss_reason"], counts["requests"], strict=True))
    reason = right.selectbox(
        "Requests that missed because",
        list(labels),
        format_func=lambda r: f"{r} ({labels[r]:,} requests)",
        key="rq_reason",
    )
    shown = request_records.requests_missing_for(frame, reason)
    table(where=right, data=shown.head(500), width="stretch", hide_index=True)


# While a refresh re-runs the live part, Streamlit marks what it has not sent again yet as stale
# and greys it out after half a second. A periodic refresh is not a change the reader made: the
# last figures stay readable until the new ones replace them (Streamlit's running indicator
# still shows that a refresh is under way).
KEEP_READABLE = (
    "<style>.st-key-live [data-stale='true'], .st-key-live [data-stale='true'] * "
    "{opacity: 1 !important; transition: none !important;}</style>"
)


def live(cfg: settings.Settings, section: str) -> None:
    with st.container(key="live"):
        _live(cfg, section)


def _live(cfg: settings.Settings, section: str) -> None:
    with guarded("The data"):
        fleet, statuses, window = load(cfg)
        for status in statuses:
            message = text.status_message(status)
            if message:
                getattr(st, message[0])(message[1])
        if not fleet.empty and fleet["time"].nunique() < 2:
            st.info(WAITING)
        names = views.instances(fleet)
        choice = st.selectbox("Instance", [ALL, *names], key="instance") if len(names) > 1 else ALL
        frame = fleet if choice == ALL else views.for_instances(fleet, [choice])
        idle_for_s = max(30.0, 3 * cfg.refresh_s)
        sections = {
            "Overview": lambda: overview_view(frame, fleet, window),
            "Hits and misses": lambda: hits_and_misses(frame, window),
            "Latency and throughput": lambda: latency_and_throughput(frame, window),
            "Tiers and leaks": lambda: tiers_and_leaks(frame, fleet, window, idle_for_s),
            "Failures": lambda: failures_view(frame, window, cfg.events),
            "Requests": lambda: requests_view(cfg.requests),
            "Insights": lambda: insights_page.show(frame, fleet, window),
            "Tenants": lambda: tenants_page.show(frame, window),
            "PD": lambda: pd_page.show(frame, window, cfg),
            "Blending": lambda: blend_page.show(frame, window),
        }
        with guarded(section):
            sections[section]()
        st.caption(f"Updated {time.strftime('%H:%M:%S')}; refreshes every {cfg.refresh_s:g} s.")


def tabs(cfg: settings.Settings) -> None:
    """The tabs, and in the open one its live part, refreshed every ``cfg.refresh_s``.

    The tabs stand outside the refreshed part on purpose. Inside it, each refresh sent them
    again, and Streamlit disables a tab from the moment it is stale until the browser has drawn
    it again: on a loaded machine (refreshes that take longer, a browser that lags) the tabs were
    disabled for much of each refresh and a click on one was dropped. Here a refresh never
    touches them, and a click reruns the page at once (it interrupts a refresh under way).
    Only the open tab's part is computed and sent, at each refresh and when another is opened."""
    opened = st.tabs(list(ROWS), key="section", on_change="rerun")
    for tab, name in zip(opened, ROWS, strict=True):
        if tab.open:
            with tab:
                st.fragment(run_every=cfg.refresh_s)(live)(cfg, name)


def main() -> None:
    st.set_page_config(page_title="KVLens", layout="wide")
    st.set_option("client.showErrorDetails", "none")
    st.title("KVLens")
    st.markdown(KEEP_READABLE, unsafe_allow_html=True)
    address = st_config.get_option("server.address")
    if _served() and settings.listens_everywhere_by_default(
        address, st_config.get_where_defined("server.address")
    ):
        st.error(text.EXPOSED)
        st.stop()
    try:
        started = settings.parse(_argv(), os.environ)
    except NotHttpURL as e:  # the operator's flag or variable, named in the message
        st.error(f"Not started: {e}.")
        st.stop()
    with guarded("The settings"):
        cfg = sidebar.sidebar(started)
        tabs(cfg)


main()
