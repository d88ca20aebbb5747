"""The store's LMDB tables, typed: the only module that names a database.

Every other store module reads and writes rows through a :class:`Txn` (one
transaction's typed view) from :class:`Tables` (``read()``, ``write(fn)``).
So the rows an entry owns (entry, access, components) are dropped in one
place; the totals in ``meta`` (physical, logical and pinned bytes) follow
every row that changes them; and every change that can take a blob away from
a hit (a row dropped, quarantined or replaced) moves the blob epoch that the
lookup memo trusts (docs/architecture.md, "How an entry lives").  Each :class:`Txn` notes the
manifests and pins it drops, whichever operation it serves, so that their
on-disk records follow once it committed (``Tables.after_commit``; docs/operations.md,
"Damage and repair").
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import lmdb

from ..clock import Clock, system_clock
from ..errors import CorruptRow
from .blobrows import BlobRows
from .drops import BOTH_RECORDS, COMMITTED_RECORD, Drops
from .entryrows import EntryRows
from .env import index_error
from .lmdbio import RawCursor, RawTxn
from .rows import LeaseRow, Manifest, manifest_key, manifest_prefix, manifest_refs
from .schema import BLOB_EPOCH, WRITES
from .shadows import Head, refs_of

if TYPE_CHECKING:
    from ..layout import Layout
    from .env import Index

__all__ = ["AfterCommit", "Tables", "Txn"]

log = logging.getLogger(__name__)

T = TypeVar("T")


#: What a store does after a commit that dropped manifests or pins (``obsolete.obsolete_dropped``:
#: their records are listed as obsolete).  The index layer knows nothing of record files.
AfterCommit = Callable[["Tables", Drops], None]


_I64 = struct.Struct("<q")


def _int(raw: bytes | None) -> int:
    return _I64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0


class Txn(EntryRows, BlobRows):
    """One LMDB transaction, typed by table.

    In a write transaction the changes to totals and counters are summed in
    memory and written once, before the commit (:meth:`finish`), so a batch
    of thousands of rows costs one read-modify-write per total.
    """

    __slots__ = ("raw", "_db", "_deltas", "_epoch_moved", "_cursor", "drops", "clock", "lock_only")

    def __init__(
        self, raw: lmdb.Transaction, db: Mapping[str, Any], clock: Clock = system_clock, *, lock_only: bool = False
    ) -> None:
        self.raw = cast(RawTxn, raw)  # values are bytes: no transaction of the store uses buffers=True
        self._db = db
        self.clock = clock  # the store's (``Tables.clock``): rows stamped in this transaction use it
        self.lock_only = lock_only  # holds the write lock to act on files; changes no row (``Tables.locked``)
        self._deltas: dict[tuple[str, bytes], int] | None = None  # (table, name) -> delta; made when needed
        self._epoch_moved = False
        self._cursor: RawCursor | None = None  # on ``manifests``, reused by the per-key scans
        self.drops: Drops | None = None  # made on the first drop (read transactions allocate none)

    def _drops(self) -> Drops:
        if self.drops is None:
            self.drops = Drops()
        return self.drops

    def finish(self) -> None:
        """Write the summed totals, counters, the epoch and the write count (write transactions only)."""
        meta = self._db["meta"]
        if self.lock_only:
            if self._deltas or self._epoch_moved:
                raise RuntimeError("a lock-only transaction changed the index")  # a bug: use Tables.write
            return
        self.raw.put(WRITES, _I64.pack(_int(self.raw.get(WRITES, None, meta)) + 1), db=meta)
        for (table, name), delta in (self._deltas or {}).items():
            if delta:
                db = self._db[table]
                self.raw.put(name, _I64.pack(_int(self.raw.get(name, None, db)) + delta), db=db)
        if self._epoch_moved:
            self.raw.put(BLOB_EPOCH, _I64.pack(_int(self.raw.get(BLOB_EPOCH, None, meta)) + 1), db=meta)
        self._deltas, self._epoch_moved = None, False

    def _add_to(self, table: str, name: bytes, delta: int) -> None:
        if self._deltas is None:
            self._deltas = {}
        self._deltas[(table, name)] = self._deltas.get((table, name), 0) + delta

    # -- totals, counters, meta ---------------------------------------------
    def total(self, name: bytes) -> int:
        return _int(self.raw.get(name, None, self._db["meta"])) + (self._deltas or {}).get(("meta", name), 0)

    def set_total(self, name: bytes, value: int) -> None:
        if self._deltas is not None:
            self._deltas.pop(("meta", name), None)
        self.raw.put(name, _I64.pack(value), db=self._db["meta"])

    def has_total(self, name: bytes) -> bool:
        return self.raw.get(name, None, self._db["meta"]) is not None

    def writes(self) -> int:
        """The write count this transaction sees (:data:`WRITES`)."""
        return _int(self.raw.get(WRITES, None, self._db["meta"]))

    def epoch(self) -> bytes | None:
        """The blob epoch as stored (compared by value, never interpreted)."""
        return self.raw.get(BLOB_EPOCH, None, self._db["meta"])

    def move_epoch(self) -> None:
        self._epoch_moved = True

    def count(self, name: str, delta: int = 1) -> None:
        """Add ``delta`` to the persistent counter ``name`` (``misses.absent``, ``evictions``)."""
        self._add_to("stats", name.encode(), delta)

    def zero_counters(self) -> None:
        """Empty the ``stats`` table: every counter reads 0 again (``ccache -z``); totals are kept."""
        self.raw.drop(self._db["stats"], delete=False)
        if self._deltas is not None:
            self._deltas = {k: v for k, v in self._deltas.items() if k[0] != "stats"}

    def counters(self) -> dict[str, int]:
        return {
            bytes(k).decode(errors="replace"): _I64.unpack(v)[0]
            for k, v in self.raw.cursor(db=self._db["stats"])
            if len(v) == 8
        }

    def meta(self, name: bytes) -> bytes | None:
        return self.raw.get(name, None, self._db["meta"])

    def put_meta(self, name: bytes, value: bytes) -> None:
        self.raw.put(name, value, db=self._db["meta"])

    def drop_meta(self, name: bytes) -> None:
        self.raw.delete(name, db=self._db["meta"])

    def meta_items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """The ``meta`` rows whose names start with ``prefix`` (download reservations)."""
        cursor = self.raw.cursor(db=self._db["meta"])
        if not cursor.set_range(prefix):
            return
        for name, value in cursor:
            if not bytes(name).startswith(prefix):
                return
            yield bytes(name), bytes(value)

    def rows(self, table: str) -> int:
        """Number of rows in ``table``."""
        return int(self.raw.stat(self._db[table])["entries"])

    # -- manifests ------------------------------------------------------------
    def manifest_row(self, mk: bytes) -> bytes | None:
        return self.raw.get(mk, None, self._db["manifests"])

    def manifest(self, key: str, rank: int, generation: int) -> Manifest | None:
        mk = manifest_key(key, rank, generation)
        raw = self.raw.get(mk, None, self._db["manifests"])
        return None if raw is None else Manifest.decode(mk, raw)

    def manifest_rows(self, key: str | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(manifest key, row) of every manifest of ``key`` (every rank and generation), or of all."""
        cur = self.raw.cursor(db=self._db["manifests"])
        if key is None:
            yield from cur
            return
        prefix = manifest_prefix(key)
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            if not k.startswith(prefix):
                break
            yield k, v

    def manifests_of(self, key: str) -> Iterator[Manifest]:
        for mk, raw in self.manifest_rows(key):
            yield Manifest.decode(mk, raw)

    def put_manifest(self, manifest: Manifest) -> None:
        mk = manifest_key(manifest.key, manifest.rank, manifest.generation)
        self.raw.put(mk, manifest.encode(), db=self._db["manifests"])

    def drop_manifest(self, manifest: Manifest) -> list[str]:
        """Delete one manifest row and release its blob references; returns digests now unreferenced."""
        self.drop_manifest_row(manifest_key(manifest.key, manifest.rank, manifest.generation))
        return self.release(manifest.digests())

    def drop_manifest_row(self, mk: bytes) -> None:
        """Delete a manifest row without releasing references (``verify --fix`` recounts)."""
        if self.raw.delete(mk, db=self._db["manifests"]):
            self._drops().manifests.append((mk, BOTH_RECORDS))

    def take_manifests_of(
        self,
        key: str,
        *,
        keep_pending_since: float | None = None,
        shadow: tuple[bytes, Head] | None = None,
        in_flight: Callable[[bytes, bytes], bool] | None = None,
    ) -> tuple[Sequence[bytes], bool]:
        """Delete every manifest row of ``key``; returns the references they held and whether one was kept.

        References are 32-byte digests, one per manifest and digest; they
        are *not* released here (a batch counts them and calls
        :meth:`release_counts` once).  With ``keep_pending_since``,
        uncommitted rows created since then are kept, and so are those
        ``in_flight(manifest key, row)`` says a live process is saving.
        When the rows are exactly the ones the entry's ``shadow`` (and its
        head) was made from, their references come from it; otherwise each
        row is decoded.
        """
        keys, rows = self.manifests_listed(key)
        delete, manifests = self.raw.delete, self._db["manifests"]
        shadowed = refs_of(shadow[0], shadow[1], rows) if shadow is not None else None
        if shadowed is not None:  # exactly the current manifests: committed
            for mk in keys:
                delete(mk, db=manifests)
            self._drops().manifests.extend((mk, COMMITTED_RECORD) for mk in keys)
            return shadowed, False
        taken: list[bytes] = []
        kept = False
        for mk, raw in zip(keys, rows, strict=True):
            digests, committed, created = manifest_refs(raw)
            if (
                keep_pending_since is not None
                and not committed
                and (created >= keep_pending_since or (in_flight is not None and in_flight(mk, raw)))
            ):
                kept = True
                continue
            taken += [bytes.fromhex(d) for d in digests]
            delete(mk, db=manifests)
            self._drops().manifests.append((mk, COMMITTED_RECORD if committed else BOTH_RECORDS))
        return taken, kept

    def manifests_listed(self, key: str) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """The keys and the rows of every manifest of ``key`` (one cursor reused per transaction)."""
        if self._cursor is None:
            self._cursor = self.raw.cursor(db=self._db["manifests"])
        cur, prefix = self._cursor, manifest_prefix(key)
        keys: list[bytes] = []
        rows: list[bytes] = []
        found = cur.set_range(prefix)
        while found:
            mk = cur.key()
            if not mk.startswith(prefix):
                break
            keys.append(mk)
            rows.append(cur.value())
            found = cur.next()
        return tuple(keys), tuple(rows)

    # -- leases ---------------------------------------------------------------
    def put_lease(self, lease_id: bytes, record: LeaseRow) -> None:
        self.raw.put(lease_id, record.encode(), db=self._db["leases"])

    def drop_lease(self, lease_id: bytes) -> None:
        self.raw.delete(lease_id, db=self._db["leases"])

    def leases(self) -> Iterator[tuple[bytes, LeaseRow | None]]:
        """(lease id, record) of every lease; an undecodable row has record None."""
        for k, v in self.raw.cursor(db=self._db["leases"]):
            try:
                yield bytes(k), LeaseRow.decode(bytes(k), bytes(v))
            except CorruptRow:
                yield bytes(k), None


class _Reading:
    """``with tables.read() as t``: a short read-only transaction (a class, not a generator: hot path)."""

    __slots__ = ("_tables", "_txn")

    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self._txn: lmdb.Transaction | None = None

    def __enter__(self) -> Txn:
        index = self._tables.index
        self._txn = index.begin_read()
        return Txn(self._txn, index.db, self._tables.clock)

    def __exit__(self, *exc: object) -> None:
        if self._txn is not None:
            self._tables.index.end_read(self._txn)
        if isinstance(exc[1], lmdb.Error):  # a damaged page: the store's own error (``env.index_error``)
            raise index_error(exc[1], self._tables.index.path) from exc[1]


class Tables:
    """Typed transactions over one :class:`~adstore.store.index.env.Index`."""

    __slots__ = ("index", "layout", "clock", "after_commit")

    def __init__(
        self, index: Index, layout: Layout, clock: Clock = system_clock, *, after_commit: AfterCommit | None = None
    ) -> None:
        self.index = index
        self.layout = layout
        self.clock = clock  #: where every part of the store gets "now" (``clock``)
        #: Run after each commit that dropped manifests or pins (None: their records are left to gc's
        #: sweep, which finds them orphaned).
        self.after_commit = after_commit

    def read(self) -> _Reading:
        return _Reading(self)

    def locked(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` holding the write lock, to act on files while no writer can change a row.

        A lock-only transaction changes no row (a changed total or epoch is
        a bug) and is not counted in :data:`WRITES`: it must not make an
        eviction pass believe that someone else wrote.
        """

        def run(raw: lmdb.Transaction) -> T:
            t = Txn(raw, self.index.db, self.clock, lock_only=True)
            result = fn(t)
            t.finish()
            return result

        return self.index.write(run)

    def write(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in one write transaction and commit (``fn`` may run again after the map grew).

        The records of the manifests it dropped are obsoleted and the pin markers of the entries it
        dropped unlinked, after the commit (:attr:`after_commit`).
        """
        result, drops = self.write_noting_drops(fn)
        if drops and self.after_commit is not None:
            self.after_commit(self, drops)
        return result

    def write_noting_drops(self, fn: Callable[[Txn], T]) -> tuple[T, Drops | None]:
        """:meth:`write`, leaving the records of what it dropped to the caller (``Store.commit``)."""
        noted: list[Drops | None] = [None]

        def run(raw: lmdb.Transaction) -> T:
            t = Txn(raw, self.index.db, self.clock)
            result = fn(t)
            t.finish()
            noted[0] = t.drops  # of the run that commits
            return result

        return self.index.write(run), noted[0]
