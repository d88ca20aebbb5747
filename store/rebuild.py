"""Replace a damaged LMDB index with a fresh one (README, "Damage and repair").

``verify --fix`` uses this when the index cannot be read safely: it is not
LMDB, it is truncated, or reading its pages faults (``indexfile``).  The
plan names what will happen before anything moves: the damaged ``index/``
goes aside into ``quarantine/index.<ns timestamp>`` (kept for a post-mortem,
never deleted), a fresh index is created, and every blob file on disk whose
content hashes to its name is registered again (unreferenced, so gc sweeps
it past the grace period unless a writer stores the same content again).
Files that do not hash to their name, and anything that is not a regular
file (a symlink is never followed), are moved to ``quarantine/``.

What this cannot restore yet: entries, manifests, inline blobs, LRU order
and counters live only in the index until the on-disk records of invariant
9 exist, so every entry of the damaged index is lost (a miss; the next save
stores it again).  The report says so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from .ballast import Ballast
from .errors import StoreError
from .fsutil import fsync_dir
from .index import Index
from .indexfile import FRESH_INDEX_BYTES
from .layout import Layout
from .records import BlobRow
from .tables import Tables, Txn

__all__ = ["RebuildPlan", "RebuildReport", "plan_rebuild", "LOST_WITH_THE_INDEX"]

log = logging.getLogger(__name__)

_CHUNK = 4 << 20
_BATCH = 500

#: The warning every rebuild reports (until invariant 9's records exist).
LOST_WITH_THE_INDEX = (
    "entries, manifests, inline blobs, LRU order and counters lived only in the damaged index and are lost: "
    "lookups miss until the next save (rebuilding entries needs the on-disk records of invariant 9, "
    "not written yet)"
)


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What a rebuild did."""

    damaged_index: str  # where the damaged index/ was moved
    registered: int
    registered_bytes: int
    quarantined: tuple[str, ...]
    lost: str = LOST_WITH_THE_INDEX


@dataclass(frozen=True, slots=True)
class RebuildPlan:
    """Move ``index/`` aside, create a fresh index, re-register ``blob_files``."""

    layout: Layout
    why: str
    blob_files: tuple[Path, ...] = field(default=())

    @property
    def destination(self) -> Path:
        return self.layout.quarantine / f"index.{time.time_ns()}"

    def execute(self) -> RebuildReport:
        layout = self.layout
        if Index.users(layout.index):
            raise StoreError(f"cannot rebuild the index of {layout.root}: this process still has it open")
        layout.mkdir(layout.quarantine)
        dest = self.destination
        if os.path.lexists(layout.index):
            os.replace(layout.index, dest)
            fsync_dir(layout.root)
        log.warning("moved the damaged index of %s to %s (%s)", layout.root, dest, self.why)
        layout.mkdir(layout.index)
        if shutil.disk_usage(layout.index).free < FRESH_INDEX_BYTES:
            Ballast(layout.root).release()  # what the ballast is for: room for the fresh index
        good: list[tuple[str, int]] = []
        bad: list[str] = []
        for path in self.blob_files:
            found = _hash_blob_file(path)
            if found is not None and found[0] == path.name and path.parent.name == path.name[:2]:
                good.append((path.name, found[1]))
                continue
            target = layout.quarantine / f"{path.name}.{time.time_ns()}"
            try:
                os.replace(path, target)  # renames a symlink itself, never its target
                bad.append(str(path))
            except OSError as exc:
                log.warning("could not quarantine %s: %s", path, exc)
        index = Index.acquire(layout.index, group_shared=layout.group_shared)
        try:
            tables = Tables(index, layout)
            now = time.time()
            for i in range(0, len(good), _BATCH):
                def fn(t: Txn, batch: list[tuple[str, int]] = good[i:i + _BATCH]) -> None:
                    for digest, size in batch:
                        t.put_blob(digest, BlobRow(size, 0, now, 0), inline=None)

                tables.write(fn)
        finally:
            index.release()
        return RebuildReport(str(dest), len(good), sum(s for _, s in good), tuple(bad))


def _hash_blob_file(path: Path) -> tuple[str, int] | None:
    """(SHA-256, size) of a regular blob file, read without following a symlink; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        h = hashlib.sha256()
        n = 0
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
            n += len(chunk)
        return h.hexdigest(), n
    except OSError:
        return None
    finally:
        os.close(fd)


def plan_rebuild(layout: Layout, why: str) -> RebuildPlan:
    """The plan for ``layout``: every file under ``blobs/ab/`` (named like a digest or not)."""
    files: list[Path] = []
    if layout.blobs.is_dir() and not layout.blobs.is_symlink():
        for sub in sorted(layout.blobs.iterdir()):
            if sub.is_symlink() or not sub.is_dir():
                continue
            files += sorted(sub.iterdir())  # a name that is no digest fails the hash check: moved aside
    return RebuildPlan(layout, why, tuple(files))
