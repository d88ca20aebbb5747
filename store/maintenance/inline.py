"""Inline eviction: a writer keeps the store bounded when no daemon does (docs/configuration.md, "The store").

Before a blob file is written, the writer checks the hard limit: its own
``max_size``, else the budget the daemon persisted (with that budget's grace
period), so writer and daemon agree on what is too much.  Over the limit it
evicts a bounded number of least-recently-used entries, then sweeps
unreferenced blobs past the grace period.  Only a writer's own limit refuses
a write (:class:`~adstore.store.errors.OverBudget`); the daemon's budget is
one the daemon enforces, so there a writer only helps.  A download is
admitted once for all its bytes, and holds them (``reservations``) until it
has written them or given up.
"""

from __future__ import annotations

import logging
import shutil

from ..errors import OverBudget, StoreFull
from ..index.schema import PHYSICAL_BYTES
from ..index.tables import Tables, Txn
from .budget import Budget, read_budget
from .reservations import Reservation, new_reservation, reserved

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
            return t.total(PHYSICAL_BYTES)

    def _limit(self) -> tuple[int | None, float, Budget | None]:
        """This writer's hard limit (its own ``max_size``, else the persisted budget's), the grace, the budget."""
        with self._tables.read() as t:
            budget = read_budget(t)
        if self.max_size is not None:
            return self.max_size, self.grace_period, budget
        if budget is None:
            return None, self.grace_period, None
        du = shutil.disk_usage(self._tables.layout.root)
        return budget.limit(size=self._size(), fs_total=du.total, fs_free=du.free), budget.grace_period, budget

    def _make_room(self, nbytes: int, limit: int, grace: float) -> int:
        """Evict (a bounded batch) and sweep until ``nbytes`` more fit under ``limit``; the size after."""
        if self._size() + nbytes <= limit:
            return self._size()
        from .eviction import Evictor  # imported by a writer over its limit only, not by every process
        from .sweep import Sweeper

        if limit - nbytes >= 0:
            plan = Evictor(self._tables, grace_period=grace).plan(
                max_size=limit - nbytes, max_entries=INLINE_EVICTION_BATCH
            )
            if plan.count:
                log.info("over the hard limit: evicting up to %d entr(ies) inline", plan.count)
                plan.execute()
        if self._size() + nbytes > limit:
            sweep = Sweeper(self._tables, grace_period=grace).plan()  # unreferenced blobs past the grace period
            if not sweep.empty:
                sweep.execute()
        return self._size()

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` more (or refuse them, at this writer's own limit)."""
        limit, grace, _budget = self._limit()
        if limit is None:
            return
        size = self._make_room(nbytes, limit, grace)
        if size + nbytes > limit and self.max_size is not None:
            raise OverBudget(nbytes, limit, size)

    def admit(self, nbytes: int) -> Reservation:
        """Before a download of ``nbytes`` another host declared: reserve them, or refuse before the first byte.

        Stricter than :meth:`reserve`, which lets a local writer pass the
        daemon's budget (the daemon enforces it): bytes a remote record
        announces must fit, with what other downloads reserved
        (``reservations``), under every limit, own or persisted
        (:class:`OverBudget`), and in the filesystem's free space less the
        budget's ``min_free`` (:class:`StoreFull`).  The check and the
        reservation are one write transaction, so two admissions never both
        take the same room.
        """
        limit, grace, budget = self._limit()
        if limit is not None:
            if nbytes > limit:
                raise OverBudget(nbytes, limit, self._size())
            with self._tables.read() as t:
                others, _ = reserved(t, self._tables.clock())
            self._make_room(nbytes + others, limit, grace)
        root = self._tables.layout.root

        def check_and_reserve(t: Txn) -> bytes | None:
            now = self._tables.clock()
            others, dead = reserved(t, now)
            for name in dead:
                t.drop_meta(name)
            if limit is not None:
                size = t.total(PHYSICAL_BYTES)
                if size + others + nbytes > limit:
                    raise OverBudget(nbytes, limit, size + others)
            du = shutil.disk_usage(root)
            floor = budget.min_free.of(du.total) if budget is not None and budget.min_free is not None else 0
            if du.free - floor - others < nbytes:
                detail = f"{nbytes} bytes to download, {du.free} free"
                detail += f" less min_free {floor}" if floor else ""
                detail += f" less {others} reserved by other downloads" if others else ""
                raise StoreFull(str(root), detail)
            return new_reservation(t, nbytes, now) if nbytes > 0 else None

        return Reservation(self._tables, self._tables.write(check_and_reserve), nbytes)
