"""File work that follows a committed index transaction: blob unlinks and obsolete records.

A transaction drops rows; the files those rows stood for go only after it
committed (invariant 4): blob files are unlinked, and the on-disk records of
dropped manifests (and pin markers of dropped entries) are named in one
*obsolete list* per batch that gc later purges (README, "Damage and repair";
the protocol is in :mod:`.recordfiles`).  Each step runs under the write
lock, re-checking that no writer brought the row back meanwhile, unless the
caller knows no transaction committed since the drop (``unchanged``), which
is how an eviction pass writes each batch's list inside its next batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .recordfiles import RecordFiles
from .names import validate_key
from .records import manifest_key

if TYPE_CHECKING:
    from .tables import Tables, Txn

__all__ = ["Drops", "COMMITTED_RECORD", "PENDING_RECORD", "BOTH_RECORDS", "unlink_after_commit",
           "write_obsolete_list", "purge_obsolete_records"]

log = logging.getLogger(__name__)

_BATCH = 1000

#: Which record files a dropped manifest may have: the committed one, the pending one (bits).
COMMITTED_RECORD, PENDING_RECORD = 1, 2
BOTH_RECORDS = COMMITTED_RECORD | PENDING_RECORD


class Drops:
    """What a write transaction dropped that has files under ``records/``: manifests and pins."""

    __slots__ = ("manifests", "pins")

    def __init__(self) -> None:
        self.manifests: list[tuple[bytes, int]] = []  # (manifest key, which record files)
        self.pins: list[bytes] = []  # entry keys that were pinned

    def __bool__(self) -> bool:
        return bool(self.manifests or self.pins)


def unlink_after_commit(tables: Tables, digests: Sequence[str], drops: Drops | None = None) -> int:
    """Unlink the blob files of ``digests`` whose rows are gone, obsolete the records of ``drops``; returns bytes.

    Called once the transaction that dropped the rows committed.  Each
    unlink runs under the write lock, after checking that no writer
    registered the blob again meanwhile: a writer that sees its file inside
    its registering transaction may rely on it.
    """
    layout, total = tables.layout, 0
    for i in range(0, len(digests), _BATCH):
        def fn(t: Txn, batch: Sequence[str] = digests[i:i + _BATCH]) -> int:
            n = 0
            for digest in batch:
                row = t.blob_row(digest)
                if row is not None and not row.inline and not row.quarantined:
                    continue  # registered again
                path = layout.blob_path(digest)
                size = layout.file_size(path)
                try:
                    os.unlink(path)
                    n += size
                except FileNotFoundError:
                    pass
            return n

        total += tables.locked(fn)
    if drops:
        files = RecordFiles(tables.layout)
        for i in range(0, max(len(drops.manifests), len(drops.pins)), _BATCH):
            chunk = Drops()
            chunk.manifests, chunk.pins = drops.manifests[i:i + _BATCH], drops.pins[i:i + _BATCH]
            try:
                tables.locked(lambda t, chunk=chunk: write_obsolete_list(t, files, chunk, unchanged=False))
            except OSError as exc:  # records stay behind: orphans that gc sweeps
                log.warning("could not obsolete records: %s", exc)
    return total


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
        def fn(t: Txn, batch: Sequence[tuple[str, float]] = dead[i:i + _BATCH]) -> int:
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
