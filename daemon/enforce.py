"""One enforcement pass: measure, evict in bounded batches, sweep.

This is the daemon's policy, kept free of threads, signals and sockets so
that it can be tested and benchmarked on its own.  It decides *how much* to
evict; the store decides *what* (LRU by entry, honouring leases, pins and the
grace period) through its plans, and carries them out safely (rows deleted in
one transaction, files unlinked after commit).  The store's plan executes in
batches of at most ``batch_size`` entries and asks ``should_stop`` between
them, so SIGTERM finishes the current batch and nothing more.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import psutil

from adstore.daemon.config import DaemonConfig
from adstore.store import EvictedBatch, Store, human_size

__all__ = ["Usage", "PassResult", "Enforcer"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Usage:
    """The store's size against the budget's limits at one moment (bytes)."""

    size: int
    limit: int | None
    high: int | None
    low: int | None
    fs_total: int
    fs_free: int

    @property
    def over_high(self) -> bool:
        return self.high is not None and self.size > self.high

    def describe(self) -> str:
        if self.limit is None:
            return f"size {human_size(self.size)}, no size budget"
        pct = 100.0 * self.size / self.limit if self.limit else float("inf")
        return (
            f"size {human_size(self.size)} / budget {human_size(self.limit)} ({pct:.0f}%), "
            f"evicts above {human_size(self.high)} down to {human_size(self.low)}"
        )


@dataclasses.dataclass
class PassResult:
    """What one pass did; also the body of the daemon's STATUS and status file."""

    before: Usage
    after: Usage
    evicted_entries: int = 0
    aged_entries: int = 0
    bytes_freed: int = 0
    batches: int = 0
    swept_items: int = 0
    swept_bytes: int = 0
    blocked: bool = False  # over budget but nothing more may be evicted (leases, pins, grace)
    interrupted: bool = False  # stopped between batches (SIGTERM)
    swept: bool = False
    finished: float = 0.0  # wall-clock time the pass ended
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return out


class Enforcer:
    """Runs passes of the budget policy in ``config`` against ``store``."""

    def __init__(
        self,
        store: Store,
        config: DaemonConfig,
        *,
        should_stop: Callable[[], bool] = lambda: False,
        on_batch: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.config = config
        self.should_stop = should_stop
        self.on_batch = on_batch

    def measure(self) -> Usage:
        size = int(self.store.size())
        disk = psutil.disk_usage(str(self.store.root))
        limit = self.config.budget(size=size, fs_total=disk.total, fs_free=disk.free)
        if limit is None:
            return Usage(size, None, None, None, disk.total, disk.free)
        return Usage(
            size,
            limit,
            int(limit * self.config.high_watermark),
            int(limit * self.config.low_watermark),
            disk.total,
            disk.free,
        )

    def _evict(self, result: PassResult, **plan_args: Any) -> int:
        """Plan once (one LRU scan), execute in batches of ``batch_size``; returns entries evicted.

        Re-planning before every batch would rescan every entry per batch
        (quadratic on a large store).  If the batches freed too little (the
        store skipped victims used or pinned since the plan), plan again.
        """
        evicted = 0
        target = plan_args.get("max_size")
        stopped = False

        def should_stop() -> bool:
            nonlocal stopped
            stopped = stopped or self.should_stop()
            return stopped

        for _round in range(8):  # each round is a fresh plan; normally one suffices
            plan = self.store.plan_eviction(**plan_args)
            if not plan.count:
                break

            def on_batch(batch: EvictedBatch, why: str = plan.why) -> bool:
                nonlocal evicted
                evicted += len(batch.keys)
                result.batches += 1
                result.bytes_freed += batch.bytes_freed
                log.info("evicted %d entries (%d bytes): %s", len(batch.keys), batch.bytes_freed, why)
                self.on_batch()
                return target is not None and self.store.size() <= target

            plan.execute(batch_size=self.config.batch_size, should_stop=should_stop, on_batch=on_batch)
            if stopped:
                result.interrupted = True
                return evicted
            if target is None or self.store.size() <= target:
                break  # an age pass evicts exactly what it planned
        return evicted

    def run_pass(self, *, sweep: bool = False, sweep_if_stuck: bool = True) -> PassResult:
        """Age limit, then size budget down to the low watermark, then (optionally) the sweep.

        ``sweep_if_stuck`` also sweeps when eviction alone cannot reach the
        low watermark (the daemon rate-limits this: a sweep scans every file).
        """
        start = time.monotonic()
        before = self.measure()
        result = PassResult(before=before, after=before)
        if self.config.max_age is not None:
            result.aged_entries = self._evict(result, older_than=self.config.max_age)
        budget = self.measure() if result.aged_entries else before
        if budget.over_high and not result.interrupted:
            assert budget.low is not None
            log.info("over the high watermark: %s", budget.describe())
            result.evicted_entries = self._evict(result, max_size=budget.low)
            if sweep_if_stuck and not result.interrupted and self.store.size() > budget.low:
                # Orphans may be what fills the store; and what is left is
                # leased, pinned or inside the grace period.
                sweep = True
        if sweep and not result.interrupted:
            result.swept = True
            plan = self.store.plan_sweep()
            items = plan.items
            if items:
                result.swept_bytes = plan.execute()
                result.swept_items = items
                log.info("swept %d orphaned items (%d bytes)", items, result.swept_bytes)
        result.after = self.measure()
        if result.after.low is not None and result.after.size > result.after.high and not result.interrupted:
            result.blocked = True
            log.warning(
                "still over budget after eviction (%s): the rest is leased, pinned or younger than the grace period",
                result.after.describe(),
            )
        result.seconds = time.monotonic() - start
        result.finished = time.time()
        return result
