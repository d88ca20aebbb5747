"""What ``adstore stats`` shows, and the counter names a cache event increments.

Counters live in the ``stats`` table and totals in ``meta`` (``tables.Txn``);
this module only names and presents them (README, "CLI").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from .maintenance.budget import Budget, read_budget
from .index.schema import LOGICAL_BYTES, PHYSICAL_BYTES, PINNED_BYTES
from .index.tables import Tables

__all__ = ["StoreStats", "event_counters", "read_stats"]

_PLURAL = {"hit": "hits", "miss": "misses", "bypass": "bypasses", "save": "saves", "eviction": "evictions"}


def event_counters(event: str, reason: str | None, seconds_saved: float = 0.0) -> Iterable[tuple[str, int]]:
    """Counter names one cache event increments (``misses`` and ``misses.<reason>``)."""
    name = _PLURAL.get(event, event)
    yield name, 1
    if reason:
        yield f"{name}.{reason}", 1
    if seconds_saved > 0:
        yield "ms_saved", int(seconds_saved * 1000)


@dataclass(slots=True)
class StoreStats:
    """Counters plus totals of the index, and the budget persisted in it (None: never set)."""

    counters: dict[str, int] = field(default_factory=dict)
    entries: int = 0
    blobs: int = 0
    inline_blobs: int = 0
    logical_bytes: int = 0
    physical_bytes: int = 0
    pinned_bytes: int = 0
    leases: int = 0
    index_bytes: int = 0
    budget: Budget | None = None

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes referenced by entries per physical byte stored."""
        return self.logical_bytes / self.physical_bytes if self.physical_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["budget"] = self.budget.to_dict() if self.budget is not None else None
        d["dedup_ratio"] = self.dedup_ratio
        return d


def read_stats(tables: Tables) -> StoreStats:
    """The counters and totals of one read transaction, and the size of the index files."""
    with tables.read() as t:
        st = StoreStats(
            counters=t.counters(),
            entries=t.rows("entries"),
            blobs=t.rows("blobs"),
            inline_blobs=t.rows("blobdata"),
            leases=t.rows("leases"),
            physical_bytes=t.total(PHYSICAL_BYTES),
            logical_bytes=t.total(LOGICAL_BYTES),
            pinned_bytes=t.total(PINNED_BYTES),
            budget=read_budget(t),
        )
    st.index_bytes = sum(f.stat().st_size for f in tables.layout.index.iterdir() if f.is_file())
    return st
