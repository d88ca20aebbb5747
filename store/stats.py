"""Persistent counters and store-wide totals.

Counters live in the ``stats`` database as little-endian int64 values so a
bump is a read-modify-write inside whichever write transaction is already
open.  Totals that would otherwise need a full scan (physical and logical
bytes) are kept the same way in ``meta`` and recounted by ``verify --fix``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import lmdb

__all__ = ["StoreStats", "bump", "read_int", "write_int", "read_counters", "event_counters", "PHYSICAL", "LOGICAL", "BLOB_EPOCH"]

_I64 = struct.Struct("<q")

PHYSICAL = b"physical_bytes"
LOGICAL = b"logical_bytes"
#: In ``meta``: bumped by every transaction that takes a blob row away from
#: lookups (deletes it, quarantines it, changes its size), so that a lookup
#: may trust blob rows it checked before while this value is unchanged
#: (``manifests.LookupMemo``).
BLOB_EPOCH = b"blob_epoch"


def read_int(txn: lmdb.Transaction, db: object, name: bytes) -> int:
    raw = txn.get(name, db=db)
    if raw is None or len(raw) != 8:
        return 0
    return _I64.unpack(raw)[0]


def write_int(txn: lmdb.Transaction, db: object, name: bytes, value: int) -> None:
    txn.put(name, _I64.pack(value), db=db)


def bump(txn: lmdb.Transaction, db: object, name: str | bytes, delta: int) -> None:
    key = name.encode() if isinstance(name, str) else name
    if delta:
        txn.put(key, _I64.pack(read_int(txn, db, key) + delta), db=db)


def read_counters(txn: lmdb.Transaction, db: object) -> dict[str, int]:
    out: dict[str, int] = {}
    for k, v in txn.cursor(db=db):
        if len(v) == 8:
            out[bytes(k).decode(errors="replace")] = _I64.unpack(v)[0]
    return out


def event_counters(event: str, reason: str | None, seconds_saved: float = 0.0) -> Iterable[tuple[str, int]]:
    """Counter names one cache event increments (``misses`` and ``misses.<reason>``)."""
    plural = {"hit": "hits", "miss": "misses", "bypass": "bypasses", "save": "saves", "eviction": "evictions"}
    name = plural.get(event, event)
    yield name, 1
    if reason:
        yield f"{name}.{reason}", 1
    if seconds_saved > 0:
        yield "ms_saved", int(seconds_saved * 1000)


@dataclass(slots=True)
class StoreStats:
    """What `adstore stats` shows: counters plus totals of the index."""

    counters: dict[str, int] = field(default_factory=dict)
    entries: int = 0
    blobs: int = 0
    inline_blobs: int = 0
    logical_bytes: int = 0
    physical_bytes: int = 0
    pinned_bytes: int = 0
    leases: int = 0
    index_bytes: int = 0

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes referenced by entries per physical byte stored."""
        return self.logical_bytes / self.physical_bytes if self.physical_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["dedup_ratio"] = self.dedup_ratio
        return d
