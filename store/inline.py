"""Inline eviction: a writer keeps the store bounded when no daemon does (README, "Configuration").

Before a blob file is written, the writer checks the hard limit: its own
``max_size``, else the budget the daemon persisted (with that budget's grace
period), so writer and daemon agree on what is too much.  Over the limit it
evicts a bounded number of least-recently-used entries, then sweeps
unreferenced blobs past the grace period.  Only a writer's own limit refuses
a write (:class:`~adstore.store.errors.OverBudget`); the daemon's budget is
one the daemon enforces, so there a writer only helps.
"""

from __future__ import annotations

import logging
import shutil

from .budget import read_budget
from .errors import OverBudget
from .eviction import Evictor
from .sweep import Sweeper
from .tables import PHYSICAL, Tables

__all__ = ["InlineEviction", "INLINE_EVICTION_BATCH"]

log = logging.getLogger(__name__)

#: Entries one write may evict inline (a write never waits for a whole pass).
INLINE_EVICTION_BATCH = 64


class InlineEviction:
    """The hard limit of one store's writers and the bounded eviction that keeps it."""

    def __init__(self, tables: Tables, *, max_size: int | None, grace_period: float) -> None:
        self._tables = tables
        self.max_size = max_size
        self.grace_period = grace_period

    def _size(self) -> int:
        with self._tables.read() as t:
            return t.total(PHYSICAL)

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` more (or refuse them, at this writer's own limit)."""
        limit, grace = self.max_size, self.grace_period
        if limit is None:
            with self._tables.read() as t:
                budget = read_budget(t)
            if budget is None:
                return
            du = shutil.disk_usage(self._tables.layout.root)
            limit, grace = budget.limit(size=self._size(), fs_total=du.total, fs_free=du.free), budget.grace_period
            if limit is None:
                return
        if self._size() + nbytes <= limit:
            return
        if limit - nbytes >= 0:
            plan = Evictor(self._tables, grace_period=grace).plan(max_size=limit - nbytes,
                                                                  max_entries=INLINE_EVICTION_BATCH)
            if plan.count:
                log.info("over the hard limit: evicting up to %d entr(ies) inline", plan.count)
                plan.execute()
        if self._size() + nbytes > limit:
            sweep = Sweeper(self._tables, grace_period=grace).plan()  # unreferenced blobs past the grace period
            if not sweep.empty:
                sweep.execute()
        size = self._size()
        if size + nbytes > limit and self.max_size is not None:
            raise OverBudget(nbytes, limit, size)
