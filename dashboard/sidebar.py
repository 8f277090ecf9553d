"""The app's sidebar: which of the sources fixed at start-up to read, the time range and the
refresh. The sources themselves are shown, not editable, unless the app was started with
``--allow-source-edits``; even then only http(s) endpoint and Prometheus URLs are taken, and
log paths never."""

from __future__ import annotations

import streamlit as st

from . import settings


def sidebar(defaults: settings.Settings) -> settings.Settings:
    sb = st.sidebar
    sb.header("Data sources")
    kinds = {settings.METRICS: "vLLM /metrics (direct)", settings.PROMETHEUS: "Prometheus"}
    source = sb.radio(
        "Read from", list(kinds), format_func=kinds.get, index=list(kinds).index(defaults.source)
    )
    if defaults.allow_source_edits:
        endpoints, prom = _edited_sources(defaults, source)
    else:
        endpoints, prom = defaults.endpoints, defaults.prometheus
        _shown(("vLLM endpoints", endpoints), ("Prometheus URL", (prom,) if prom else ()))
    _shown(("PD proxy", (defaults.pd_proxy,) if defaults.pd_proxy else ()))
    _shown(("Failed-load event logs", defaults.events), ("Request logs", defaults.requests))
    sb.caption(
        "Set when the app starts (flags or environment). Start it with --allow-source-edits to "
        "edit the endpoint and Prometheus URLs here (http and https only)."
        if not defaults.allow_source_edits
        else "Logs are set when the app starts (flags or environment)."
    )
    minutes = sb.number_input("Time range (minutes)", 1.0, 24 * 60.0, defaults.minutes, step=5.0)
    refresh = sb.number_input("Refresh every (seconds)", 1.0, 600.0, defaults.refresh_s, step=1.0)
    return settings.Settings(
        source=source,
        endpoints=endpoints,
        prometheus=prom,
        events=defaults.events,
        refresh_s=float(refresh),
        minutes=float(minutes),
        requests=defaults.requests,
        allow_source_edits=defaults.allow_source_edits,
        pd_proxy=defaults.pd_proxy,
    )


def _shown(*lists: tuple[str, tuple[str, ...]]) -> None:
    """Sources as plain text in the sidebar: what the app reads, not a field to change it."""
    for label, values in lists:
        st.sidebar.markdown(f"**{label}**")
        st.sidebar.text("\n".join(values) or "(none)")


def _edited_sources(defaults: settings.Settings, source: str) -> tuple[tuple[str, ...], str]:
    """The endpoints and Prometheus URL as edited in the sidebar: http(s) URLs only, the rest
    refused by name (the start-up ones stand in when nothing acceptable is left)."""
    sb = st.sidebar
    typed = sb.text_area(
        "vLLM endpoints (one per line)",
        "\n".join(defaults.endpoints),
        help="host:port or an http(s) /metrics URL; history is kept in memory while the app runs.",
        disabled=source != settings.METRICS,
    )
    endpoints, refused = settings.checked_endpoints(settings.split_list(typed))
    prom = sb.text_input("Prometheus URL", defaults.prometheus, disabled=source != settings.PROMETHEUS)
    prom = prom.strip()
    _, refused_prom = settings.checked_endpoints([prom] if prom else [])
    for entry in (*refused, *refused_prom):
        sb.error(f"Refused {entry}: only http:// and https:// URLs are read.")
    return endpoints or defaults.endpoints, defaults.prometheus if refused_prom else prom
