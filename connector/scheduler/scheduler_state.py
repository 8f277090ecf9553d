"""The scheduler half's shared tables, and the few rules every part of it applies to them.

The lookup, the step planner, the worker feedback and the responses each read and change the
same state: the index of every tier, pins, per-request policies, hashers, lookups and
trackers, suspect blocks and the tiers' health. It lives here, owned by no one part, so that
those parts import this module and never each other.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..config.loading import ConfigError, KVLensConfig
from ..engine.block_events import BlockEvents
from ..engine.facts import EngineFacts
from ..engine.held_stores import HeldStores
from ..engine.index import PinTable, TierIndex
from ..engine.jobs import CPU, DISK, REMOTE, Eviction, LoadJob
from ..engine.keys import PrefixHasher
from ..engine.load_speed import TierSpeeds
from ..engine.namespaces import FirstChunkNamespaces
from ..engine.outcomes import FailureReason, LoadOutcome, TierState
from ..engine.policy import RecentlyEvicted, RequestPolicy
from ..engine.retention_rules import RetentionRules
from ..engine.suspects import SuspectBlocks, downstream
from ..engine.tails import TailDirectory
from ..engine.tenants import TenantBook, TenantLimits
from ..engine.tracker import LookupResult, RequestTracker
from ..engine.unreadable import UnreadableChunks
from ..tiers.disk import DiskTier
from ..tiers.redis_tier import RedisTier
from .disk_scrub import DiskScrubber
from .disk_sync import DiskWatcher, SharedDiskView
from .instance_info import disk_identity
from .remote_lookup import RemoteLookup

if TYPE_CHECKING:
    from .shared_marks import SharedMarks

logger = logging.getLogger("vllm.kvlens")

_MAX_DROPPED = 65536  # disk chunks remembered as dropped for a failure or a reset, until deleted


class SchedulerState:
    def __init__(
        self, config: KVLensConfig, facts: EngineFacts, clock: Callable[[], float] = time.monotonic
    ) -> None:
        config.check_block_size(facts.block_size)
        self.config = config
        self.facts = facts
        self.clock = clock
        self.tiers: dict[str, TierIndex] = {}
        # Exact only while no other engine's chunks can reach the index (see tails.py).
        only_cpu = config.local_cpu and not config.local_disk and not config.remote_url
        self.tails = TailDirectory() if only_cpu else None
        if config.local_cpu:
            on_drop = self.tails.discard if self.tails is not None else None
            budget = config.cpu_budget_bytes  # dropped buffers kept for reuse fit in what chunks leave
            self.tiers[CPU] = TierIndex(CPU, budget, on_drop, config.cache_policy, *self._retention(CPU))
        self.disk_view: SharedDiskView | None = None
        # Disk chunks evicted (or reset) whose file this engine's delete removed: engines sharing
        # the directory may all decide to evict a chunk, only the one whose delete removed it counts.
        self.disk_evictions = 0
        self._dropped_disk: OrderedDict[str, None] = OrderedDict()  # forgotten or reset: no evictions
        # Tiers other engines may share, by name: what telemetry labels their totals with.
        self.shared_storage: dict[str, str] = (
            {DISK: disk_identity(config.local_disk)} if config.local_disk else {}
        )
        if config.local_disk:
            self.tiers[DISK] = TierIndex(
                DISK, config.disk_budget_bytes, None, config.cache_policy, *self._retention(DISK)
            )
            extra = config.extra_config
            disk = DiskTier(config.local_disk, facts.kv_layout, extra.disk_shared_grace_s)
            watcher = DiskWatcher(disk, facts.world_size, extra.disk_scan_interval_s)
            scrub = None
            if facts.stores:  # a consumer deletes nothing, damaged or not
                scrub = DiskScrubber(
                    disk, watcher.scanner.chunks, facts.world_size, extra.disk_scrub_bytes_per_s
                )
            self.disk_view = SharedDiskView(
                self.tiers[DISK], watcher, facts.stores, extra.disk_shared_grace_s, scrub
            )
        self._check_budgets()
        self.remote: RemoteLookup | None = None
        if config.remote is not None and facts.loads:
            extra = config.extra_config
            budget = extra.remote_lookup_timeout_ms / 1000
            # A round trip may outlast a lookup call's budget (its request then waits for it, up
            # to remote_timeout_s); a connection is opened within the budget (the keeper retries).
            wait = max(extra.remote_timeout_s, budget)
            client = RedisTier(config.remote, facts.kv_layout, extra.remote_key_prefix, None, wait, budget)
            # connected here, at start-up, outside any request's budget (remote_lookup.py)
            self.remote = RemoteLookup(
                client, facts.world_size, clock, budget_s=budget, start_up_s=wait, wait_s=wait
            )
        self.tier_states: dict[str, TierState] = {name: TierState.HEALTHY for name in config.tier_names()}
        self.stores_remote = config.remote is not None and facts.stores
        self.base_namespace = facts.namespace()
        self.pins = PinTable()
        self.policies: dict[str, RequestPolicy] = {}
        self.hashers: dict[str, PrefixHasher] = {}
        self.lookups: dict[str, LookupResult] = {}
        self.trackers: dict[str, RequestTracker] = {}
        self.unfinished: dict[str, Any] = {}  # request id -> vLLM Request
        self.recently_evicted = RecentlyEvicted()
        self.suspects = SuspectBlocks()
        extra = config.extra_config  # client-sized state (engine/tenants.py): bounded
        self.first_chunks = FirstChunkNamespaces(max_namespaces=extra.namespaces_max)
        self.tenant_limits = TenantLimits(
            extra.cache_salt_max_chars, extra.tag_value_max_chars, extra.tags_max
        )
        self.shared_marks: SharedMarks | None = None  # what other instances stored (admin.py sets it)
        self.tier_speeds = TierSpeeds()  # how fast each tier loaded, as measured
        self.block_events = BlockEvents(facts.block_size, facts.kv_events and facts.stores)
        self._pending_evictions: list[Eviction] = []
        # Asynchronous loads: planned (for the next plan), in flight (until every rank reported),
        # and abandoned by finished requests (for the next plan).
        self.async_jobs: list[LoadJob] = []
        self.async_loading: set[str] = set()
        # chunks each asynchronous load promotes into the CPU tier (pinned there until reported)
        self.async_promotions: dict[str, list[str]] = {}
        self.promoting: set[str] = set()  # their chunks: not in the CPU tier until reported
        self.unreadable = UnreadableChunks(clock=clock)  # loads just failed: lookups pass over them a while
        self.async_cancels: list[str] = []
        # Settled asynchronous loads, by request: (tokens planned, outcome), until its schedule.
        self.async_outcomes: dict[str, tuple[int, LoadOutcome]] = {}
        # Blocks loaded (or failed as unloadable) per step whose report has not arrived yet.
        self._unreported_loads: dict[int, frozenset[int]] = {}
        self.reported_through = -1  # the newest step whose report was processed
        # Tensor parallelism: stores over loads some rank has not reported yet wait for the report.
        self.held_stores = HeldStores()
        # Per-tenant accounting (engine/tenants.py): bytes held follow admissions and drops.
        extra = config.extra_config
        self.tenants = TenantBook(extra.tenant_labels_max, tuple(self.tiers), extra.namespaces_max)
        self.retention_rules = RetentionRules.of(
            extra.retention_allowed, extra.retention_max_priority, extra.retention_max_seconds
        )
        for name, index in self.tiers.items():
            index.also_on_drop(lambda chunk, tier=name: self.tenants.dropped(tier, chunk))

    def _retention(self, tier: str) -> tuple[float, int | None, Callable[[], float], float]:
        """A tier index's retention cap, tenant quota, clock and retention cap per tenant."""
        extra = self.config.extra_config
        return (
            extra.max_retained_share,
            extra.tenant_quota(tier),
            self.clock,
            extra.max_retained_share_per_tenant,
        )

    def _check_budgets(self) -> None:
        if not self.facts.stores:
            return
        chunk = self.facts.chunk_nbytes(self.config.chunk_size)
        for name, tier in self.tiers.items():
            if chunk > tier.capacity_bytes:
                key = "max_local_cpu_size" if name == CPU else "max_local_disk_size"
                raise ConfigError(
                    f"KVLens config key '{key}' holds no chunk: one chunk of {self.config.chunk_size} "
                    f"tokens is {chunk} bytes"
                )

    def usable(self, tier: str) -> bool:
        """The workers did not report the tier skipped (remote: nor did this lookup client)."""
        if tier == REMOTE and self.remote is not None and not self.remote.usable():
            return False
        return self.tier_states.get(tier) is not TierState.SKIPPED

    def usable_tiers(self) -> list[TierIndex]:
        """The local tiers a lookup may answer from, fastest first."""
        return [t for t in self.tiers.values() if self.usable(t.name)]

    def evict_later(self, tier: str, names: Iterable[str]) -> None:
        """Every rank deletes these chunks from ``tier`` at the start of the next plan's writes."""
        names = list(names)
        if not names:
            return
        if self.facts.stores:  # a consumer never deletes
            self._pending_evictions.extend(Eviction(tier, n) for n in names)
        if tier == DISK and self.disk_view is not None:
            self.disk_view.note_changed(names)

    def queue_evictions(self, evictions: list[Eviction]) -> None:
        """Evictions decided between plans: they run first in the next plan."""
        if self.facts.stores:
            self._pending_evictions.extend(evictions)

    def has_pending_evictions(self) -> bool:
        return bool(self._pending_evictions)

    def take_pending_evictions(self) -> list[Eviction]:
        taken, self._pending_evictions = self._pending_evictions, []
        return taken

    def loads_planned(self, step: int, blocks: set[int]) -> None:
        """Step ``step`` loads into ``blocks``; until its report arrives, stores computed over
        them depend on those loads."""
        if blocks:
            self._unreported_loads[step] = frozenset(blocks)

    def loads_reported(self, step: int, failed: Iterable[int] = ()) -> None:
        """Reports arrive in step order: every step up to ``step`` is settled; ``failed``: the
        blocks whose load failed on some rank. Stores held for them are settled: withdrawn ones
        leave the index (the workers never write them)."""
        self.reported_through = max(self.reported_through, step)
        for done in [n for n in self._unreported_loads if n <= step]:
            del self._unreported_loads[done]
        self.held_stores.failed(step, failed)
        for held in self.held_stores.reported(self.reported_through):
            logger.info("KVLens: withdrew chunk %s: computed over a failed load", held.name[:12])
            for tier in held.tiers:
                self.forget(tier, held.name, FailureReason.DEPENDENCY_FAILED)

    def steps_loading(self, blocks: set[int]) -> list[int]:
        """The unreported steps that loaded any of ``blocks``."""
        return [step for step, loaded in self._unreported_loads.items() if not loaded.isdisjoint(blocks)]

    def unreported_loaded_blocks(self) -> set[int]:
        """Blocks loaded in steps whose report has not arrived (asynchronous scheduling)."""
        return set().union(*self._unreported_loads.values()) if self._unreported_loads else set()

    def taint(self, bad: set[int], trackers: Iterable[RequestTracker] = ()) -> None:
        """Blocks that hold wrong KV, and every block computed over them by the running
        requests (and ``trackers``), are suspect until a step rewrites them."""
        if not bad:
            return
        self.suspects.add(bad)
        bs = self.facts.block_size
        for tracker in (*self.trackers.values(), *trackers):
            self.suspects.add(downstream(tracker.block_ids, bad, -(-tracker.computed // bs)))

    def forget_scrubbed(self) -> None:
        """Disk chunks the scrub found damaged leave the index (every rank's file is deleted)."""
        if self.disk_view is not None and self.disk_view.scrub is not None:
            for name in self.disk_view.take_damaged():
                self.forget(DISK, name, FailureReason.CORRUPT)

    def merge_disk_scan(self) -> None:
        """Fold in what other engines changed in a shared disk directory."""
        self.forget_scrubbed()
        if self.disk_view is not None:
            merged = self.disk_view.merge()
            self.block_events.dropped(DISK, merged.gone)
            self.recently_evicted.add(merged.evict, DISK)
            self.evict_later(DISK, merged.evict)

    def deleted(self, removed: Iterable[tuple[str, str]]) -> None:
        """Chunk files the workers' deletes removed (not ones another engine removed first)."""
        for tier, name in removed:
            if tier != DISK:
                continue
            if name in self._dropped_disk:
                del self._dropped_disk[name]
            else:
                self.disk_evictions += 1

    def _dropped_from_disk(self, names: Iterable[str]) -> None:
        """Disk chunks deleted for another reason than room (failed, reset): not evictions."""
        for name in names:
            self._dropped_disk[name] = None
            self._dropped_disk.move_to_end(name)
        while len(self._dropped_disk) > _MAX_DROPPED:
            self._dropped_disk.popitem(last=False)

    def forget(self, tier: str, name: str, reason: FailureReason) -> None:
        """A chunk the tier does not (correctly) hold leaves the index and is deleted everywhere;
        lookups pass over it for a while (``engine/unreadable.py``)."""
        self.unreadable.add(tier, name)
        index = self.tiers.get(tier)
        if index is None and tier == REMOTE and reason is FailureReason.CORRUPT:
            self.evict_later(tier, [name])  # no index to forget it: delete the damaged value
        if index is not None and index.remove(name):
            logger.info("KVLens: dropped chunk %s from the %s tier (%s)", name[:12], tier, reason.value)
            if tier == DISK:
                self._dropped_from_disk([name])
            self.evict_later(tier, [name])

    def reset(self) -> None:
        """Forget every unpinned chunk (vLLM's reset_prefix_cache with reset_connector)."""
        self.block_events.cleared()
        for tier in self.tiers.values():
            names = tier.clear()
            if tier.name == DISK:
                self._dropped_from_disk(names)
            self.recently_evicted.add(names, tier.name)
            self.evict_later(tier.name, names)

    def tenants_hold(self, tiers: Iterable[str], chunk: str, request_id: str, num_tokens: int) -> None:
        """Indexed tiers just admitted ``chunk`` for ``request_id``: its tenant holds the bytes."""
        label = self.tenants.request_label(request_id)
        nbytes = self.facts.chunk_nbytes(num_tokens)
        for tier in tiers:
            if tier in self.tiers:
                self.tenants.held(tier, chunk, label, nbytes)

    def shutdown(self) -> None:
        if self.disk_view is not None:
            self.disk_view.stop()
        if self.remote is not None:
            self.remote.close()
