"""What a run's records come to: per case and mode, every figure's median (min..max), the ratios
to the baselines, the targets met or not and the checks that failed; as Markdown tables and as
the panels of the PNG. ``runner.py`` writes them; ``report.py`` holds the pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import report
from .report import Check, Figure, Panel, Records, Stat, Target

EMPTY = report.summary([])


@dataclass(frozen=True, slots=True)
class Results:
    modes: list[str]  # in the order of the run
    cases: list[str]
    figures: tuple[Figure, ...]
    summary: dict[str, dict[str, dict[str, Stat]]]  # case -> mode -> figure -> Stat
    ratios: dict[str, dict[str, dict[str, dict[str, Stat]]]]  # case -> mode -> baseline -> figure
    bases: list[str]  # the baselines any ratio was taken to

    @classmethod
    def of(
        cls,
        records: Records,
        modes: Sequence[str],
        cases: Sequence[str],
        figures: Sequence[Figure],
        compared_with: Callable[[str], Sequence[str]],
    ) -> Results:
        summary = {c: {m: report.summarize(r) for m, r in by.items()} for c, by in records.items()}
        ratios = report.ratios(records, [f.key for f in figures if f.ratio], compared_with)
        found = {b for by in ratios.values() for bases in by.values() for b in bases}
        order = [b for m in modes for b in compared_with(m)] + list(modes)
        return cls(
            list(modes),
            list(cases),
            tuple(figures),
            summary,
            ratios,
            [b for b in dict.fromkeys(order) if b in found],
        )

    def get(self, case: str, mode: str, key: str, base: str | None = None) -> Stat:
        if base is None:
            return self.summary.get(case, {}).get(mode, {}).get(key, EMPTY)
        return self.ratios.get(case, {}).get(mode, {}).get(base, {}).get(key, EMPTY)

    def has(self, f: Figure, base: str | None = None) -> bool:
        return any(self.get(c, m, f.key, base) is not EMPTY for c in self.cases for m in self.modes)

    # ---- targets and checks -------------------------------------------------------------------
    def targets(self, targets: Sequence[Target]) -> list[tuple[dict[str, Any], str]]:
        """Per target and mode: the JSON entry and the printed line (the worst case decides)."""
        out = []
        for t in targets:
            for mode in (m for m in self.modes if m.startswith(t.mode_prefix)):
                got = {
                    c: s["median"] for c in self.cases if (s := self.get(c, mode, t.figure, t.baseline))["n"]
                }
                if not got:
                    continue
                worst = (max if t.at_most else min)(got, key=got.__getitem__)
                met = sum(t.met(v) for v in got.values())
                verdict = "met" if met == len(got) else "NOT met"
                text = f"{got[worst]:.3f} -> {verdict}"
                if len(self.cases) > 1:
                    text = f"met in {met} of {len(got)}; worst {got[worst]:.3f} ({worst}) -> {verdict}"
                entry = {"text": t.text, "mode": mode, "figure": t.figure, "baseline": t.baseline}
                entry |= {"limit": t.limit, "at_most": t.at_most, "values": got, "met": met == len(got)}
                out.append((entry, f"target {t.text}, {mode}: {text}"))
        return out

    def failed_checks(self, checks: Sequence[Check]) -> list[str]:
        where = (lambda c: f" at {c}") if len(self.cases) > 1 else (lambda c: "")
        return [
            f"{mode}{where(case)}: {check.failure}"
            for case in self.cases
            for mode in self.modes
            for check in checks
            if self.get(case, mode, check.key).get("all") is False
        ]

    # ---- tables -----------------------------------------------------------------------------------
    def tables(self, case_label: str) -> str:
        """The figures per case and mode, then the ratios to each baseline, as Markdown."""
        multi = len(self.cases) > 1 or self.cases[0] != "all"
        lead = [case_label, "mode"] if multi else ["mode"]
        rows = [(c, m) for c in self.cases for m in self.modes if m in self.summary.get(c, {})]

        def table(cols: list[tuple[str, Figure, str | None]], rows: list[tuple[str, str]]) -> str:
            body = [
                [
                    *((c,) if multi else ()),
                    m,
                    *(report.spread(self.get(c, m, f.key, b), fmt) for fmt, f, b in cols),
                ]
                for c, m in rows
            ]
            heads = [f.label + (f" x {b}" if b else "") for _, f, b in cols]
            return report.markdown([*lead, *heads], body, left=len(lead))

        out = [table([(f.fmt, f, None) for f in self.figures if self.has(f)], rows)]
        cols = [("", f, b) for b in self.bases for f in self.figures if self.has(f, b)]
        if cols:
            ratio_rows = [(c, m) for c, m in rows if m in self.ratios.get(c, {})]
            out += ["", "Ratios per repetition (median, min..max):", table(cols, ratio_rows)]
        return "\n".join(out)

    # ---- plot ---------------------------------------------------------------------------------------
    def panels(self, targets: Sequence[Target]) -> list[Panel]:
        """A panel per figure (or group of figures with one ``panel`` title), then one per
        baseline with the ratios to it; a target's limit as a line."""
        groups: dict[str, list[Figure]] = {}
        for f in self.figures:
            if f.plot and self.has(f):
                groups.setdefault(f.panel or f.label, []).append(f)
        out = []
        for title, figs in groups.items():
            keys = {f.key for f in figs}
            target = next((t for t in targets if not t.baseline and t.figure in keys), None)
            out.append(
                self._panel(title, figs[0].label if len(figs) == 1 else "", figs, None, target, figs[0].log)
            )
        for base in self.bases:
            figs = [f for f in self.figures if self.has(f, base)]
            keys = {f.key for f in figs}
            target = next(
                (t for t in targets if t.baseline == base and t.figure in keys), Target("", "", 1.0)
            )
            out.append(
                self._panel(f"ratio to {base}, per repetition", f"x {base}", figs, base, target, False)
            )
        return out

    def _panel(
        self, title: str, ylabel: str, figs: list[Figure], base: str | None, target: Target | None, log: bool
    ) -> Panel:
        """One case: a bar per mode, a series per figure; several: a bar per case, a series per mode."""
        if len(self.cases) == 1:
            case = self.cases[0]
            cats = [m for m in self.modes if any(self.get(case, m, f.key, base) is not EMPTY for f in figs)]
            series = [(f.label, [self.get(case, m, f.key, base) for m in cats]) for f in figs]
        else:
            cats = self.cases
            series = [
                (m if len(figs) == 1 else f"{m} {f.label}", [self.get(c, m, f.key, base) for c in cats])
                for f in figs
                for m in self.modes
            ]
        label = f"target {target.limit:g}" if target else ""
        return Panel(title, ylabel, cats, series, target.limit if target else None, label, log)
