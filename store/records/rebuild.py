"""Replace a damaged LMDB index with one rebuilt from the files (docs/operations.md, "Damage and repair").

``verify --fix`` uses this when the index cannot be read safely: it is not
LMDB, it is truncated, or reading its pages faults (``index.file``).  The
files are the source of truth and the index a cache of them (invariant 9),
so the plan names what will happen before anything moves: the damaged
``index/`` goes aside into ``quarantine/index.<ns timestamp>`` (kept for a
post-mortem, never deleted), a fresh index is created, every blob file on
disk whose content hashes to its name is registered again, and then every
entry, committed manifest, refcount, inline blob and pin is restored from
the on-disk records (``records.restore``, ``records.files``).  Files that do not
hash to their name, and anything that is not a regular file (a symlink is
never followed), are moved to ``quarantine/``; records whose blobs are
missing or corrupt, or that fail their checksum, are newer than this
adstore, or name what they may not, are skipped and reported.

What is lost with the index: LRU order, hit counts and the counters of
``adstore stats`` (an entry's last access becomes its record's creation
time), uncommitted saves in flight, and leases (their holders take them
again).  Blob files no restored manifest references stay registered,
unreferenced, and gc sweeps them past the grace period.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..codec import Encoding
from ..errors import StoreError
from ..fsutil import fsync_dir
from ..index.ballast import Ballast
from ..index.env import Index
from ..index.file import FRESH_INDEX_BYTES, probe_index
from ..index.rows import FLAG_ZSTD, BlobRow
from ..index.tables import Tables, Txn
from ..layout import Layout
from .files import Found, RecordFiles, RecordState
from .obsolete import obsolete_dropped
from .restore import BlobFile, Restored, Skipped, identify_blob_file, restore

__all__ = ["RebuildPlan", "RebuildReport", "plan_rebuild", "repair_unopenable", "LOST_WITH_THE_INDEX"]

log = logging.getLogger(__name__)

_BATCH = 500

#: The warning every rebuild reports: what the records do not hold.
LOST_WITH_THE_INDEX = (
    "LRU order, hit counts, counters, leases and saves in flight lived only in the damaged index and are lost; "
    "entries were restored from their on-disk records"
)


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What a rebuild did."""

    damaged_index: str  # where the damaged index/ was moved
    registered: int
    registered_bytes: int
    quarantined: tuple[str, ...]
    lost: str = LOST_WITH_THE_INDEX
    entries: int = 0  # restored from records
    manifests: int = 0
    inline_blobs: int = 0
    pinned: int = 0
    skipped: tuple[Skipped, ...] = ()  # record files not restored, with why


@dataclass(frozen=True, slots=True)
class RebuildPlan:
    """Move ``index/`` aside, create a fresh index, re-register ``blob_files``, restore ``records``."""

    layout: Layout
    why: str
    blob_files: tuple[Path, ...] = field(default=())
    records: tuple[Found, ...] = field(default=())

    @property
    def committed_records(self) -> int:
        """How many committed record files the plan will read."""
        return sum(1 for f in self.records if f.state is RecordState.COMMITTED)

    @property
    def destination(self) -> Path:
        return self.layout.quarantine / f"index.{time.time_ns()}"

    def execute(self) -> RebuildReport:
        layout = self.layout
        if Index.users(layout.index):
            raise StoreError(f"cannot rebuild the index of {layout.root}: this process still has it open")
        # Every blob file is read before anything moves: one the system will not read now (EMFILE, EIO,
        # EACCES) is no proof of damage, and an index rebuilt without it would lose its entries and
        # leave the file to the sweep as an orphan.  So such a rebuild stops with nothing changed.
        good: list[BlobFile] = []
        suspect: list[Path] = []
        for path in self.blob_files:
            found = identify_blob_file(path)  # BlobUnreadable propagates: try again once the system reads it
            if found is not None and path.parent.name == path.name[:2]:
                good.append(found)
            else:
                suspect.append(path)
        layout.mkdir(layout.quarantine)
        dest = self.destination
        if os.path.lexists(layout.index):
            os.replace(layout.index, dest)
            fsync_dir(layout.root)
        log.warning("moved the damaged index of %s to %s (%s)", layout.root, dest, self.why)
        layout.mkdir(layout.index)
        if shutil.disk_usage(layout.index).free < FRESH_INDEX_BYTES:
            Ballast(layout.root).release()  # what the ballast is for: room for the fresh index
        bad: list[str] = []
        for path in suspect:
            target = layout.quarantine / f"{path.name}.{time.time_ns()}"
            try:
                os.replace(path, target)  # renames a symlink itself, never its target
                bad.append(str(path))
            except OSError as exc:
                log.warning("could not quarantine %s: %s", path, exc)
        index = Index.acquire(layout.index, group_shared=layout.group_shared)
        try:
            tables = Tables(index, layout, after_commit=obsolete_dropped)
            now = tables.clock()
            for i in range(0, len(good), _BATCH):

                def fn(t: Txn, batch: list[BlobFile] = good[i : i + _BATCH]) -> None:
                    for f in batch:
                        flags = FLAG_ZSTD if f.encoding is Encoding.ZSTD else 0
                        t.put_blob(f.digest, BlobRow(f.size, 0, now, flags, f.stored), inline=None)

                tables.write(fn)
            restored = restore(tables, RecordFiles(layout), self.records, {f.digest: f for f in good})
        finally:
            index.release()
        return _report(str(dest), good, bad, restored)


def _report(dest: str, good: list[BlobFile], bad: list[str], restored: Restored) -> RebuildReport:
    return RebuildReport(
        dest,
        len(good),
        sum(f.stored for f in good),
        tuple(bad),
        entries=restored.entries,
        manifests=restored.manifests,
        inline_blobs=restored.inline_blobs,
        pinned=restored.pinned,
        skipped=tuple(restored.skipped),
    )


def plan_rebuild(layout: Layout, why: str) -> RebuildPlan:
    """The plan for ``layout``: every file under ``blobs/ab/`` (named like a digest or not) and ``records/``."""
    files: list[Path] = []
    if layout.blobs.is_dir() and not layout.blobs.is_symlink():
        for sub in sorted(layout.blobs.iterdir()):
            if sub.is_symlink() or not sub.is_dir():
                continue
            files += sorted(sub.iterdir())  # a name that is no digest fails the hash check: moved aside
    return RebuildPlan(layout, why, tuple(files), tuple(RecordFiles(layout).scan()))


def repair_unopenable(layout: Layout) -> tuple[str, RebuildReport] | None:
    """Rebuild the index of ``layout`` if a child process cannot read it in full; why, and the report.

    None when the index is sound or there is no store (``Store.repair_index``).
    """
    if not layout.exists():
        return None
    layout.check_no_symlinks()
    probe = probe_index(layout.root)
    if probe.ok:
        return None
    return probe.detail, plan_rebuild(layout, probe.detail).execute()
