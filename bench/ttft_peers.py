"""Time to first token on one long prompt, per KV-cache connector, side by side (the headline).

    python bench/ttft_peers.py [--quick] [--modes none,kvlens,example,lmcache] [--kvlens-tiers cpu,disk]

Every mode is a vLLM server on the same model and worker core. For each of --prompts prompts of
--tokens random token ids, in every mode in turn:

* cold: the prompt's first request (a connector stores its KV);
* --pairs back-to-back pairs: the floor (vLLM's own prefix-cache hit on the prompt), then
  ``POST /reset_prefix_cache`` and the connector's hit (vLLM's cache is empty, so the prefix
  comes from the connector, or is recomputed without one). Each hit is divided by the floor
  measured just before it: the ratio does not depend on how busy the machine was that minute.

Then, for KVLens modes, the cost of storing on a miss: --store-pairs pairs of cold requests on
fresh prompts in the same engine, one stored as usual and one with ``kv_transfer_params:
{"lmcache.skip_save": true}``, in alternating order; and KVLens's own store timer from /metrics.

TTFT = wall time of a one-token greedy completion over HTTP (REFERENCE.md section 9).
Targets: KVLens hit <= 1.01 x floor; cold with stores <= 1.01 x cold without.
Prints a table; writes .run/bench/results/ttft_peers.json and .png (see --out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import report  # noqa: E402
from bench.lib.runner import (
    LiveMode,
    Run,
    ServerShape,
    add_common_args,
    fill_defaults,
    rotated,
    stop_on_signals,
)  # noqa: E402

DEFAULT_MODES = "none,kvlens,example,lmcache"
QUICK_MODES = "none,kvlens,example,lmcache"
HIT_TARGET = 1.01
STORE_TARGET = 1.01
SKIP_SAVE = {"lmcache.skip_save": True}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tokens",
        type=int,
        help="prompt length (default 3000; --quick 1000; not a multiple of 128, so that vLLM and the "
        "connectors reuse the same whole blocks)",
    )
    p.add_argument("--prompts", type=int, help="distinct prompts (default 3; --quick 1)")
    p.add_argument("--pairs", type=int, help="floor/hit pairs per prompt (default 5; --quick 2)")
    p.add_argument(
        "--store-pairs", type=int, help="stored/skip-save cold pairs per KVLens mode (default 6; --quick 2)"
    )
    p.add_argument("--seed", type=int, default=5)
    add_common_args(p, DEFAULT_MODES, QUICK_MODES)
    args = p.parse_args(argv)
    quick = {"tokens": 1000, "prompts": 1, "pairs": 2, "store_pairs": 2}
    full = {"tokens": 3000, "prompts": 3, "pairs": 5, "store_pairs": 6}
    fill_defaults(args, quick, full)
    return args


def vocab_size(model: Path) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


def new_record() -> dict[str, Any]:
    keys = (
        "cold_s",
        "floor_s",
        "hit_s",
        "pair_ratio",
        "cold_over_hit",
        "cold_cached",
        "floor_cached",
        "hit_cached",
        "kvlens_load_ms",
        "first_token_matches",
    )
    return {k: [] for k in keys}


@contextlib.contextmanager
def failing_mode(
    bench: Run, live: list[LiveMode], lm: LiveMode, results: dict, stores: dict
) -> Iterator[None]:
    """A mode whose server fails a request (its engine died, it hung) leaves the run as
    "unavailable", with the reason; the other modes go on."""
    try:
        yield
    except (OSError, TimeoutError) as e:  # urllib's HTTPError and URLError are OSErrors
        live.remove(lm)  # the batch stops only the servers still in ``live``
        lm.server.stop()
        if lm.sidecar is not None:
            lm.sidecar.stop()
        results.pop(lm.mode.name, None)
        stores.pop(lm.mode.name, None)
        bench.skip(
            lm.mode,
            f"failed during the measurement ({report.first_line(str(e), 100)}); log {lm.server.log_path}",
        )


def warm_up(lm: LiveMode, tokens: list[int]) -> None:
    """Every path a measurement takes, once, unmeasured: cold (and store), prefix hit, flush,
    connector hit."""
    c = lm.client
    c.complete(tokens)
    c.complete(tokens)
    c.reset_prefix_cache()
    c.complete(tokens)


def measure_prompt(lm: LiveMode, tokens: list[int], pairs: int, rec: dict[str, Any]) -> None:
    """Cold, then ``pairs`` x (floor, flush, connector hit) on one prompt in one engine."""
    c = lm.client
    cold = c.complete(tokens)
    rec["cold_s"].append(cold.seconds)
    rec["cold_cached"].append(cold.cached_tokens)
    for _ in range(pairs):
        floor = c.complete(tokens)
        c.reset_prefix_cache()
        hit = c.complete(tokens)
        rec["floor_s"].append(floor.seconds)
        rec["floor_cached"].append(floor.cached_tokens)
        rec["hit_s"].append(hit.seconds)
        rec["hit_cached"].append(hit.cached_tokens)
        rec["pair_ratio"].append(hit.seconds / floor.seconds)
        rec["cold_over_hit"].append(cold.seconds / hit.seconds)
        # A hit computes the prompt's tail on a cached prefix, as vLLM's own hit does: it must give
        # the floor's token. The cold run computed every token in one pass, and in bf16 that can
        # break a near tie the other way (seen at 2,000 tokens with vLLM's own hit too).
        reference = floor if hit.cached_tokens else cold
        rec["first_token_matches"].append(hit.token_ids == reference.token_ids)
        usage = (hit.kv_transfer_params or {}).get("kvlens") or {}
        if "load_ms" in usage:
            rec["kvlens_load_ms"].append(usage["load_ms"])


STORE_TIMER = "vllm:kvlens_operation_seconds_sum"


def measure_store_pairs(
    lm: LiveMode, prompts: list[tuple[list[int], list[int]]], start: int, rec: dict
) -> None:
    """Cold requests on fresh prompts, stored and not stored (skip_save), in alternating order."""
    c = lm.client
    for i, (a, b) in enumerate(prompts):
        before = c.metric_sum(STORE_TIMER, operation="store")
        timings = {}
        for which in ("store", "skip") if (start + i) % 2 == 0 else ("skip", "store"):
            params = SKIP_SAVE if which == "skip" else None
            done = c.complete(a if which == "store" else b, kv_params=params)
            timings[which] = done.seconds
            if which == "skip":
                reason = ((done.kv_transfer_params or {}).get("kvlens") or {}).get("save_skip_reason")
                rec["skip_reasons"].append(reason)
        rec["store_s"].append(timings["store"])
        rec["skip_s"].append(timings["skip"])
        rec["ratio"].append(timings["store"] / timings["skip"])
        rec["store_timer_s"].append(c.metric_sum(STORE_TIMER, operation="store") - before)


def run(args: argparse.Namespace) -> int:
    bench = Run("ttft_peers", args, DEFAULT_MODES, QUICK_MODES)
    bench.header(f"TTFT of a {args.tokens}-token prompt: cold, vLLM prefix hit (floor), connector hit")
    vocab = vocab_size(bench.model)
    prompts = [prompt(args.seed * 1000 + i, args.tokens, vocab) for i in range(args.prompts)]
    # A full-length prompt of its own: the first prefill of a length pays one-off costs (kernel
    # set-up, allocations) that must not land in the first mode's cold figure.
    warm = prompt(args.seed * 1000 - 1, args.tokens, vocab)
    shape = ServerShape(
        max_model_len=args.tokens + 64,
        kv_space_gib=1,
        working_set_gb=0.1 * (args.prompts + 2 * args.store_pairs),
    )
    results: dict[str, dict[str, Any]] = {}
    stores: dict[str, dict[str, Any]] = {}
    with stop_on_signals():
        for live in bench.batches(shape):
            for lm in list(live):
                with failing_mode(bench, live, lm, results, stores):
                    warm_up(lm, warm)
                    results[lm.mode.name] = new_record()
            for i, tokens in enumerate(prompts):
                for lm in rotated(live, i):
                    with failing_mode(bench, live, lm, results, stores):
                        measure_prompt(lm, tokens, args.pairs, results[lm.mode.name])
                        print(
                            f"   prompt {i}: {lm.mode.name:12s} {_progress(results[lm.mode.name])}",
                            flush=True,
                        )
            for j in range(args.store_pairs):
                pair = (
                    prompt(args.seed * 7919 + 2 * j, args.tokens, vocab),
                    prompt(args.seed * 7919 + 2 * j + 1, args.tokens, vocab),
                )
                for lm in rotated([lm for lm in live if lm.mode.connector == "kvlens"], j):
                    rec = stores.setdefault(
                        lm.mode.name,
                        {k: [] for k in ("store_s", "skip_s", "ratio", "store_timer_s", "skip_reasons")},
                    )
                    with failing_mode(bench, live, lm, results, stores):
                        measure_store_pairs(lm, [pair], j, rec)
    summary = summarize(bench, results, stores, args)
    bench.finish(
        {
            "settings": vars_json(args),
            "ratios": headline(summary),
            "unavailable": dict(bench.skipped),
            "summary": summary,
            "raw": results,
            "store_raw": stores,
        },
        table(bench, summary),
        f"TTFT of a {args.tokens}-token prompt per connector",
        panels(bench, summary),
    )
    return 0


def _progress(rec: dict[str, Any]) -> str:
    return (
        f"cold {rec['cold_s'][-1]:.3f} s, floor {rec['floor_s'][-1]:.3f} s, hit {rec['hit_s'][-1]:.3f} s "
        f"({rec['hit_cached'][-1]} cached tokens)"
    )


def record_summary(rec: dict[str, Any], connector: str | None) -> dict[str, Any]:
    """One mode's ``new_record()`` as medians with their spread, and whether its hits matched."""
    s = {k: report.summary(rec[k]) for k in ("cold_s", "floor_s", "hit_s", "pair_ratio", "cold_over_hit")}
    s["hit_cached_tokens"] = report.summary(rec["hit_cached"])
    s["floor_cached_tokens"] = report.summary(rec["floor_cached"])
    s["outputs_match"] = all(rec["first_token_matches"])  # hits: the floor's token; recomputes: cold's
    s["connector"] = connector
    if rec["kvlens_load_ms"]:
        s["kvlens_load_ms"] = report.summary(rec["kvlens_load_ms"])
    return s


def note_short_hits(bench: Run, label: str, s: dict[str, Any]) -> None:
    """Notes what makes a hit's time mean something else: a connector that served less than
    vLLM's own hit (the rest was recomputed), or a hit whose first token differs from the floor's."""
    if s["connector"] and s["hit_cached_tokens"]["median"] < s["floor_cached_tokens"]["median"]:
        bench.note(
            f"{label}: its hits served {s['hit_cached_tokens']['median']:.0f} cached tokens, "
            f"vLLM's own hit {s['floor_cached_tokens']['median']:.0f}: the rest was recomputed"
        )
    if not s["outputs_match"]:
        bench.note(f"{label}: a hit produced another first token than vLLM's own hit on the same prompt")


def summarize(bench: Run, results: dict, stores: dict, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in bench.modes:
        rec = results.get(mode.name)
        if rec is None:
            continue
        s = record_summary(rec, mode.connector)
        note_short_hits(bench, mode.name, s)
        st = stores.get(mode.name)
        if st:
            cold = statistics.median(st["skip_s"])
            s["store_cost"] = {
                "ratio": report.summary(st["ratio"]),
                "store_timer_ms_per_request": report.summary([x * 1000 for x in st["store_timer_s"]]),
                "store_timer_share_of_cold": statistics.median(st["store_timer_s"]) / cold,
                "skip_save_honoured": all(r == "skip_save" for r in st["skip_reasons"]),
            }
            if not s["store_cost"]["skip_save_honoured"]:
                bench.note(
                    f"{mode.name}: a skip_save request was not reported as skipped: {st['skip_reasons']}"
                )
        out[mode.name] = s
    return out


def headline(summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The figures of merit, medians per mode: a connector's hit over the floor measured just
    before it, and (KVLens) a cold request that stores over one with skip_save."""
    return {
        "hit_over_floor": {n: s["pair_ratio"]["median"] for n, s in summary.items() if s["connector"]},
        "stored_over_unstored_cold": {
            n: s["store_cost"]["ratio"]["median"] for n, s in summary.items() if "store_cost" in s
        },
    }


def _store_timer(sc: dict[str, Any]) -> str:
    ms = sc["store_timer_ms_per_request"]["median"]
    return f"{ms:.1f} ms ({sc['store_timer_share_of_cold'] * 100:.2f}%)"


def verdict(value: float, target: float) -> str:
    return "met" if value <= target else "NOT met"


def table(bench: Run, summary: dict[str, Any]) -> str:
    t = report.Table(
        [
            "mode",
            "cold s",
            "floor s",
            "hit s",
            "hit/floor (pairs)",
            "cold/hit",
            "hit tokens",
            "stored/unstored cold",
            "store timer",
        ]
    )
    for mode in bench.modes:
        s = summary.get(mode.name)
        if s is None:
            t.add_span(mode.name, bench.unavailable(mode))
            continue
        conn = s["connector"] is not None
        sc = s.get("store_cost")
        t.add(
            mode.name,
            report.spread(s["cold_s"]),
            report.spread(s["floor_s"]),
            report.spread(s["hit_s"]) if conn else f"({report.spread(s['hit_s'])} recompute)",
            report.spread(s["pair_ratio"]) if conn else "-",
            report.spread(s["cold_over_hit"], "{:.1f}") if conn else "-",
            f"{s['hit_cached_tokens']['median']:.0f}/{s['floor_cached_tokens']['median']:.0f}",
            report.spread(sc["ratio"]) if sc else "-",
            _store_timer(sc) if sc else "-",
        )
    lines = [t.render(), ""]
    lines.append(
        "hit/floor: each connector hit over the vLLM prefix hit measured just before it (median, min..max)."
    )
    lines.append("hit tokens: cached tokens of a connector hit / of vLLM's own hit (the rest is recomputed).")
    for name, s in summary.items():
        if s["connector"] == "kvlens":
            ratio = s["pair_ratio"]["median"]
            lines.append(
                f"target KVLens hit <= {HIT_TARGET} x floor, {name}: {ratio:.3f} -> "
                f"{verdict(ratio, HIT_TARGET)}"
            )
            if "store_cost" in s:
                r = s["store_cost"]["ratio"]["median"]
                lines.append(
                    f"target cold with stores <= {STORE_TARGET} x without, {name}: {r:.3f} -> "
                    f"{verdict(r, STORE_TARGET)} (KVLens's store timer: "
                    f"{s['store_cost']['store_timer_share_of_cold'] * 100:.2f}% of cold)"
                )
    return "\n".join(lines)


def panels(bench: Run, summary: dict[str, Any]) -> list[report.Panel]:
    names = [m.name for m in bench.modes if m.name in summary]
    conn = [n for n in names if summary[n]["connector"]]
    kv = [n for n in names if "store_cost" in summary[n]]
    out = [
        report.Panel(
            "TTFT per mode (median, min..max)",
            "seconds",
            names,
            [
                report.Series(lbl, [summary[n][key] for n in names])
                for lbl, key in (
                    ("cold", "cold_s"),
                    ("floor: vLLM prefix hit", "floor_s"),
                    ("connector hit after flush", "hit_s"),
                )
            ],
            log=True,
        ),
        report.Panel(
            "connector hit / floor, back-to-back pairs",
            "ratio",
            conn,
            [report.Series("hit / floor", [summary[n]["pair_ratio"] for n in conn])],
            target=HIT_TARGET,
            target_label=f"target {HIT_TARGET}",
        ),
    ]
    if kv:
        out.append(
            report.Panel(
                "cost of storing on a miss: cold stored / cold with skip_save",
                "ratio",
                kv,
                [report.Series("stored / unstored", [summary[n]["store_cost"]["ratio"] for n in kv])],
                target=STORE_TARGET,
                target_label=f"target {STORE_TARGET}",
            )
        )
    return out


def vars_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
