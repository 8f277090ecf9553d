"""Time to first token as the prompt grows from 1k to 32k tokens, per KV-cache connector.

    python bench/prompt_scaling.py [--quick] [--lengths 1000,2000,4000,8000,16100,32100]
                                   [--modes none,kvlens,example,lmcache] [--kvlens-tiers cpu]

The headline (ttft_peers.py) measures one prompt length; a connector's hit can keep up with
vLLM's own prefix hit at 3k tokens and still fall behind at 32k, where a hit moves ten times
the KV (512 MiB at 16 KiB a token) while the floor it is compared with barely grows. Every
mode is a vLLM server on the same model (``BENCH_32K``: BENCH with 32k positions) and worker
core. For each length, one prompt of random token ids, in every mode in turn (the order
reversed every other length):

* cold: the prompt's first request (a connector stores its KV);
* --pairs back-to-back pairs, as in ttft_peers.py: the floor (vLLM's own prefix hit), then
  ``POST /reset_prefix_cache`` and the connector's hit, divided by the floor just before it.

Each server is warmed up once, on a prompt of the shortest length, so that lazy set-up does not
land in its first figure; a length's one-off costs (new kernel shapes) land in every mode's
cold request alike. Lengths are not multiples of 128 (vLLM's CPU block; hence 16100, not
16000), so vLLM and the connectors reuse the same whole blocks: on a whole number of blocks
vLLM's own hit recomputes the last block while KVLens serves all but the last token, and the
"floor" is then partly KVLens's. The table also gives cold/hit (what a connector saves at
that length) and KVLens's own load time from ``kv_transfer_params``.

TTFT = wall time of a one-token greedy completion over HTTP (REFERENCE.md section 9).
Target: KVLens hit <= 1.01 x floor at every length.
Prints a table; writes .run/bench/results/prompt_scaling.json and .png (see --out).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import report  # noqa: E402
from bench.lib.models import BENCH_32K, kv_bytes_per_token, vocab_size  # noqa: E402
from bench.lib.runner import Run, ServerShape, add_common_args, rotated, stop_on_signals  # noqa: E402
from bench.lib.workload import VLLM_CPU_BLOCK  # noqa: E402
from bench.ttft_peers import (  # noqa: E402
    HIT_TARGET,
    failing_mode,
    measure_prompt,
    new_record,
    note_short_hits,
    prompt,
    record_summary,
    vars_json,
    verdict,
    warm_up,
)

DEFAULT_MODES = "none,kvlens,example,lmcache"
QUICK_MODES = "none,kvlens,lmcache"
DEFAULT_LENGTHS = "1000,2000,4000,8000,16100,32100"
QUICK_LENGTHS = "500,1500"
HEADROOM_TOKENS = 64  # --max-model-len above the longest prompt (the generated token)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--lengths",
        help=f"comma-separated prompt lengths in tokens (default {DEFAULT_LENGTHS}; --quick {QUICK_LENGTHS})",
    )
    p.add_argument("--pairs", type=int, help="floor/hit pairs per length and mode (default 3; --quick 1)")
    p.add_argument("--seed", type=int, default=11)
    add_common_args(p, DEFAULT_MODES, QUICK_MODES)
    args = p.parse_args(argv)
    if args.pairs is None:
        args.pairs = 1 if args.quick else 3
    args.lengths = parse_lengths(args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS))
    return args


def parse_lengths(text: str) -> list[int]:
    """Distinct positive lengths, shortest first (the order of the table and the plot)."""
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--lengths: not a comma-separated list of integers: {text!r}") from None
    if not lengths or lengths[0] <= 0:
        raise SystemExit(f"--lengths: need positive token counts, got {text!r}")
    return lengths


def server_shape(bench: Run, lengths: list[int]) -> ServerShape:
    """Every server takes the longest prompt: its length, and KV memory for it with room to
    spare (whole GiB, twice its KV); the working set (every prompt's KV, which a connector ends
    up holding) sizes the memory estimate."""
    longest = max(lengths)
    limit = _max_positions(bench.model)
    if longest + HEADROOM_TOKENS > limit:
        raise SystemExit(
            f"the longest prompt ({longest} tokens) + {HEADROOM_TOKENS} exceeds the model's "
            f"max_position_embeddings ({limit}); pass shorter --lengths or another --model"
        )
    aligned = [n for n in lengths if n % VLLM_CPU_BLOCK == 0]
    if aligned:
        bench.note(
            f"lengths {aligned} are whole {VLLM_CPU_BLOCK}-token blocks: vLLM's own hit recomputes the "
            "last block, a connector may serve it, so the floor there is not vLLM's alone"
        )
    per_token = kv_bytes_per_token(Path(bench.model))
    kv_gib = max(1, math.ceil(2 * longest * per_token / 2**30))
    working_set = (sum(lengths) + min(lengths)) * per_token / 1e9  # + the warm-up prompt
    return ServerShape(
        max_model_len=longest + HEADROOM_TOKENS, kv_space_gib=kv_gib, working_set_gb=working_set
    )


def _max_positions(model: Path) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"])


def run(args: argparse.Namespace) -> int:
    bench = Run("prompt_scaling", args, DEFAULT_MODES, QUICK_MODES, full_spec=BENCH_32K)
    lengths: list[int] = args.lengths
    bench.header(f"TTFT vs prompt length ({', '.join(map(str, lengths))} tokens): cold, floor, connector hit")
    shape = server_shape(bench, lengths)
    vocab = vocab_size(Path(bench.model))
    prompts = {n: prompt(args.seed * 100_003 + n, n, vocab) for n in lengths}
    warm = prompt(args.seed * 100_003 - 1, lengths[0], vocab)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with stop_on_signals():
        for live in bench.batches(shape):
            for lm in list(live):
                with failing_mode(bench, live, lm, results, {}):
                    warm_up(lm, warm)
                    results[lm.mode.name] = {str(n): new_record() for n in lengths}
            for i, n in enumerate(lengths):
                for lm in rotated(live, i):
                    with failing_mode(bench, live, lm, results, {}):
                        rec = results[lm.mode.name][str(n)]
                        measure_prompt(lm, prompts[n], args.pairs, rec)
                        print(f"   {n:6d} tokens: {lm.mode.name:12s} {_progress(rec)}", flush=True)
    summary = summarize(bench, results, lengths)
    bench.finish(
        output(bench, shape, summary, results),
        table(bench, summary, lengths),
        "TTFT vs prompt length per connector",
        panels(bench, summary, lengths),
    )
    return 0


def output(bench: Run, shape: ServerShape, summary: dict, results: dict) -> dict[str, Any]:
    """The JSON file's content (``meta`` is added by ``Run.finish``); lengths are string keys."""
    conn = {m: by for m, by in summary.items() if _conn(by)}
    return {
        "settings": vars_json(bench.args),
        "lengths": bench.args.lengths,
        "server": {"max_model_len": shape.max_model_len, "kv_space_gib": shape.kv_space_gib},
        "ratios": {m: {n: s["pair_ratio"]["median"] for n, s in by.items()} for m, by in conn.items()},
        "cold_over_hit": {
            m: {n: s["cold_over_hit"]["median"] for n, s in by.items()} for m, by in conn.items()
        },
        "unavailable": dict(bench.skipped),
        "results": {
            m: {n: {"summary": summary[m][n], "raw": rec} for n, rec in by.items()}
            for m, by in results.items()
        },
    }


def _conn(by_length: dict[str, dict[str, Any]]) -> bool:
    return any(s["connector"] for s in by_length.values())


def _progress(rec: dict[str, Any]) -> str:
    load = f", KVLens load {rec['kvlens_load_ms'][-1]:.1f} ms" if rec["kvlens_load_ms"] else ""
    return (
        f"cold {rec['cold_s'][-1]:.3f} s, floor {rec['floor_s'][-1]:.3f} s, hit {rec['hit_s'][-1]:.3f} s "
        f"({rec['hit_cached'][-1]} cached tokens{load})"
    )


def summarize(bench: Run, results: dict, lengths: list[int]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per mode and length (as a string, the JSON key): ``record_summary`` of its requests."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mode in bench.modes:
        by_length = results.get(mode.name)
        if by_length is None:
            continue
        out[mode.name] = {}
        for n in lengths:
            s = record_summary(by_length[str(n)], mode.connector)
            note_short_hits(bench, f"{mode.name} at {n} tokens", s)
            out[mode.name][str(n)] = s
    return out


def table(bench: Run, summary: dict[str, Any], lengths: list[int]) -> str:
    t = report.Table(
        [
            "mode",
            "tokens",
            "cold s",
            "floor s",
            "hit s",
            "hit/floor (pairs)",
            "cold/hit",
            "hit tokens",
            "load ms",
        ]
    )
    for mode in bench.modes:
        by_length = summary.get(mode.name)
        if by_length is None:
            t.add_span(mode.name, bench.unavailable(mode))
            continue
        for n in lengths:
            s = by_length[str(n)]
            conn = s["connector"] is not None
            t.add(
                mode.name,
                n,
                report.spread(s["cold_s"]),
                report.spread(s["floor_s"]),
                report.spread(s["hit_s"]) if conn else f"({report.spread(s['hit_s'])} recompute)",
                report.spread(s["pair_ratio"]) if conn else "-",
                report.spread(s["cold_over_hit"], "{:.1f}") if conn else "-",
                f"{s['hit_cached_tokens']['median']:.0f}/{s['floor_cached_tokens']['median']:.0f}",
                report.spread(s["kvlens_load_ms"], "{:.1f}") if "kvlens_load_ms" in s else "-",
            )
    lines = [t.render(), ""]
    lines.append(
        "hit/floor: each connector hit over the vLLM prefix hit measured just before it (median, min..max)."
    )
    lines.append("cold/hit: the prompt's cold request over each connector hit (what the connector saves).")
    lines.append("hit tokens: cached tokens of a connector hit / of vLLM's own hit (the rest is recomputed).")
    lines.append("load ms: KVLens's own load time of the hit, from the response's kv_transfer_params.")
    for name, by_length in summary.items():
        if any(s["connector"] == "kvlens" for s in by_length.values()):
            worst = max(lengths, key=lambda n: by_length[str(n)]["pair_ratio"]["median"])
            ratio = by_length[str(worst)]["pair_ratio"]["median"]
            met = sum(by_length[str(n)]["pair_ratio"]["median"] <= HIT_TARGET for n in lengths)
            lines.append(
                f"target KVLens hit <= {HIT_TARGET} x floor at every length, {name}: met at {met} of "
                f"{len(lengths)}; worst {ratio:.3f} at {worst} tokens -> {verdict(ratio, HIT_TARGET)}"
            )
    return "\n".join(lines)


def panels(bench: Run, summary: dict[str, Any], lengths: list[int]) -> list[report.Panel]:
    names = [m.name for m in bench.modes if m.name in summary]
    conn = [n for n in names if _conn(summary[n])]
    cats = [str(n) for n in lengths]

    def series(modes: list[str], key: str) -> list[report.Series]:
        return [report.Series(m, [summary[m][c][key] for c in cats]) for m in modes]

    return [
        report.Panel(
            "connector hit / floor vs prompt tokens (back-to-back pairs)",
            "ratio",
            cats,
            series(conn, "pair_ratio"),
            target=HIT_TARGET,
            target_label=f"target {HIT_TARGET}",
        ),
        report.Panel(
            "cold / connector hit vs prompt tokens (what a hit saves)",
            "ratio",
            cats,
            series(conn, "cold_over_hit"),
            log=True,
        ),
        report.Panel(
            "TTFT of a hit after the flush vs prompt tokens (no connector: a recompute)",
            "seconds",
            cats,
            series(names, "hit_s"),
            log=True,
        ),
        report.Panel(
            "TTFT of the floor: vLLM's own prefix hit", "seconds", cats, series(names, "floor_s"), log=True
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
