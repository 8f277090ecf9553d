"""The PD (prefill/decode disaggregation) tab's numbers about the transfers, from the long sample
frame of ``sources``: which engine is a prefiller and which a decoder, bytes each sent or
received, each decoder's receive buffer, transfers in flight, refusals and timeouts by reason.
Where the time to first token goes is ``dashboard.pd_split``. Plain pandas, no Streamlit.

Every engine exports every PD series, at 0 for the side it is not on (a prefiller has a receive
buffer of 0 bytes): each view keeps the engines of its side, named by their role.
"""

from __future__ import annotations

import pandas as pd

from . import catalog as c
from .pd_split import PAIR
from .views import DEFAULT_WINDOW_S, SERIES, for_instances, gauge, join, rate, select, total

# kvlens_info's pd_role -> what the dashboards call an engine of that role.
ROLE_NAMES = {c.PD_SENDER: "prefiller", c.PD_RECEIVER: "decoder"}
# vllm:kvlens_pd_transfers_in_flight{side} -> who is doing it.
SIDE_NAMES = {"send": "sending (prefillers)", "receive": "receiving (decoders)"}


def has_pd(frame: pd.DataFrame) -> bool:
    """Whether any engine runs PD: it moved PD bytes or holds a receive buffer (every engine
    exports the PD series, at 0 where PD is off)."""
    names = (c.PD_SENT_BYTES, c.PD_RECEIVED_BYTES, c.PD_BUFFER_CAPACITY)
    return any(bool((select(frame, n)["value"] > 0).any()) for n in names)


def roles(frame: pd.DataFrame) -> dict[str, str]:
    """Each instance's PD role from its latest ``vllm:kvlens_info``: "sender" (a prefiller) or
    "receiver" (a decoder); instances without PD, or whose KVLens does not say, are left out."""
    df = select(frame, c.kvlens("info"))
    df = df[(df["value"] > 0) & (df["pd_role"] != "")]
    if df.empty:
        return {}
    last = df.sort_values("time").groupby("instance", sort=True).tail(1)
    return dict(zip(last["instance"], last["pd_role"], strict=True))


def has_proxy(frame: pd.DataFrame) -> bool:
    return not select(frame, c.PROXY_PHASE + "_count").empty


def _of_role(frame: pd.DataFrame, role: str, *evidence: str) -> list[str]:
    """The instances of one PD role: those whose ``kvlens_info`` says so, and those whose KVLens
    does not say (older than ``pd_role``) but one of whose ``evidence`` series is above 0."""
    said = roles(frame)
    unsaid: set[str] = set()
    for name in evidence:
        unsaid |= {i for i, v in total(frame, name, ("instance",)).items() if i not in said and v > 0}
    return sorted([i for i, r in said.items() if r == role] + list(unsaid))


def prefillers(frame: pd.DataFrame) -> list[str]:
    return _of_role(frame, c.PD_SENDER, c.PD_SENT_BYTES)


def decoders(frame: pd.DataFrame) -> list[str]:
    return _of_role(frame, c.PD_RECEIVER, c.PD_BUFFER_CAPACITY, c.PD_RECEIVED_BYTES)


def _only(frame: pd.DataFrame, instances: list[str]) -> pd.DataFrame:
    return for_instances(frame, instances) if instances else frame.iloc[0:0]


def _named(wide: pd.DataFrame, role: str, what: str) -> pd.DataFrame:
    """Columns named by instance -> "<role> <instance> <what>" ("decoder 10.0.0.2:8200 received")."""
    return wide.rename(columns=lambda instance: f"{ROLE_NAMES[role]} {instance} {what}")


def bytes_per_s(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Bytes per second each prefiller sent and each decoder received, named by role."""
    sent = rate(_only(frame, prefillers(frame)), c.PD_SENT_BYTES, ("instance",), window_s)
    got = rate(_only(frame, decoders(frame)), c.PD_RECEIVED_BYTES, ("instance",), window_s)
    return join(_named(sent, c.PD_SENDER, "sent"), _named(got, c.PD_RECEIVER, "received"))


def buffer_over_time(frame: pd.DataFrame) -> pd.DataFrame:
    """Each decoder's receive buffer, used and capacity, in bytes."""
    mine = _only(frame, decoders(frame))
    return join(
        _named(gauge(mine, c.PD_BUFFER_USED, ("instance",)), c.PD_RECEIVER, "used"),
        _named(gauge(mine, c.PD_BUFFER_CAPACITY, ("instance",)), c.PD_RECEIVER, "capacity"),
    )


def in_flight(frame: pd.DataFrame, proxy: pd.DataFrame | None = None) -> pd.DataFrame:
    """Transfers in flight by side (send: prefillers, receive: decoders), and the requests the
    proxy has in flight."""
    parts = [gauge(frame, c.PD_IN_FLIGHT, ("side",)).rename(columns=SIDE_NAMES)]
    if proxy is not None:
        parts.append(gauge(proxy, c.PROXY_IN_FLIGHT, legend="proxy requests"))
    return join(*parts)


def reason_kind(reason: str) -> str:
    """``mismatch:tp_size,block_size`` -> ``mismatch``: one series per kind of reason."""
    return reason.split(":", 1)[0]


def _by_reason_kind(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    """The counter's series with their reasons cut to kinds, the series of one kind summed at
    each reading (the counters of two mismatches become one counter)."""
    df = select(frame, name)
    if df.empty:
        return df
    df = df.assign(reason=df["reason"].map(reason_kind))
    keys = ["time", *SERIES]
    return df.groupby(keys, as_index=False, sort=False)["value"].sum()[list(frame.columns)]


def refusals(frame: pd.DataFrame, side: str, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Refused or failed transfers per second on one side (send or receive), by kind of reason."""
    df = _by_reason_kind(frame, c.PD_FAILED_TRANSFERS)
    return rate(df, c.PD_FAILED_TRANSFERS, ("reason",), window_s, side=side) if not df.empty else df


def proxy_timeouts(proxy: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """The proxy's waits for the notifications that ran past its bound, per second, by pair."""
    return rate(proxy, c.PROXY_WAIT_TIMEOUTS, PAIR, window_s, prefix="timed out ")


def refusal_totals(frame: pd.DataFrame, proxy: pd.DataFrame | None = None) -> pd.DataFrame:
    """Refused or failed transfers since each server started, by side and full reason (the
    mismatching fields named), and the proxy's wait timeouts by pair."""
    rows = [
        {"where": SIDE_NAMES.get(side, side), "reason": reason, "transfers": v}
        for (side, reason), v in total(frame, c.PD_FAILED_TRANSFERS, ("side", "reason")).items()
    ]
    if proxy is not None:
        for (p, d), v in total(proxy, c.PROXY_WAIT_TIMEOUTS, PAIR).items():
            rows.append({"where": "proxy", "reason": f"wait timeout {p} → {d}", "transfers": v})
    return pd.DataFrame(rows, columns=["where", "reason", "transfers"])


def buffer_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Each decoder's receive buffer now: bytes used of capacity, entries held, transfers being
    received, and transfers received and refused since start (prefillers have no buffer)."""
    mine = _only(frame, decoders(frame))
    cols = {
        "used_bytes": total(mine, c.PD_BUFFER_USED, ("instance",)),
        "capacity_bytes": total(mine, c.PD_BUFFER_CAPACITY, ("instance",)),
        "entries": total(mine, c.PD_BUFFER_ENTRIES, ("instance",)),
        "receiving": total(mine, c.PD_IN_FLIGHT, ("instance",), side="receive"),
        "received": total(mine, c.PD_TRANSFERS, ("instance",), side="receive"),
        "refused or failed": total(mine, c.PD_FAILED_TRANSFERS, ("instance",), side="receive"),
    }
    table = pd.DataFrame(cols)
    if table.empty or table["capacity_bytes"].isna().all():
        return pd.DataFrame()
    table = table[table["capacity_bytes"].notna()]
    cap = table["capacity_bytes"]
    table.insert(2, "fill", (table["used_bytes"] / cap.where(cap > 0)).astype(float))
    table.index.name = "decoder"
    return table
