"""Records of rows a committed transaction dropped: named in obsolete lists, purged by gc.

A transaction drops manifest rows (and pins); the on-disk records of those
manifests (and the pin markers) must follow, but only after it committed,
and only if no writer brought the row back meanwhile (invariant 9).  Each
batch of them is named in one *obsolete list* that gc later purges (README,
"Damage and repair"; the protocol is in :mod:`.files`).  Each step
runs under the write lock (a lock-only transaction), re-checking the rows,
unless the caller knows no transaction committed since the drop
(``unchanged``), which is how an eviction pass writes each batch's list
inside its next batch.  :func:`obsolete_dropped` is what a store's
:class:`~.tables.Tables` runs after every commit that dropped something.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..index.drops import Drops
from ..index.rows import manifest_key
from ..names import validate_key
from .files import RecordFiles

if TYPE_CHECKING:
    from ..index.tables import Tables, Txn

__all__ = ["obsolete_dropped", "write_obsolete_list", "purge_obsolete_records"]

log = logging.getLogger(__name__)

_BATCH = 1000


def obsolete_dropped(tables: Tables, drops: Drops) -> None:
    """After a commit that dropped manifests or pins: list their records as obsolete, unlink pin markers."""
    files = RecordFiles(tables.layout)
    for i in range(0, max(len(drops.manifests), len(drops.pins)), _BATCH):
        chunk = Drops()
        chunk.manifests, chunk.pins = drops.manifests[i : i + _BATCH], drops.pins[i : i + _BATCH]

        def listed(t: Txn, chunk: Drops = chunk) -> None:
            write_obsolete_list(t, files, chunk, unchanged=False)

        try:
            tables.locked(listed)
        except OSError as exc:  # records stay behind: orphans that gc sweeps
            log.warning("could not obsolete records: %s", exc)


def write_obsolete_list(t: Txn, files: RecordFiles, drops: Drops, *, unchanged: bool) -> None:
    """Inside write transaction ``t``: name the records of ``drops`` in one obsolete list, unlink pin markers.

    A record is listed unless its manifest row is back (a restore that
    published the same generation again), a pin marker unlinked unless its
    entry is pinned again (invariant 9).  ``unchanged``: no transaction
    committed since the one that dropped them, so neither can be back.
    """
    for k in drops.pins:
        try:
            key = validate_key(k.decode())
        except (ValueError, UnicodeDecodeError):  # a damaged row's key names no file
            continue
        if unchanged or not t.is_pinned(k):
            files.set_pinned(key, False)
    gone = drops.manifests if unchanged else [(k, w) for k, w in drops.manifests if t.manifest_row(k) is None]
    files.write_obsolete_list(gone)  # under the write lock: no one publishes them again meanwhile


def purge_obsolete_records(tables: Tables) -> int:
    """gc: delete the records the obsolete lists name, then the lists; returns record files deleted.

    Each record is deleted under the write lock and only while its manifest
    row is still gone and the file is not newer than its list (a restore may
    have published the same generation again).
    """
    files = RecordFiles(tables.layout)
    lists = files.obsolete_files()
    dead = sorted(files.obsoleted().items())
    deleted = 0
    for i in range(0, len(dead), _BATCH):

        def fn(t: Txn, batch: Sequence[tuple[str, float]] = dead[i : i + _BATCH]) -> int:
            n = 0
            for name, listed_at in batch:
                ident = files.listed_identity(name)
                if ident is not None and t.manifest_row(manifest_key(*ident)) is None:
                    n += files.unlink_listed(name, listed_at)
            return n

        deleted += tables.locked(fn)
    for path in lists:  # the lists, and records an older adstore renamed into obsolete/
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return deleted
