"""The store's gc and verify methods, apart from the facade that a restart uses.

:class:`~adstore.store.store.Store` inherits them.  Each imports its pass
(eviction, sweep, verify, the index rebuild) when called: a process that
restarts from the cache opens a store and reads an entry, and never pays for
importing the passes it does not run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ReadOnlyStore
from .fsutil import read_only_filesystem
from .index.file import probe_index
from .layout import Layout, default_root
from .units import MinFree, parse_duration, parse_size

if TYPE_CHECKING:
    from .blobs import Blobs
    from .bookkeeping import Bookkeeping
    from .index.env import Index
    from .index.tables import Tables
    from .maintenance.eviction import EvictionPlan, Evictor
    from .maintenance.sweep import SweepPlan
    from .maintenance.verify import Progress, VerifyReport
    from .records.rebuild import RebuildReport

__all__ = ["Upkeep"]


class Upkeep:
    """gc and verify for :class:`~adstore.store.store.Store` (a mixin: the store's state, no state of its own)."""

    root: Path
    read_only: bool
    grace_period: float
    _tables: Tables
    _blobs: Blobs
    _book: Bookkeeping
    _index: Index
    _attach: Callable[[Layout], None]
    flush: Callable[[], None]

    def plan_eviction(
        self,
        *,
        max_size: int | str | None = None,
        min_free: MinFree | int | str | None = None,
        older_than: float | str | None = None,
        max_entries: int | None = None,
        namespace: str | None = None,
    ) -> EvictionPlan:
        """LRU entries to evict to meet the budget (honours leases, pins, grace)."""
        self.flush()
        return self._evictor().plan(
            max_size=None if max_size is None else parse_size(max_size, field="max_size"),
            min_free=min_free,
            older_than=None if older_than is None else parse_duration(older_than, field="older_than"),
            max_entries=max_entries,
            namespace=namespace,
        )

    def plan_remove(self, keys: Iterable[str]) -> EvictionPlan:
        """Entries to remove by name (only a live lease spares one); :class:`KeyNotFound` for a missing key."""
        return self._evictor().plan_remove(keys)

    def plan_sweep(self) -> SweepPlan:
        from .maintenance.sweep import Sweeper

        return Sweeper(self._tables, grace_period=self.grace_period).plan()

    def _evictor(self) -> Evictor:
        """The eviction planner (imported when a plan is asked for: a restart never evicts)."""
        from .maintenance.eviction import Evictor

        return Evictor(self._tables, grace_period=self.grace_period)

    def freeze(self) -> None:
        """Mark the store frozen where it is built, once nothing writes it any more (an image build's last step).

        From then on it opens read-only everywhere, and a reader that cannot take LMDB's lock (a read-only
        mount) reads it lock-free, which is safe only because nothing writes it (``index.readonly``).  Handles
        already open are not changed: freeze last.  To write it again, remove ``FROZEN`` from its root.
        """
        if self.read_only:
            raise ReadOnlyStore(str(self.root), "freeze (freeze a store where it is built)")
        self.flush()
        self._tables.layout.freeze()

    def verify(self, *, fix: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Rehash every blob and check every invariant, and the records against the index; ``fix`` repairs.
        A child process reads the whole index first (``index.file.probe_index``): damage is reported, never a
        dead process; with ``fix`` a damaged index is rebuilt from the blob files and records (``maintenance.repair``).
        """
        from .maintenance.repair import verify_or_rebuild
        from .maintenance.verify import verify_store

        if fix and self.read_only:
            raise ReadOnlyStore(str(self.root), "verify --fix (run it where the store is writable)")
        self.flush()
        probe = probe_index(self.root, lock=not self._index.lockless)
        return verify_or_rebuild(
            None if probe.ok else probe.detail,
            fix=fix,
            rebuild=self._rebuild,
            verify=lambda: verify_store(
                self._tables,
                fix=fix,
                grace_period=self.grace_period,
                quarantine=self._blobs.quarantine,
                progress=progress,
            ),
        )

    def _rebuild(self, why: str) -> RebuildReport:
        """Move the damaged index aside and rebuild it from the blob files and records (``rebuild``)."""
        from .records.rebuild import plan_rebuild

        self._book.close(flush=False)
        self._index.release()
        try:
            return plan_rebuild(self._tables.layout, why).execute()
        finally:
            self._attach(self._tables.layout)

    @classmethod
    def repair_index(cls, root: str | os.PathLike[str] | None = None) -> tuple[str, RebuildReport] | None:
        """Rebuild an index that cannot even be opened (not LMDB, truncated, faulting pages) from the blob files
        and records (invariant 9), for ``verify --fix`` before it opens the store: (why, report), or None when the
        index is sound or there is no store."""
        from .records.rebuild import repair_unopenable

        layout = Layout(Path(default_root() if root is None else root).expanduser().absolute())
        if layout.exists() and read_only_filesystem(layout.root):
            raise ReadOnlyStore(str(layout.root), "verify --fix (run it where the store is writable)")
        return repair_unopenable(layout)
