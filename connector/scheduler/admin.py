"""Operating a running engine's cache: clears applied by the scheduler between steps, and the
namespace records written beside the chunks.

Clears. ``kvlens clear`` reaches a running engine through the admin endpoint
(``extra_config.admin_port``, served from the scheduler process by ``admin_http.py``). The
endpoint's thread picks the namespaces (from the records in the stores and the ones this
engine keys with) and finds which disk chunks belong to them (their records' headers). It
removes the Redis keys first: the remote tier has no index, so once the index forgets the
chunks, a lookup must not find them in Redis (nor promote them back into the CPU tier). Then it
queues the clear and wakes an idle engine, whose next step applies it (``step``): from that step
on no lookup finds the chunks, pinned or not, in the CPU and disk indexes. Their deletion waits
until each request that held pins or a pending lookup at that moment has had its load reported
(and one more step, for asynchronous scheduling), or ``DEFER_LIMIT_S`` has passed: the CPU copies
are then evicted through the plan, in order with its writes, and the endpoint's thread removes
the disk files (and Redis keys written meanwhile) stored before the clear was applied. So CPU
and disk loads in flight complete from the store. A load that races a deletion (a Redis load
already under way, another engine sharing the disk or Redis, or a load held past the limit)
finds the chunk missing, as after an eviction, and vLLM recomputes those blocks: never wrong KV.
Stores after the clear was applied stay. A clear of everything is also announced to routers as
``AllBlocksCleared``; a namespace-scoped one as ``BlockRemoved`` per chunk and tier.

Namespace records. A chunk's name does not reveal its namespace, so each store names it in its
record (``StoreJob.namespace``) and this class writes one ``NamespaceRecord`` per namespace
that stores, once and then every ``REFRESH_S`` while it stores (Redis may evict or a clear may
remove it), on a writer thread: never a round trip per chunk, never on the step loop.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.jobs import CPU, DISK, REMOTE, StepPlan, StoreJob
from ..engine.keys import key_fingerprint
from ..engine.namespace_records import NamespaceRecord, Selector, select
from ..tiers import store_records
from .scheduler_state import SchedulerState
from .shared_marks import SharedMarks

logger = logging.getLogger("vllm.kvlens")

DEFER_LIMIT_S = 60.0  # longest a deletion waits for the loads that pinned its chunks
APPLY_WAIT_S = 30.0  # longest the endpoint waits for the engine to step and apply a clear
REFRESH_S = 60.0  # a storing namespace's record is rewritten this often
MAX_RECORDS = 4096  # namespaces remembered (one per cache salt can be many); others are relearned


@dataclass(eq=False)
class ClearTicket:
    """One clear on its way through the engine: queued, applied, released for deletion."""

    selector: Selector
    fingerprints: frozenset[str]  # namespaces the selector took (from every record known)
    disk_digests: frozenset[str] = frozenset()  # disk chunks of those namespaces (their headers)
    applied: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    applied_at_s: float = 0.0  # wall clock: records written before this are removed
    dropped: dict[str, int] = field(default_factory=dict)  # chunks each tier's index dropped
    waited_for: int = 0  # requests whose loads the deletion waited for
    # the scheduler thread's
    names: dict[str, list[str]] = field(default_factory=dict)
    holders: set[str] = field(default_factory=set)
    applied_mono: float = 0.0
    quiet_steps: int = 0


class CacheAdmin:
    def __init__(self, state: SchedulerState, clock: Callable[[], float] = time.monotonic) -> None:
        self._s = state
        self._clock = clock
        self._queued: deque[ClearTicket] = deque()
        self._waiting: list[ClearTicket] = []
        self._handing_over = False
        self._chunk_ns: dict[str, str] = {}  # CPU and disk chunks this engine stored -> fingerprint
        self._lock = threading.Lock()
        self._records: OrderedDict[str, NamespaceRecord] = OrderedDict()  # namespaces stored under
        self._active: set[str] = set()  # fingerprints that stored since the last refresh
        self._refreshed_at = clock()
        self._stores = _Stores(state)
        self.marks: SharedMarks | None = None  # first-chunk marks other instances explain misses with
        if state.config.local_disk or state.config.remote is not None:
            self.marks = state.shared_marks = SharedMarks(self._stores.all, self._stores.ttl_s)
        self._clearing = threading.Lock()  # one clear at a time through the endpoint
        self._wake: Callable[[], None] | None = None
        self.server: Any = None
        self._forget_token: tuple[str, int] | None = None  # the token file made at start, if any
        extra = state.config.extra_config
        if extra.admin_port is not None:
            self._start_server(extra.admin_host, extra.admin_port + int(state.facts.engine_id or 0))

    def _start_server(self, host: str, port: int) -> None:
        from ..vllm_compat import engine_wakeup
        from .admin_http import AdminServer
        from .admin_token import default_path, engine_token
        from .exit_cleanup import remove_at_exit

        extra = self._s.config.extra_config
        secret = extra.admin_token.get_secret_value() if extra.admin_token is not None else None
        token, where = engine_token(secret, extra.admin_token_file, port)
        if secret is None and not extra.admin_token_file:
            self._forget_token = (token, port)
            remove_at_exit(default_path(port), (token + "\n").encode())  # vLLM SIGKILLs the engine core
        self._wake = engine_wakeup()
        self.server = AdminServer(
            host,
            port,
            {("POST", "/kvlens/clear"): self._clear_route, ("GET", "/kvlens/namespaces"): self._ns_route},
            token,
        )
        logger.info(
            "KVLens admin endpoint on %s, token from %s (kvlens clear %s ...)",
            self.server.url,
            where,
            self.server.url,
        )

    # ---- the scheduler thread ---------------------------------------------------------------
    def step(self, plan: StepPlan) -> None:
        """At each plan: note what it stores, apply queued clears, release finished ones."""
        self._handing_over = False  # evictions issued at the last step are in this plan
        if plan.writes or plan.loads:
            self._note(plan)
        while self._queued:
            self._apply(self._queued.popleft())
        if self._waiting:
            self._release_ready()
        if self._active and self._clock() - self._refreshed_at >= REFRESH_S:
            self._refreshed_at = self._clock()
            with self._lock:
                due = [self._records[fp] for fp in self._active if fp in self._records]
            self._active.clear()
            self._stores.write_records(due, refresh=True)

    def has_work(self) -> bool:
        """A clear is queued or waiting, or its evictions are not in a plan yet: keep stepping."""
        return bool(self._queued or self._waiting or self._handing_over)

    def _note(self, plan: StepPlan) -> None:
        s = self._s
        for job in plan.writes:
            if not isinstance(job, StoreJob):
                continue
            fp = job.namespace
            if CPU in job.tiers or DISK in job.tiers:
                self._chunk_ns[job.name] = fp
            if self.marks is not None and (DISK in job.tiers or REMOTE in job.tiers):
                self._mark_first_chunk(job)
            self._active.add(fp)
            if fp not in self._records:
                self._learn(fp, job.request_id)
        for load in plan.loads:
            promoted = [c.name for c in load.chunks if c.promote_to]
            policy = s.policies.get(load.request_id) if promoted else None
            if policy is not None and policy.namespace is not None:
                fp = key_fingerprint(policy.namespace)
                self._chunk_ns.update(dict.fromkeys(promoted, fp))
        if len(self._chunk_ns) > 2 * sum(len(t) for t in s.tiers.values()) + 4096:
            self._chunk_ns = {
                k: v for k, v in self._chunk_ns.items() if any(k in t for t in s.tiers.values())
            }

    def _mark_first_chunk(self, job: StoreJob) -> None:
        """A request's first chunk went to a shared tier: leave a mark for other instances."""
        s, rid = self._s, job.request_id
        hasher, request = s.hashers.get(rid), s.unfinished.get(rid)
        first = hasher.full_keys(0, s.config.chunk_size) if hasher is not None else []
        if first and first[0].hex == job.name and request is not None and self.marks is not None:
            fingerprint = hasher.fingerprint(request.all_token_ids)  # type: ignore[union-attr]
            if fingerprint is not None:
                self.marks.stored(fingerprint, job.namespace)

    def _learn(self, fp: str, request_id: str) -> None:
        policy = self._s.policies.get(request_id)
        if policy is None or policy.namespace is None or key_fingerprint(policy.namespace) != fp:
            return
        record = NamespaceRecord.of(policy.namespace, self._s.config.chunk_size)
        with self._lock:
            self._records[fp] = record
            while len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)
        self._stores.write_records([record], refresh=False)

    def _apply(self, ticket: ClearTicket) -> None:
        s = self._s
        selector, fps = ticket.selector, set(ticket.fingerprints)
        for tier in s.tiers.values():
            names = [k for k in tier.keys() if selector.takes(self._chunk_ns.get(k, ""), fps)]
            if tier.name == DISK and ticket.disk_digests:
                chosen = set(names)
                names += [d for d in ticket.disk_digests if d in tier and d not in chosen]
            for name in names:
                tier.remove(name)  # pinned too: no lookup finds it from now on
            s.recently_evicted.add(names, tier.name)
            if tier.name == DISK and s.disk_view is not None:
                s.disk_view.note_changed(names)
            ticket.names[tier.name] = names
            ticket.dropped[tier.name] = len(names)
        if selector.everything:
            s.block_events.cleared()
        ticket.holders = set(s.pins.requests()) | set(s.lookups)
        ticket.waited_for = len(ticket.holders)
        ticket.applied_mono = self._clock()
        ticket.applied_at_s = time.time()
        self._waiting.append(ticket)
        ticket.applied.set()
        logger.info("KVLens: cleared %s from the index: %s", selector.describe(), ticket.dropped)

    def _release_ready(self) -> None:
        s = self._s
        for ticket in list(self._waiting):
            ticket.holders = {r for r in ticket.holders if s.pins.holds(r) or r in s.lookups}
            ticket.quiet_steps = 0 if ticket.holders else ticket.quiet_steps + 1
            if ticket.quiet_steps < 2 and self._clock() - ticket.applied_mono < DEFER_LIMIT_S:
                continue
            self._waiting.remove(ticket)
            cpu = [n for n in ticket.names.get(CPU, []) if CPU not in s.tiers or n not in s.tiers[CPU]]
            disk = ticket.names.get(DISK, [])
            s.evict_later(CPU, cpu)  # the workers drop their copies, in order with the plan's writes
            s.block_events.removed(DISK, disk)  # the endpoint's thread removes the files
            for name in (*cpu, *disk):
                self._chunk_ns.pop(name, None)
            self._handing_over = self._handing_over or bool(cpu)
            ticket.released.set()

    # ---- any thread -----------------------------------------------------------------------
    def records(self) -> list[NamespaceRecord]:
        """Namespaces this engine stored under since it started."""
        with self._lock:
            return list(self._records.values())

    def submit(self, ticket: ClearTicket) -> None:
        self._queued.append(ticket)
        if self._wake is not None:
            self._wake()

    def clear(self, selector: Selector) -> dict[str, Any]:
        """Clear through this engine (an endpoint thread): waits for the engine, then deletes."""
        with self._clearing:
            known = self.records() + self._stores.records()
            selected = select(known, selector)
            digests = frozenset() if selector.everything else self._stores.disk_digests(selector, selected)
            # Redis first: once the index drops the chunks, a lookup must not find them there
            # (nor promote them back into the CPU tier). Its loads in flight may fail, as they
            # may when Redis evicts: vLLM recomputes.
            done = self._stores.clear(selector, selected, time.time(), only=REMOTE)
            ticket = ClearTicket(selector, frozenset(selected), digests)
            self.submit(ticket)
            applied = ticket.applied.wait(APPLY_WAIT_S)
            if applied:
                ticket.released.wait(DEFER_LIMIT_S + APPLY_WAIT_S)
            cutoff = ticket.applied_at_s if applied else time.time()
            later = self._stores.clear(selector, selected, cutoff)  # disk; Redis keys written meanwhile
            out: dict[str, Any] = {
                "selection": selector.describe(),
                "namespaces": sorted(selected),
                "engine": {
                    "applied": applied,
                    "index_dropped": ticket.dropped,
                    "waited_for": ticket.waited_for,
                },
            }
            for name, result in later.items():
                earlier = done.get(name)
                if isinstance(earlier, str):  # the first pass failed: say so
                    result = earlier
                elif isinstance(earlier, store_records.Cleared) and isinstance(result, store_records.Cleared):
                    result.add(earlier)
                out[name] = (
                    result.to_json() if isinstance(result, store_records.Cleared) else {"error": result}
                )
            if selector.everything or selected:
                with self._lock:  # rewritten by the next store under them
                    for fp in list(self._records) if selector.everything else selected:
                        self._records.pop(fp, None)
            return out

    def _clear_route(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 200, self.clear(Selector.from_json(body))

    def _ns_route(self, _body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        mine = {r.fingerprint for r in self.records()}
        found = {r.fingerprint: r for r in self._stores.records()}
        found.update({r.fingerprint: r for r in self.records()})
        rows = [{**_record_json(r), "this_engine": r.fingerprint in mine} for r in found.values()]
        return 200, {"namespaces": sorted(rows, key=lambda r: r["fingerprint"])}

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._forget_token is not None:
            from .admin_token import forget

            forget(*self._forget_token)
        if self.marks is not None:
            self.marks.close()  # writes the marks still queued
        self._stores.close()


def _record_json(record: NamespaceRecord) -> dict[str, Any]:
    return json.loads(record.to_json())


class _Stores:
    """The engine's disk directory and Redis prefix as record stores, for the endpoint's clears
    and the namespace record writer (a daemon thread, started on the first write)."""

    def __init__(self, state: SchedulerState) -> None:
        self._config, self._facts = state.config, state.facts
        self._lock = threading.Lock()
        self._made: dict[str, store_records.Store] | None = None
        self._writes: queue.SimpleQueue[tuple[list[NamespaceRecord], bool] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._warned = False

    def ttl_s(self) -> int | None:
        """The expiry of records in Redis (none when the tier's keys never expire)."""
        ttl = self._config.extra_config.remote_ttl_s
        return max(ttl, int(4 * REFRESH_S)) if ttl else None

    def all(self) -> dict[str, store_records.Store]:
        return self._all()

    def _all(self) -> dict[str, store_records.Store]:
        with self._lock:
            if self._made is None:
                self._made = {}
                config, extra = self._config, self._config.extra_config
                if config.local_disk:
                    self._made[DISK] = store_records.DiskRecords(config.local_disk)
                if config.remote is not None:
                    from ..tiers.redis_tier import RedisTier

                    timeout = extra.remote_timeout_s
                    tier = RedisTier(
                        config.remote, self._facts.kv_layout, extra.remote_key_prefix, None, timeout
                    )
                    self._made[REMOTE] = store_records.RedisRecords(tier)
            return self._made

    def records(self) -> list[NamespaceRecord]:
        out = []
        for name, store in self._all().items():
            try:
                out += store.namespaces()[0]
            except OSError as e:
                logger.warning("KVLens: reading namespace records of the %s tier failed: %s", name, e)
        return out

    def disk_digests(self, selector: Selector, selected: set[str]) -> frozenset[str]:
        disk = self._all().get(DISK)
        if disk is None:
            return frozenset()
        return frozenset(c.digest for c in disk.chunks() if selector.takes(c.namespace, selected))

    def clear(
        self, selector: Selector, selected: set[str], cutoff_s: float, only: str | None = None
    ) -> dict[str, store_records.Cleared | str]:
        """Per store: what was removed, or why that failed."""
        out: dict[str, store_records.Cleared | str] = {}
        for name, store in self._all().items():
            if only is not None and name != only:
                continue
            try:
                out[name] = store_records.clear(store, selector, selected, before_s=cutoff_s)
            except OSError as e:
                out[name] = str(e)
        return out

    def write_records(self, records: list[NamespaceRecord], refresh: bool) -> None:
        """Queue records to write (``refresh``: again, though they were written before)."""
        if not records or not (self._config.local_disk or self._config.remote is not None):
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="kvlens-ns-records", daemon=True)
            self._writer.start()
        self._writes.put((records, refresh))

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            records, refresh = item
            ttl = self._config.extra_config.remote_ttl_s
            for store in self._all().values():
                for record in records:
                    try:
                        if isinstance(store, store_records.RedisRecords):  # Redis may have evicted it
                            store.write_namespace(record, max(ttl, int(4 * REFRESH_S)) if ttl else None)
                        elif not store.has_namespace(record.fingerprint):
                            store.write_namespace(record)
                    except OSError as e:
                        self._warn(
                            f"writing the namespace record {record.fingerprint} to {store!r} failed: {e}"
                        )

    def _warn(self, text: str) -> None:
        if not self._warned:
            logger.warning("KVLens: %s (said once)", text)
            self._warned = True
        else:
            logger.debug("KVLens: %s", text)

    def close(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout=2.0)
        with self._lock:
            for store in (self._made or {}).values():
                if isinstance(store, store_records.RedisRecords):
                    store.close()
