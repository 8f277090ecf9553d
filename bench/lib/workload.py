"""What the throughput workloads share: runs of many requests per mode, repeated in turns, and
figures compared with a baseline mode measured in the same repetition.

``prefix_repetition.py`` and ``multi_round_chat.py`` measure a whole run of requests, not one
request. A repetition of a mode is one run on a data set of its own (the same for every mode),
started after vLLM's prefix cache is flushed; the modes take turns within a repetition, in an
order reversed every repetition (``runner.rotated``). A ratio to the baseline is taken per
repetition, so it compares runs minutes apart, not a mode measured while the machine was quiet
with one measured while it was busy. Each run also records where vLLM got the prompt tokens
(computed, its own prefix cache, the connector): the evidence that the working set did not fit.

Records use the key names of ``vllm bench serve``'s result file (``total_token_throughput``,
``p99_ttft_ms``, ...), so both workloads share the table, the JSON shape and the plots.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import report
from .client import Client, metric_sum
from .models import kv_bytes_per_token
from .report import first_line
from .runner import LiveMode, Run, ServerShape, rotated, stop_on_signals

VLLM_CPU_BLOCK = 128  # tokens per KV block in vLLM on CPU
CEILING_GIB = 1  # VLLM_CPU_KVCACHE_SPACE of every mode; only the ceiling is not capped in blocks
SOURCES_METRIC = "vllm:prompt_tokens_by_source_total"
SOURCES = {"tokens_computed": "local_compute", "tokens_vllm_hit": "local_cache_hit"}
SOURCES["tokens_connector"] = "external_kv_transfer"
PREEMPTIONS_METRIC = "vllm:num_preemptions_total"

Record = dict[str, Any]  # one repetition of one mode: numbers, plus anything the raw JSON keeps
Measure = Callable[[LiveMode, int], Record]


class ModeFailed(Exception):
    """The mode cannot go on (its server died, or its client could not run); the others go on."""


@dataclass(frozen=True, slots=True)
class Figure:
    key: str  # in each repetition's record
    label: str  # table column and plot legend
    fmt: str = "{:.1f}"


OUTPUT_TPUT = Figure("output_throughput", "output tok/s")
TOTAL_TPUT = Figure("total_token_throughput", "total tok/s")
REQUEST_TPUT = Figure("request_throughput", "req/s", "{:.3f}")


def ttft(p: int) -> Figure:
    return Figure(f"p{p}_ttft_ms", f"TTFT p{p} ms", "{:.0f}")


def blocks(tokens: int) -> int:
    return -(-tokens // VLLM_CPU_BLOCK)


def small_kv_shape(
    bench: Run, max_model_len: int, kv_blocks: int, working_set: int
) -> tuple[ServerShape, dict[str, int]]:
    """The servers' shape: ``kv_blocks`` of vLLM KV memory in every mode but the ceiling, which
    gets ``CEILING_GIB``; notes how one repetition's working set compares with both. Returns the
    shape and the figures the JSON keeps."""
    if kv_blocks < blocks(max_model_len):
        raise SystemExit(f"--kv-blocks {kv_blocks} cannot hold one request ({blocks(max_model_len)} blocks)")
    per_token = kv_bytes_per_token(Path(bench.model))
    cap = kv_blocks * VLLM_CPU_BLOCK
    bench.note(
        f"vLLM KV memory in every mode but the ceiling: {kv_blocks} blocks = {cap} tokens "
        f"({cap * per_token / 2**20:.0f} MiB); one repetition's working set: {working_set} tokens "
        f"({working_set / cap:.1f}x)"
    )
    if any(m.ceiling for m in bench.modes) and working_set * per_token > CEILING_GIB * 2**30:
        bench.note(f"the ceiling's {CEILING_GIB} GiB of KV memory does not hold the working set either")
    shape = ServerShape(
        max_model_len=max_model_len,
        kv_blocks=kv_blocks,
        kv_space_gib=CEILING_GIB,
        working_set_gb=bench.args.repeats * working_set * per_token / 1e9,  # a connector keeps them all
    )
    return shape, {"kv_blocks": kv_blocks, "kv_tokens": cap, "working_set_tokens": working_set}


# ---- one request as measured ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Turn:
    """One request, as measured (``ok`` False: it failed; ``error`` says how)."""

    ok: bool
    ttft: float
    latency: float
    prompt_tokens: int
    output_tokens: int
    error: str = ""
    cached_tokens: int = 0  # vLLM's prefix hit plus the connector's, as the response reports them


def record(turns: Sequence[Turn], wall: float) -> Record:
    """Figures of requests that took ``wall`` seconds, under the names vllm bench serve gives them."""
    ok = [t for t in turns if t.ok]
    inp = sum(t.prompt_tokens for t in ok)
    out = sum(t.output_tokens for t in ok)
    rec: Record = {
        "duration": wall,
        "completed": len(ok),
        "failed": len(turns) - len(ok),
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": len(ok) / wall,
        "output_throughput": out / wall,
        "total_token_throughput": (inp + out) / wall,
        "mean_ttft_ms": 1000 * sum(t.ttft for t in ok) / len(ok) if ok else math.nan,
    }
    for p in (50, 90, 99):
        rec[f"p{p}_ttft_ms"] = 1000 * report.percentile([t.ttft for t in ok], p)
        rec[f"p{p}_e2el_ms"] = 1000 * report.percentile([t.latency for t in ok], p)
    return rec


# ---- measuring --------------------------------------------------------------------------------
def measure_in_turns(
    bench: Run,
    shape: ServerShape,
    repeats: int,
    measure: Measure,
    warm_up: Callable[[LiveMode], None] | None = None,
) -> dict[str, list[Record]]:
    """Every live mode measured ``repeats`` times, in turns, after ``warm_up`` (unmeasured) on
    each. A mode whose server dies or stops answering leaves the run (reported unavailable from
    then on) and keeps what it measured."""
    records: dict[str, list[Record]] = {}
    with stop_on_signals():
        for live in bench.batches(shape):
            for lm in list(live) if warm_up else ():
                try:
                    warm_up(lm)
                except (ModeFailed, OSError, TimeoutError) as e:
                    drop(bench, live, lm, f"failed to warm up ({first_line(str(e), 160)})")
            for rep in range(repeats):
                for lm in rotated(live, rep):
                    try:
                        rec = _measure_once(lm, rep, measure)
                    except (ModeFailed, OSError, TimeoutError) as e:
                        drop(bench, live, lm, f"failed in repetition {rep + 1} ({first_line(str(e), 160)})")
                        continue
                    records.setdefault(lm.mode.name, []).append(rec)
                    print(
                        f"   repetition {rep + 1}/{repeats}: {lm.mode.name:12s} {progress(rec)}", flush=True
                    )
                    if not lm.server.ready():
                        drop(bench, live, lm, f"its server stopped answering in repetition {rep + 1}")
    return records


def _measure_once(lm: LiveMode, rep: int, measure: Measure) -> Record:
    lm.client.reset_prefix_cache()
    before = _counters(lm.client)
    rec: Record = {"repetition": rep, **measure(lm, rep)}
    after = _counters(lm.client)
    rec.update({k: after[k] - before[k] for k in before})
    return rec


def _counters(client: Client) -> dict[str, float]:
    """Prompt tokens by source and preemptions so far (NaN when the server cannot tell)."""
    try:
        text = client.metrics_text()
    except OSError:
        return {k: math.nan for k in [*SOURCES, "preemptions"]}
    out = {k: metric_sum(text, SOURCES_METRIC, source=src) for k, src in SOURCES.items()}
    out["preemptions"] = metric_sum(text, PREEMPTIONS_METRIC)
    return out


def drop(bench: Run, live: list[LiveMode], lm: LiveMode, why: str) -> None:
    live.remove(lm)  # the batch stops only the servers still in ``live``
    lm.server.stop()
    if lm.sidecar is not None:
        lm.sidecar.stop()
    bench.skip(lm.mode, f"{why}; log {lm.server.log_path}")


def progress(rec: Record) -> str:
    return (
        f"{rec['total_token_throughput']:.0f} tok/s, {rec['request_throughput']:.3f} req/s, "
        f"TTFT p50 {rec['p50_ttft_ms']:.0f} ms, failed {rec['failed']:.0f}; prompt tokens computed/"
        f"vLLM hit/connector {_count(rec, 'tokens_computed')}/{_count(rec, 'tokens_vllm_hit')}/"
        f"{_count(rec, 'tokens_connector')}"
    )


def _count(rec: Record, key: str) -> str:
    v = rec.get(key, math.nan)
    return "?" if math.isnan(v) else f"{v:.0f}"


# ---- summaries --------------------------------------------------------------------------------
def summarize(
    bench: Run, records: dict[str, list[Record]], ratio_keys: Sequence[str], baselines: Sequence[str]
) -> dict[str, Any]:
    """Per mode: every recorded figure as median/min/max over repetitions, the total of failed
    requests, and ``vs[baseline][key]``: the figure over the baseline's in the same repetition."""
    out: dict[str, Any] = {}
    for mode in bench.modes:
        recs = records.get(mode.name)
        if not recs:
            continue
        keys = sorted({k for r in recs for k, v in r.items() if _number(v)} - {"repetition"})
        s: dict[str, Any] = {k: report.summary(_values(recs, k)) for k in keys}
        s["connector"] = mode.connector
        s["repetitions"] = len(recs)
        s["failed_total"] = int(sum(r["failed"] for r in recs))
        s["requests_total"] = int(sum(r["failed"] + r["completed"] for r in recs))
        s["vs"] = {
            b: {k: report.summary(_ratios(recs, records[b], k)) for k in ratio_keys}
            for b in baselines
            if b in records and b != mode.name
        }
        if mode.name in bench.skipped:
            s["stopped"] = bench.skipped[mode.name]
        out[mode.name] = s
    return out


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _values(recs: Sequence[Record], key: str) -> list[float]:
    return [float(r[key]) for r in recs if key in r and not math.isnan(float(r[key]))]


def _ratios(recs: Sequence[Record], base: Sequence[Record], key: str) -> list[float]:
    by_rep = {r["repetition"]: r for r in base}
    out = []
    for r in recs:
        b = by_rep.get(r["repetition"])
        if b is not None and b.get(key) and not math.isnan(b[key]) and not math.isnan(r[key]):
            out.append(r[key] / b[key])
    return out


def headline(summary: dict[str, Any], ratio_keys: Sequence[str], baselines: Sequence[str]) -> dict[str, Any]:
    """Median ratios: ``vs_<baseline>`` -> mode -> figure."""
    return {
        f"vs_{b}": {
            name: {k: s["vs"][b][k]["median"] for k in ratio_keys}
            for name, s in summary.items()
            if b in s["vs"]
        }
        for b in baselines
    }


def verdict(value: float, target: float) -> str:
    if math.isnan(value):
        return "not measured"
    return "met" if value >= target else "NOT met"


# ---- table and plot ---------------------------------------------------------------------------
def figures_table(bench: Run, summary: dict[str, Any], figures: Sequence[Figure]) -> str:
    t = report.Table(["mode", *(f.label for f in figures), "failed/requests", "prompt tokens comp/vLLM/conn"])
    for mode in bench.modes:
        s = summary.get(mode.name)
        if s is None:
            t.add_span(mode.name, bench.unavailable(mode))
            continue
        t.add(
            mode.name,
            *(report.spread(s[f.key], f.fmt) for f in figures),
            f"{s['failed_total']}/{s['requests_total']}",
            "/".join(_median(s, k) for k in SOURCES),
        )
        if "stopped" in s:
            t.add_span("", f"stopped: {first_line(s['stopped'], 140)}")
    return t.render()


def _median(s: dict[str, Any], key: str) -> str:
    m = s.get(key, {}).get("median", math.nan)
    return "?" if m is None or math.isnan(m) else f"{m:.0f}"


def ratios_table(
    bench: Run, summary: dict[str, Any], figures: Sequence[Figure], baselines: Sequence[str]
) -> str:
    cols = [(b, f) for b in baselines if b in summary for f in figures]
    t = report.Table(["mode", *(f"{f.label} x {b}" for b, f in cols)])
    for mode in bench.modes:
        s = summary.get(mode.name)
        if s is None:
            continue
        cells = [report.spread(s["vs"][b][f.key]) if b in s["vs"] else "-" for b, f in cols]
        t.add(mode.name, *cells)
    return t.render()


def figure_panel(
    title: str, ylabel: str, summary: dict[str, Any], figures: Sequence[Figure], log: bool = False
) -> report.Panel:
    names = list(summary)
    return report.Panel(
        title,
        ylabel,
        names,
        [report.Series(f.label, [summary[n][f.key] for n in names]) for f in figures],
        log=log,
    )


def ratio_panel(
    summary: dict[str, Any],
    baseline: str,
    figures: Sequence[Figure],
    target: float | None = None,
    log: bool = False,
) -> report.Panel:
    names = [n for n, s in summary.items() if baseline in s["vs"]]
    return report.Panel(
        f"{', '.join(f.label for f in figures)} / {baseline}, per repetition (median, min..max)",
        f"x {baseline}",
        names,
        [report.Series(f.label, [summary[n]["vs"][baseline][f.key] for n in names]) for f in figures],
        target=target if target is not None else 1.0,
        target_label=f"target {target}" if target is not None else "1.0",
        log=log,
    )


def sources_panel(summary: dict[str, Any]) -> report.Panel:
    names = list(summary)
    labels = {
        "tokens_computed": "computed",
        "tokens_vllm_hit": "vLLM prefix hit",
        "tokens_connector": "connector",
    }
    empty = report.summary([])
    return report.Panel(
        "where prompt tokens came from, per repetition",
        "tokens",
        names,
        [report.Series(lbl, [summary[n].get(k, empty) for n in names]) for k, lbl in labels.items()],
    )


# ---- small helpers ----------------------------------------------------------------------------
def args_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
