"""The orphan sweep: leftovers of killed writers, past the grace period (invariant 7).

Blob files without a row, stale temp files, uncommitted manifests older than
the grace period, blobs nothing references any more, leases of dead
processes and on-disk records whose manifest the index no longer has (an
entry removed or evicted by a process killed before it unlinked them; a
rebuild must not bring it back) are swept by gc, never by a reader, and so
are the records that removals listed in ``records/obsolete/``.  A pending
record of a manifest the index says is committed (a commit cut short between
its transaction and its rename) is moved into place.  A plan first, then
``execute()``; rows go in one write transaction, files after it committed
(docs/architecture.md, "How an entry lives").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..blobs import unlink_dropped
from ..errors import CorruptRow
from ..index.ballast import spending_allowed
from ..index.rows import BlobRef, BlobRow, Manifest, manifest_key
from ..index.tables import Tables, Txn
from ..leases import in_flight, live_leases
from ..manifests import drop_if_empty
from ..names import is_digest
from ..records.files import RecordFiles, mtime_of
from ..records.obsolete import purge_obsolete_records
from ..records.sync import RecordIssues, check_records, fix_records
from .eviction import drop_unreferenced

__all__ = ["SweepPlan", "Sweeper"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SweepPlan:
    """Orphans past the grace period: files without rows, temps, stale manifests, dead leases."""

    orphan_files: list[Path] = field(default_factory=list)
    stale_temps: list[Path] = field(default_factory=list)
    stale_manifests: list[Manifest] = field(default_factory=list)
    zero_ref_blobs: list[BlobRef] = field(default_factory=list)
    dead_leases: list[bytes] = field(default_factory=list)
    bytes_to_free: int = 0
    #: Orphan record files to unlink and unfinished commits to finish (``records.sync``).
    records: RecordIssues = field(default_factory=RecordIssues)
    #: Obsolete lists in ``records/obsolete/`` (each names records that removals dropped): their
    #: records, then the lists, are deleted whatever their age.
    obsolete_records: list[Path] = field(default_factory=list)
    _sweeper: Sweeper | None = field(default=None, repr=False, compare=False)

    @property
    def empty(self) -> bool:
        return not (
            self.orphan_files
            or self.stale_temps
            or self.stale_manifests
            or self.zero_ref_blobs
            or self.dead_leases
            or not self.records.empty
            or self.obsolete_records
        )

    @property
    def items(self) -> int:
        """How many things the sweep will remove (or, for unfinished record commits, finish)."""
        return (
            len(self.orphan_files)
            + len(self.stale_temps)
            + len(self.stale_manifests)
            + len(self.zero_ref_blobs)
            + len(self.dead_leases)
            + len(self.records.orphans)
            + len(self.records.unfinished)
            + len(self.obsolete_records)
        )

    def execute(self) -> int:
        """Carry the sweep out; returns bytes freed."""
        if self._sweeper is None or self.empty:
            return 0
        return self._sweeper.execute(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "orphan_files": len(self.orphan_files),
            "stale_temps": len(self.stale_temps),
            "stale_manifests": len(self.stale_manifests),
            "zero_ref_blobs": len(self.zero_ref_blobs),
            "dead_leases": len(self.dead_leases),
            "orphan_records": len(self.records.orphans),
            "unfinished_records": len(self.records.unfinished),
            "obsolete_records": len(self.obsolete_records),
            "bytes_to_free": self.bytes_to_free,
        }


class Sweeper:
    """Plans and executes the orphan sweep for one store."""

    def __init__(self, tables: Tables, *, grace_period: float) -> None:
        self._tables = tables
        self.grace = grace_period

    def plan(self, *, now: float | None = None) -> SweepPlan:
        now = self._tables.clock() if now is None else now
        old = now - self.grace
        layout = self._tables.layout
        found = check_records(self._tables, read=False)  # names only: gc never reads record content
        records = RecordIssues(
            orphans=[f for f in found.orphans if mtime_of(f) <= old],
            unfinished=[f for f in found.unfinished if mtime_of(f) <= old],
        )
        registered: set[str] = set()
        zero_ref: list[BlobRef] = []
        stale: list[Manifest] = []
        nbytes = 0
        with self._tables.read() as t:
            for digest, row in t.decoded_blob_rows():
                if not row.inline and not row.quarantined:
                    registered.add(digest)
                if row.refs == 0 and row.touched <= old:
                    zero_ref.append(BlobRef(digest, row.size))
                    nbytes += row.size
            for mk, raw in t.manifest_rows():
                try:
                    m = Manifest.decode(mk, raw)
                except CorruptRow:
                    continue
                if not m.committed and m.created <= old and not in_flight(m.producer, m.created, now):
                    stale.append(m)
            _, dead = live_leases(t, now)
        orphans: list[Path] = []
        for sub in sorted(layout.blobs.iterdir()) if layout.blobs.exists() else []:
            if sub.is_dir():
                orphans += [f for f in sub.iterdir() if f.name not in registered]
        orphans, orphan_bytes = _older(orphans, old)
        temps, temp_bytes = _older(list(layout.tmp.iterdir()) if layout.tmp.exists() else [], old)
        return SweepPlan(
            orphans,
            temps,
            stale,
            zero_ref,
            dead,
            nbytes + orphan_bytes + temp_bytes,
            records,
            RecordFiles(layout).obsolete_files(),
            _sweeper=self,
        )

    def execute(self, plan: SweepPlan) -> int:
        now = self._tables.clock()

        def fn(t: Txn) -> list[tuple[str, BlobRow]]:
            zero = [ref.digest for ref in plan.zero_ref_blobs]
            for planned in plan.stale_manifests:
                mk = manifest_key(planned.key, planned.rank, planned.generation)
                raw = t.manifest_row(mk)
                m = Manifest.decode(mk, raw) if raw is not None else None
                if m is None or m.committed or m.created > now - self.grace or in_flight(m.producer, m.created, now):
                    continue  # committed, or published again (by a save in flight)
                zero += t.drop_manifest(m)  # the references the row holds now, not the ones planned
                drop_if_empty(t, m.key)
            _, dead = live_leases(t, now)
            for lease_id in set(plan.dead_leases) & set(dead):
                t.drop_lease(lease_id)
            return drop_unreferenced(t, zero, now, self.grace)

        with spending_allowed(self._tables.index.ballast):  # at 0 bytes free (docs/operations.md, "Damage and repair")
            dropped = self._tables.write(fn)
        freed = sum(row.size for _, row in dropped if row.inline)
        cutoff = now - self.grace
        files = [d for d, row in dropped if not row.inline]
        files += [f.name for f in plan.orphan_files if is_digest(f.name) and _older([f], cutoff)[0]]
        freed += unlink_dropped(self._tables, files)
        for f in plan.orphan_files:
            if not is_digest(f.name):
                freed += _unlink_if_old(f, cutoff)
        for f in plan.stale_temps:
            freed += _unlink_if_old(f, cutoff)
        if not plan.records.empty:
            fix_records(self._tables, plan.records, grace_period=self.grace)
        if plan.obsolete_records or not plan.records.empty:  # this plan's lists, and those fix_records just wrote
            purge_obsolete_records(self._tables)
        log.info("sweep freed %d bytes", freed)
        return freed


def _older(paths: list[Path], cutoff: float) -> tuple[list[Path], int]:
    """The paths last modified at or before ``cutoff``, and their total size."""
    out: list[Path] = []
    total = 0
    for f in paths:
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        if st.st_mtime <= cutoff:
            out.append(f)
            total += st.st_size
    return out, total


def _unlink_if_old(path: Path, cutoff: float) -> int:
    try:
        st = path.stat()
        if st.st_mtime > cutoff:
            return 0
        path.unlink()
        return st.st_size
    except FileNotFoundError:
        return 0
