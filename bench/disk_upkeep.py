"""What keeping a shared disk tier's index in step costs, against the directory's size (no vLLM).

For 10,000, 100,000 and 1,000,000 chunk files (empty files: a scan only reads names and
times), side by side in one process:

- **subdirectories**: this version. Files under 4096 subdirectories by digest prefix; a rescan
  stats the root and every subdirectory and re-lists those whose time moved, reading only files
  it has not seen (new inodes) or whose use mark is new (``connector/tiers/disk_scan.py``).
- **flat (before)**: the version before, copied below verbatim: every rescan lists the flat
  directory and stats every file, then diffs the whole view.

Each round, while the rescans run at the default ``disk_scan_interval_s`` of 1 s, a little
changes, as another engine would do it: ``--writes`` new chunk files, ``--deletes`` deleted,
``--touches`` loaded (the watcher's pin: the file's access time, and in this version the
chunk's use mark). Upkeep per rescan is the process CPU time of the rescan and of merging its
delta into the scheduler's index (``SharedDiskView.merge``), the median over ``--rounds``
rounds; at a 1 s interval it is also the share of a core the watcher keeps busy. Each rescan is
checked to find exactly the changes made. Then ``--idle-rounds`` rescans with nothing changed
(the median of all but the first, which still re-lists what the last round changed).
Start-up indexing is the first (full) scan plus its merge into an empty index, with the page
cache warm (the files were just created; a cold cache after a reboot reads the directories
from the device and costs more for both layouts).

    python bench/disk_upkeep.py [--sizes 10000,100000,1000000] [--rounds 10] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from connector.engine.index import TierIndex  # noqa: E402
from connector.scheduler.disk_sync import MERGE_PER_STEP, SharedDiskView  # noqa: E402
from connector.tiers.disk import DiskTier, FileInfo, chunk_path, legacy_path  # noqa: E402
from connector.tiers.disk_scan import DirectoryScanner, ScanDelta, diff  # noqa: E402

INTERVAL_S = 1.0  # disk_scan_interval_s's default
BUDGET = 1 << 60  # no evictions: the bench measures keeping in step, not deleting

# ---- the version before: a flat directory, listed and stat'ed whole on every rescan ---------
_OLD_NAME = re.compile(r"^([0-9a-f]{32})\.r(\d+)\.kvlens$")
_OLD_TOUCHED_NS = 1_000_000


def old_scan(root: str, world_size: int) -> dict[str, FileInfo]:
    """``connector.tiers.disk.scan`` before the subdirectories (verbatim but for names)."""
    ranks: dict[str, dict[int, os.stat_result]] = {}
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return {}
    for entry in entries:
        m = _OLD_NAME.match(entry.name)
        if not m:
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        ranks.setdefault(m.group(1), {})[int(m.group(2))] = st
    out: dict[str, FileInfo] = {}
    for digest, stats in ranks.items():
        if all(r in stats for r in range(world_size)):
            files = [stats[r] for r in range(world_size)]
            out[digest] = FileInfo(
                max(s.st_size for s in files),
                max(s.st_mtime_ns for s in files),
                max(_old_used_ns(s) for s in files),
            )
    return out


def _old_used_ns(st: os.stat_result) -> int:
    return st.st_atime_ns if st.st_atime_ns > st.st_mtime_ns + _OLD_TOUCHED_NS else 0


class OldWatcher:
    """The rescan the watcher thread ran before (``DiskWatcher._scan``), without the thread."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._last: dict[str, FileInfo] = {}

    def scan(self) -> ScanDelta:
        started = time.time()
        now = old_scan(self.root, 1)
        delta = diff(self._last, now, started)
        self._last = now
        return delta


# ---- both layouts, changed the same way ----------------------------------------------------
class Layout:
    def __init__(self, label: str, root: str, flat: bool) -> None:
        self.label, self.root, self.flat = label, root, flat
        self.scanner: Any = OldWatcher(root) if flat else DirectoryScanner(root, 1)
        self.index = TierIndex("disk", BUDGET)
        self.feed = Feed()
        self.view = SharedDiskView(self.index, self.feed, evicts=True, grace_s=30.0)  # type: ignore[arg-type]
        self._tier = DiskTier(root, "bench", grace_s=0)

    def path(self, digest: str) -> str:
        name = f"{digest}.r0"
        return legacy_path(self.root, name) if self.flat else chunk_path(self.root, name)

    def create(self, digests: list[str]) -> None:
        for d in digests:
            path = self.path(d)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.close(fd)
            written = time.time_ns()
            os.utime(path, ns=(written + 1, written))  # as DiskTier.put leaves it

    def touch(self, digests: list[str]) -> None:
        for d in digests:
            if self.flat:  # the old touch: the file's access time only
                st = os.stat(self.path(d))
                os.utime(self.path(d), ns=(time.time_ns(), st.st_mtime_ns))
            else:  # as the watcher applies a lookup's pin: the file's time and the use mark
                self._tier.touch(f"{d}.r0")
                self._tier.mark_used(d)

    def delete(self, digests: list[str]) -> None:
        for d in digests:
            os.unlink(self.path(d))

    def upkeep(self) -> tuple[ScanDelta, float, float]:
        """One rescan and its merge: the delta, CPU seconds, wall seconds."""
        gc.collect()
        cpu, wall = time.process_time(), time.perf_counter()
        delta = self.scanner.scan()
        self.feed.deltas.extend(delta.pieces(MERGE_PER_STEP))  # as the watcher queues it
        self.feed.last_scan_started = delta.started
        while self.feed.deltas:  # one merge per engine step
            self.view.merge()
        return delta, time.process_time() - cpu, time.perf_counter() - wall


class Feed:
    """Stands in for the watcher thread: the bench hands the view each delta itself."""

    def __init__(self) -> None:
        self.deltas: list[ScanDelta] = []
        self.last_scan_started = 0.0

    def holds(self, name: str) -> None:
        return None  # nothing is rechecked: the bench makes no changes of the view's own

    def take(self, max_changes: int | None = None) -> list[ScanDelta]:
        out: list[ScanDelta] = []
        while self.deltas and (max_changes is None or sum(len(d) for d in out) < max_changes):
            out.append(self.deltas.pop(0))
        return out

    def touch(self, names: Any) -> None:
        pass

    def stop(self) -> None:
        pass


def digests(start: int, count: int) -> list[str]:
    return [
        hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()
        for i in range(start, start + count)
    ]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def run_size(size: int, args: argparse.Namespace, work: str) -> dict[str, Any]:
    layouts = [
        Layout("subdirectories", os.path.join(work, f"new-{size}"), flat=False),
        Layout("flat (before)", os.path.join(work, f"old-{size}"), flat=True),
    ]
    existing = digests(0, size)
    result: dict[str, Any] = {"files": size}
    for layout in layouts:
        os.makedirs(layout.root, exist_ok=True)
        _, _, made_s = timed(lambda layout=layout: layout.create(existing))
        print(f"  {layout.label}: created {size:,} files in {made_s:.1f} s", flush=True)
    time.sleep(1.5)  # let every directory's time fall out of the racy window
    for layout in layouts:
        rss = rss_mb()
        (delta, cpu, wall) = layout.upkeep()
        assert len(delta.added) == size and len(layout.index) == size, (layout.label, len(delta.added))
        result[layout.label] = {
            "startup_index_cpu_s": cpu,
            "startup_index_wall_s": wall,
            "view_and_index_rss_mb": rss_mb() - rss,
        }
        print(f"  {layout.label}: start-up index {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
    next_new = size
    per_round: dict[str, list[tuple[float, float]]] = {layout.label: [] for layout in layouts}
    for r in range(args.rounds):
        new = digests(next_new, args.writes)
        next_new += args.writes
        gone = existing[r * args.deletes : (r + 1) * args.deletes]
        used = existing[-(r + 1) * args.touches : len(existing) - r * args.touches]
        for layout in layouts:
            layout.create(new)
            layout.delete(gone)
            layout.touch(used)
        time.sleep(INTERVAL_S)  # the watcher's interval between rescans
        for layout in layouts:
            delta, cpu, wall = layout.upkeep()
            assert set(delta.added) == set(new), (layout.label, len(delta.added))
            assert delta.removed == set(gone), (layout.label, len(delta.removed))
            assert delta.used == set(used), (layout.label, len(delta.used), len(used))
            per_round[layout.label].append((cpu, wall))
    idle: dict[str, list[float]] = {layout.label: [] for layout in layouts}
    for _ in range(args.idle_rounds):  # nothing changes (the first also re-lists the last round's)
        time.sleep(INTERVAL_S)
        for layout in layouts:
            delta, cpu, _wall = layout.upkeep()
            idle[layout.label].append(cpu)
    for layout in layouts:
        if idle[layout.label][1:]:
            result[layout.label]["idle_cpu_s_per_rescan"] = statistics.median(idle[layout.label][1:])
        cpus = [c for c, _ in per_round[layout.label]]
        walls = [w for _, w in per_round[layout.label]]
        cpu = statistics.median(cpus)
        result[layout.label].update(
            upkeep_cpu_s_per_rescan=cpu,
            upkeep_wall_s_per_rescan=statistics.median(walls),
            # the watcher sleeps the interval after each rescan: its share of a core
            core_share_at_1s=cpu / (statistics.median(walls) + INTERVAL_S),
        )
        if isinstance(layout.scanner, DirectoryScanner):
            cost = layout.scanner.cost
            result[layout.label]["scanner_cost_total"] = {
                "dirs_checked": cost.dirs_checked,
                "dirs_listed": cost.dirs_listed,
                "files_stated": cost.files_stated,
            }
    for layout in layouts:
        shutil.rmtree(layout.root)
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    new, old = "subdirectories", "flat (before)"
    print()
    print("| chunk files | upkeep CPU ms per rescan: subdirectories | flat (before) | ratio |", end="")
    print(" nothing changed: subdirectories | flat |", end="")
    print(" share of a core at 1 s: subdirectories | flat | start-up index s: subdirectories | flat |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        a, b = r[new], r[old]
        cells = (
            f"{r['files']:,}",
            f"{1000 * a['upkeep_cpu_s_per_rescan']:.1f}",
            f"{1000 * b['upkeep_cpu_s_per_rescan']:.1f}",
            f"{b['upkeep_cpu_s_per_rescan'] / a['upkeep_cpu_s_per_rescan']:.0f}x",
            f"{1000 * a.get('idle_cpu_s_per_rescan', float('nan')):.1f}",
            f"{1000 * b.get('idle_cpu_s_per_rescan', float('nan')):.1f}",
            f"{100 * a['core_share_at_1s']:.1f}%",
            f"{100 * b['core_share_at_1s']:.1f}%",
            f"{a['startup_index_wall_s']:.2f} ({a['startup_index_cpu_s']:.2f} CPU)",
            f"{b['startup_index_wall_s']:.2f} ({b['startup_index_cpu_s']:.2f} CPU)",
        )
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--writes", type=int, default=8, help="new chunk files per interval")
    p.add_argument("--deletes", type=int, default=2, help="chunk files deleted per interval")
    p.add_argument("--touches", type=int, default=4, help="chunk files loaded per interval")
    p.add_argument("--idle-rounds", type=int, default=4, help="rescans with nothing changed, after")
    p.add_argument("--dir", default=None, help="where to build the directories (default: a temp dir)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="kvlens-disk-upkeep-", dir=args.dir) as work:
        for size in (int(s) for s in args.sizes.split(",")):
            print(f"{size:,} chunk files", flush=True)
            results.append(run_size(size, args, work))
    print_table(results)
    report = {
        "changes_per_interval": {"writes": args.writes, "deletes": args.deletes, "touches": args.touches},
        "rounds": args.rounds,
        "results": results,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
