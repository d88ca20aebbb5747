"""What ``adstore stats`` shows, and the counter names a cache event increments.

Counters live in the ``stats`` table and totals in ``meta`` (``tables.Txn``);
this module only names and presents them (docs/cli.md, "adstore stats").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from .index.schema import CONTENT_BYTES, LOGICAL_BYTES, PHYSICAL_BYTES, PINNED_BYTES, STATS_ZEROED
from .index.tables import Tables, Txn
from .maintenance.budget import Budget, read_budget

__all__ = ["StoreStats", "event_counters", "read_stats", "entry_stored_bytes", "zero_counters"]

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
    logical_bytes: int = 0  # what the entries reference (a blob counted once per entry that holds it)
    content_bytes: int = 0  # every blob's content once (after deduplication, before compression)
    physical_bytes: int = 0  # what the blobs take on disk (after compression): what budgets limit
    pinned_bytes: int = 0
    leases: int = 0
    index_bytes: int = 0
    budget: Budget | None = None
    counters_zeroed: int | None = None  # epoch seconds of the last ``adstore stats --zero``; None: never
    # Blobs no manifest references (the sweep's, once past the grace period); None: not counted.
    unreferenced_blobs: int | None = None
    unreferenced_content_bytes: int | None = None
    unreferenced_bytes: int | None = None  # on disk

    @property
    def referenced_content_bytes(self) -> int:
        """Distinct content the manifests reference (all content when the unreferenced blobs were not counted)."""
        return self.content_bytes - (self.unreferenced_content_bytes or 0)

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes referenced by entries per byte of distinct referenced content.

        Blobs waiting for the sweep are left out: they are content no entry
        holds, and counting them made the ratio fall below one.
        """
        referenced = self.referenced_content_bytes
        return self.logical_bytes / referenced if referenced > 0 else 1.0

    @property
    def compression_ratio(self) -> float:
        """Bytes of distinct content per byte on disk."""
        return self.content_bytes / self.physical_bytes if self.physical_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["budget"] = self.budget.to_dict() if self.budget is not None else None
        d["dedup_ratio"] = self.dedup_ratio
        d["compression_ratio"] = self.compression_ratio
        return d


def read_stats(tables: Tables, *, unreferenced: bool = False) -> StoreStats:
    """The counters and totals of one read transaction, and the size of the index files.

    ``unreferenced`` also counts the blobs no manifest references, a scan of
    every blob row (``adstore stats`` asks for it; the daemon's metrics, which
    run often, do not).
    """
    with tables.read() as t:
        st = StoreStats(
            counters=t.counters(),
            entries=t.rows("entries"),
            blobs=t.rows("blobs"),
            inline_blobs=t.rows("blobdata"),
            leases=t.rows("leases"),
            physical_bytes=t.total(PHYSICAL_BYTES),
            content_bytes=t.total(CONTENT_BYTES),
            logical_bytes=t.total(LOGICAL_BYTES),
            pinned_bytes=t.total(PINNED_BYTES),
            budget=read_budget(t),
            counters_zeroed=t.total(STATS_ZEROED) or None,
        )
        if unreferenced:
            orphans = [row for _, row in t.decoded_blob_rows() if row.refs == 0]
            st.unreferenced_blobs = len(orphans)
            st.unreferenced_content_bytes = sum(row.size for row in orphans)
            st.unreferenced_bytes = sum(row.stored for row in orphans)
    st.index_bytes = sum(f.stat().st_size for f in tables.layout.index.iterdir() if f.is_file())
    return st


def entry_stored_bytes(tables: Tables, keys: Iterable[str]) -> dict[str, int]:
    """What each entry's current blobs take on disk (``adstore ls``; a blob shared by entries counts in each)."""
    out: dict[str, int] = {}
    with tables.read() as t:
        for key in keys:
            entry = t.entry(key)
            digests = {
                ref.digest
                for r, g in (entry.ranks.items() if entry else ())
                if (m := t.manifest(key, r, g)) is not None
                for ref in m.artifacts.values()
            }
            out[key] = sum(row.stored for d in digests if (row := t.blob_row(d)) is not None)
    return out


def zero_counters(tables: Tables, now: int) -> None:
    """Set every counter (hits, misses by reason, saves, remote bytes…) to 0 and note ``now``, in one write.

    Entries, blobs and the totals of sizes are untouched; ``now`` becomes
    ``StoreStats.counters_zeroed``.  Counters other processes still hold in
    memory are added when they flush, as counted after the zero.
    """

    def zero(t: Txn) -> None:
        t.zero_counters()
        t.set_total(STATS_ZEROED, now)

    tables.write(zero)
