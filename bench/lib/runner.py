"""The one runner of every benchmark in ``bench/``: a script declares its workload and what it
measures; the runner parses the shared options, opens the modes, measures them in turns and
writes the one report format (``report.py``: JSON, Markdown tables, an optional PNG).

A mode is one of the things compared side by side: a vLLM server configured one way
(``ServedBenchmark`` in ``served.py``: no connector, KVLens per tier, ExampleConnector, LMCache)
or anything in this process (a tier, a package revision, telemetry on or off). Every
repetition measures every mode once, in an order reversed every repetition, so that whatever
else the machine does weighs on every mode alike; a ratio to a baseline mode is taken per
repetition. A case is one point of a sweep (a prompt length, a grid cell) with its own
repetitions. A complete benchmark, ``bench/copy_cost.py``::

    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
    from bench.lib.runner import Benchmark, Figure, Option, Side, main


    class CopyCost(Benchmark):  # what copying a buffer costs
        name = "copy_cost"
        options = {"mb": Option(64, 4, "buffer size")}  # full run, --quick, help: --mb
        figures = (Figure("ms", "ms per copy", "{:.2f}", ratio=True),)
        baselines = ("none",)  # every other mode's ratios are to this one
        repeats = (7, 2)  # full run, --quick

        def sides(self):
            return [Side("none"), Side("copy")]

        def measure(self, side, case, rep):
            buf = bytearray(self.args.mb << 20)
            t0 = time.perf_counter()
            if side.name == "copy":
                bytes(buf)
            return {"ms": (time.perf_counter() - t0) * 1e3}

    if __name__ == "__main__":
        sys.exit(main(CopyCost))

``python bench/copy_cost.py [--quick] [--mb 8] [--repeats 9] [--modes none,copy] [--out DIR]``
prints the medians (min..max) and the ratios to ``none`` as Markdown and writes
``DIR/copy_cost.json`` and ``.png`` (tests/bench/test_runner.py runs this example). Other
hooks: ``cases`` (a sweep), ``setup`` (a context around the whole run), ``warm_up``,
``start_case``/``end_case``, ``workload`` (what the JSON records about it), ``targets``,
``checks``, ``legend``. With servers: subclass ``ServedBenchmark``, define ``server_shape``;
``measure`` then gets a ``LiveMode`` with its ``client``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import report
from .paths import RUN_DIR
from .report import Check, Figure, Record, Records, Target
from .results import Results

__all__ = [
    "Benchmark",
    "Case",
    "Check",
    "Figure",
    "Option",
    "Side",
    "SideFailed",
    "Target",
    "each",
    "main",
    "timed",
]

NOISE_NOTE = (
    "Timings come from a small shared machine: compare the ratios measured side by side in this run, "
    "not absolute times across runs."
)


class SideFailed(Exception):
    """The mode cannot go on (its server died, its client could not run); the others go on."""


@dataclass(frozen=True, slots=True)
class Side:
    """A mode measured in this process."""

    name: str  # as given to --modes and used in the JSON
    label: str = ""


@dataclass(frozen=True, slots=True)
class Option:
    """A workload option ``--name``: its default in a full run and with --quick (``...``: the
    same), its help; a bool default makes a flag."""

    default: Any
    quick: Any = ...
    help: str = ""
    type: Callable[[str], Any] | None = None  # default: the default's type (str for None)
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()  # other names of the option ("--rounds" for --repeats)

    def add_to(self, g: argparse._ArgumentGroup, name: str) -> None:
        flags = ("--" + name.replace("_", "-"), *self.aliases)
        if isinstance(self.default, bool):
            g.add_argument(*flags, dest=name, action="store_true", help=self.help)
            return
        quick = "" if self.quick is ... or self.quick == self.default else f"; --quick {self.quick}"
        shown = f" (default {self.default}{quick})" if self.default is not None else ""
        kind = self.type or (str if self.default is None else type(self.default))
        g.add_argument(*flags, dest=name, type=kind, choices=self.choices, help=f"{self.help}{shown}".strip())

    def value(self, quick: bool) -> Any:
        return self.quick if quick and self.quick is not ... else self.default


@dataclass(frozen=True, slots=True)
class Case:
    """One point of a sweep; ``repeats`` overrides --repeats for it."""

    name: str
    params: Any = None
    repeats: int | None = None


class Benchmark:
    """A benchmark: set the class attributes, override ``sides`` and ``measure`` (and any hook)."""

    name = ""  # the result files' stem
    title = ""  # the plot's title (default: the script's first docstring line)
    figures: tuple[Figure, ...] = ()  # what records hold, in table order
    baselines: tuple[str, ...] = ()  # modes every other mode is divided by (``compared_with``)
    targets: tuple[Target, ...] = ()
    checks: tuple[Check, ...] = ()
    legend: tuple[str, ...] = ()  # lines printed under the tables
    case_label = "case"  # the table's case column
    repeats = (3, 2)  # --repeats of a full run and of --quick
    repeat_flags: tuple[str, ...] = ()  # the script's own names for --repeats (--rounds, --pairs)
    mode_flags: tuple[str, ...] = ()  # ... and for --modes
    seed = 0
    options: dict[str, Option] = {}  # the workload's own options
    default_modes: str | None = None  # None: every mode ``sides`` lists
    quick_modes: str | None = None
    failures: tuple[type[BaseException], ...] = (SideFailed,)  # what drops a mode, not the run
    progress_each_turn = False  # a line per measurement (slow ones) rather than per case

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = bool(args.quick)
        self.notes: list[str] = []
        self.skipped: dict[str, str] = {}
        self.started = time.time()
        self.load_before = os.getloadavg()

    # ---- what a script declares ------------------------------------------------------------
    def sides(self) -> Sequence[Any]:
        raise NotImplementedError

    def cases(self) -> list[Case]:
        return [Case("all")]

    def applies(self, side: Any, case: Case) -> bool:
        return True

    def compared_with(self, side: str) -> Sequence[str]:
        return self.baselines

    def workload(self) -> dict[str, Any]:
        """What the JSON records about the workload (sizes, versions, commands)."""
        return {}

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """Around the whole run: what every mode needs (a server, a checkpoint, an engine)."""
        yield

    def warm_up(self, side: Any) -> None:
        pass

    def start_case(self, case: Case, sides: Sequence[Any]) -> None:
        pass

    def end_case(self, case: Case) -> None:
        pass

    def measure(self, side: Any, case: Case, rep: int) -> Record:
        raise NotImplementedError

    def alive(self, side: Any) -> bool:
        """After each measurement: False drops the mode (a server that stopped answering)."""
        return True

    # ---- modes ------------------------------------------------------------------------------
    @property
    def result_name(self) -> str:
        return self.name

    def chosen_sides(self) -> list[Any]:
        """``sides`` as --modes (or the default) picks and orders them."""
        sides = list(self.sides())
        spec = self.args.modes or (self.quick_modes if self.quick else self.default_modes)
        if not spec:
            return sides
        known = {s.name: s for s in sides}
        names = [n.strip() for n in spec.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"--modes: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        return [known[n] for n in names]

    def open_sides(self) -> Iterator[list[Any]]:
        """Batches of modes measured together (servers: as many as memory allows)."""
        yield list(self.modes)

    def close_side(self, side: Any) -> None:
        pass

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"NOTE: {text}", flush=True)

    def skip(self, side: Any, why: str) -> None:
        """The mode has no (more) figures: the report lists it as unavailable, and why."""
        self.skipped[side.name] = why
        print(f"   mode {side.name} skipped: {why}", flush=True)

    def drop(self, batch: list[Any], side: Any, why: str) -> None:
        batch.remove(side)
        self.close_side(side)
        self.skip(side, why)

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> int:
        self.modes = self.chosen_sides()
        self.case_list = self.cases()
        self.header()
        records: Records = {}
        with stop_on_signals(), self.setup():
            for batch in self.open_sides():
                self._measure_batch(batch, records)
        self.report(records)
        return 0 if records else 1

    def _measure_batch(self, batch: list[Any], records: Records) -> None:
        for side in list(batch):
            self._guarded(batch, side, "failed to warm up", lambda s=side: self.warm_up(s))
        turn = 0
        for case in self.case_list:
            self.start_case(case, [s for s in batch if self.applies(s, case)])
            try:
                repeats = case.repeats or self.args.repeats
                for rep in range(repeats):
                    for side in rotated(batch, turn):
                        if self.applies(side, case):
                            self._turn(batch, side, case, rep, records)
                    turn += 1
            finally:
                self.end_case(case)
            if not self.progress_each_turn:
                self._print_case(case, records.get(case.name, {}))

    def _turn(self, batch: list[Any], side: Any, case: Case, rep: int, records: Records) -> None:
        where = f"repetition {rep + 1}" + (f" of {case.name}" if len(self.case_list) > 1 else "")
        rec = self._guarded(batch, side, f"failed in {where}", lambda: self.measure(side, case, rep))
        if not rec:  # nothing to measure in this mode this time
            return
        records.setdefault(case.name, {}).setdefault(side.name, []).append({"repetition": rep, **rec})
        if self.progress_each_turn:
            print(f"   {where}: {side.name:12s} {self.progress(rec)}", flush=True)
        if not self.alive(side):
            self.drop(batch, side, f"it stopped answering in {where}")

    def _guarded(self, batch: list[Any], side: Any, what: str, fn: Any) -> Any:
        try:
            return fn()
        except self.failures as e:
            self.drop(batch, side, f"{what} ({report.first_line(str(e), 160)})")
            return None

    def progress(self, rec: Record) -> str:
        parts = []
        for f in self.figures:
            value = rec.get(f.key)
            if isinstance(value, list) and value:
                value = value[-1]
            if isinstance(value, int | float) and not isinstance(value, bool):
                parts.append(f"{f.label} {f.fmt.format(value)}")
        return ", ".join(parts[:6])

    def _print_case(self, case: Case, by_side: dict[str, list[Record]]) -> None:
        figs = [f for f in self.figures if any(f.key in r for recs in by_side.values() for r in recs)][:3]
        cells = []
        for side, recs in by_side.items():
            stats = report.summarize(recs)
            cells.append(f"{side} " + ", ".join(report.spread(stats.get(f.key), f.fmt) for f in figs))
        head = f"{case.name}: " if len(self.case_list) > 1 else ""
        print(f"   {head}{'; '.join(cells)}  ({', '.join(f.label for f in figs)})", flush=True)

    # ---- the report ---------------------------------------------------------------------------
    def header(self) -> None:
        print(f"== {self.name}: {self.title or self._doc_title()}", flush=True)
        names = ", ".join(s.name for s in self.modes)
        print(f"   {'--quick' if self.quick else 'full run'}; modes: {names}", flush=True)
        load = ", ".join(f"{x:.2f}" for x in self.load_before)
        isa = report.cpu_isa()
        print(f"   {os.cpu_count()} CPUs ({isa}), load average {load}", flush=True)

    def _doc_title(self) -> str:
        doc = (
            getattr(sys.modules.get(type(self).__module__), "__doc__", None)
            or type(self).__doc__
            or self.name
        )
        return doc.strip().splitlines()[0].rstrip(".")

    def report(self, records: Records) -> None:
        names = [s.name for s in self.modes]
        got = Results.of(records, names, [c.name for c in self.case_list], self.figures, self.compared_with)
        for text in got.failed_checks(self.checks):
            self.note(text)
        targets = got.targets(self.targets)
        data = {
            "benchmark": self.name,
            "meta": self.meta(),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()},
            "workload": self.workload(),
            "modes": {s.name: self.describe(s) for s in self.modes},
            "cases": got.cases,
            "figures": {f.key: f.label for f in self.figures},
            "baselines": {m: list(self.compared_with(m)) for m in names},
            "summary": got.summary,
            "ratios": got.ratios,
            "targets": [entry for entry, _ in targets],
            "unavailable": dict(self.skipped),
            "raw": records,
        }
        json_path, png_path = self.out_paths()
        report.write_json(json_path, data)
        png = report.plot(
            png_path, self.title or self._doc_title(), got.panels(self.targets), self.footnote()
        )
        print(f"\n{got.tables(self.case_label)}")
        for line in [*self.legend, *(text for _, text in targets)]:
            print(line)
        for name, why in self.skipped.items():
            print(f"{name}: unavailable: {report.first_line(why, 200)}")
        for text in self.notes:
            print(f"NOTE: {text}")
        print(NOISE_NOTE)
        print(f"wrote {json_path}" + (f" and {png}" if png else ""), flush=True)

    def describe(self, side: Any) -> dict[str, Any]:
        return {"label": getattr(side, "label", "")}

    def out_paths(self) -> tuple[Path, Path]:
        """--out is a folder, or the JSON file's path (the PNG goes beside it)."""
        out = Path(self.args.out)
        if out.suffix == ".json":
            return out, out.with_suffix(".png")
        return out / f"{self.result_name}.json", out / f"{self.result_name}.png"

    def meta(self) -> dict[str, Any]:
        started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started))
        run = {
            "argv": sys.argv[1:],
            "quick": self.quick,
            "modes": [s.name for s in self.modes],
            "notes": self.notes,
        }
        run |= {"started": started, "seconds": round(time.time() - self.started, 1)}
        return run | report.environment(self.load_before)

    def footnote(self) -> str:
        load = "/".join(f"{x:.1f}" for x in self.load_before)
        parts = [
            f"{self.name} {'--quick' if self.quick else ''}",
            f"{os.cpu_count()} CPUs ({report.cpu_isa()}), load {load} at start",
        ]
        parts += [time.strftime("%Y-%m-%d %H:%M"), "; ".join(f"{k} skipped" for k in self.skipped)]
        return " | ".join(p for p in parts if p) + "\n" + NOISE_NOTE

    # ---- the command line -----------------------------------------------------------------------
    @classmethod
    def common_options(cls) -> dict[str, Option]:
        """The options every benchmark has (the workload's own are in ``options``)."""
        return {
            "quick": Option(False, help="small and fast: keeps the script working"),
            "modes": Option(
                None,
                help=f"comma-separated modes to compare ({cls.default_modes or 'all'})",
                aliases=cls.mode_flags,
            ),
            "repeats": Option(*cls.repeats, "repetitions, modes in turns", aliases=cls.repeat_flags),
            "seed": Option(cls.seed),
            "out": Option(
                RUN_DIR / "results", help="a folder for NAME.json and .png, or a .json path", type=Path
            ),
        }

    @classmethod
    def parse_args(cls, argv: list[str] | None = None) -> argparse.Namespace:
        doc = getattr(sys.modules.get(cls.__module__), "__doc__", None) or cls.__doc__
        p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        groups = {"workload": cls.options, "run (shared by every benchmark)": cls.common_options()}
        for title, options in groups.items():
            g = p.add_argument_group(title)
            for name, opt in options.items():
                opt.add_to(g, name)
        args = p.parse_args(argv)
        for options in groups.values():
            for name, opt in options.items():
                if getattr(args, name) is None:
                    setattr(args, name, opt.value(args.quick))
        if args.repeats < 1:
            p.error("--repeats must be at least 1")
        return args


def main(cls: type[Benchmark], argv: list[str] | None = None) -> int:
    """Parse the command line, run the benchmark, report; the exit status."""
    return cls(cls.parse_args(argv)).run()


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def each(fn: Callable[[Any], object], items: Iterable[Any]) -> None:
    """``fn`` on every item, each result dropped at once (the next may reuse its memory)."""
    for item in items:
        fn(item)


def rotated(items: Sequence[Any], turn: int) -> list[Any]:
    """The order of ``turn``: as given, then reversed, and so on."""
    return list(items) if turn % 2 == 0 else list(reversed(items))


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, through the code that stops servers."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, _exit) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
