"""Upgrading an index written by an older adstore, in place, when a store opens it.

A schema version names a layout of the rows (``index.SCHEMA_VERSION``).  An
index of an older version that has a migration here is upgraded in the write
transaction that opens it, so every process sees either the old version or
the new one; an index without a way up (or of a newer version) is refused
(``incompatible_store``): the store is a cache, and moving it aside is
always safe.

* **3 → 4**: eviction no longer *owes* blob references.  An eviction pass
  used to write the references a batch dropped into a ``releases`` table and
  release them later; the references still owed there are released now
  (refcounts drop to what the manifests hold, and blobs left at zero go with
  the next sweep), and the table goes.  The write count (``schema.WRITES``)
  that eviction now compares starts at 0.  An index written before pinned
  bytes were kept as a total gets that total.
* **4 → 5**: blob files may hold a zstd frame of their content (``codec``):
  each blob row gains the size its file (or inline value) takes on disk,
  which budgets now count.  Every blob of an older store is stored raw, so
  that size is its content's; the files are read as they are.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import lmdb

from ..errors import CorruptRow
from .rows import BLOB_ROW, Entry
from .schema import CONTENT_BYTES, PINNED_BYTES

__all__ = ["MIGRATIONS", "migrate"]

log = logging.getLogger(__name__)

#: A blob row of schema 4 and earlier: size, refcount, last put, flags.
_ROW_4 = struct.Struct("<QqdB")

#: ``migration(env, txn, db)`` upgrades an index of version N to N + 1 inside ``txn``.
Migration = Callable[[lmdb.Environment, lmdb.Transaction, Mapping[str, Any]], None]


def _to_4(env: lmdb.Environment, txn: lmdb.Transaction, db: Mapping[str, Any]) -> None:
    _release_owed(env, txn, db)
    if txn.get(PINNED_BYTES, db=db["meta"]) is None:
        pinned = 0
        for k, v in txn.cursor(db=db["entries"]):
            try:
                entry = Entry.decode(bytes(k), bytes(v))
            except CorruptRow:
                continue  # verify reports it (and recounts the totals)
            pinned += entry.bytes if entry.pinned else 0
        txn.put(PINNED_BYTES, pinned.to_bytes(8, "little", signed=True), db=db["meta"])


def _release_owed(env: lmdb.Environment, txn: lmdb.Transaction, db: Mapping[str, Any]) -> None:
    try:
        releases = env.open_db(b"releases", txn=txn, create=False)
    except lmdb.NotFoundError:
        return
    owed: Counter[bytes] = Counter()
    for _, value in txn.cursor(db=releases):
        row = bytes(value)
        owed.update(row[i : i + 32] for i in range(0, len(row) - len(row) % 32, 32))
    blobs = db["blobs"]
    for key, n in sorted(owed.items()):
        raw = txn.get(key, db=blobs)
        if raw is None or len(raw) != _ROW_4.size:
            continue  # gone, or damaged: verify --fix recounts
        size, refs, touched, flags = _ROW_4.unpack(raw)
        txn.put(key, _ROW_4.pack(size, max(0, refs - n), touched, flags), db=blobs)
    txn.drop(releases, delete=True)
    if owed:
        log.info("index upgraded to schema 4: released %d owed reference(s)", sum(owed.values()))


def _to_5(env: lmdb.Environment, txn: lmdb.Transaction, db: Mapping[str, Any]) -> None:
    blobs = db["blobs"]
    rows = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=blobs)]
    content = 0
    for key, raw in rows:
        if len(raw) != _ROW_4.size:
            continue  # damaged: verify reports it (and --fix drops it)
        size, refs, touched, flags = _ROW_4.unpack(raw)
        txn.put(key, BLOB_ROW.pack(size, refs, touched, flags, size), db=blobs)  # raw: stored as it is
        content += size
    txn.put(CONTENT_BYTES, content.to_bytes(8, "little", signed=True), db=db["meta"])


MIGRATIONS: dict[int, Migration] = {3: _to_4, 4: _to_5}


def migrate(env: lmdb.Environment, txn: lmdb.Transaction, db: Mapping[str, Any], found: int, target: int) -> bool:
    """Upgrade an index of version ``found`` to ``target`` inside ``txn``; False if there is no way up."""
    if not found < target or any(v not in MIGRATIONS for v in range(found, target)):
        return False
    for version in range(found, target):
        MIGRATIONS[version](env, txn, db)
    return True
