"""The store's LMDB tables, typed: the only module that names a database.

Every other store module reads and writes rows through a :class:`Txn` (one
transaction's typed view) from :class:`Tables` (``read()``, ``write(fn)``).
So the rows an entry owns (entry, access, components) are dropped in one
place; the totals in ``meta`` (physical, logical and pinned bytes) follow
every row that changes them; and every change that can take a blob away from
a hit (a row dropped, quarantined or replaced) moves the blob epoch that the
lookup memo trusts (README, "Using the store").  Files are unlinked only after
the transaction that dropped their rows committed (:meth:`Tables.unlink_after_commit`).
"""

from __future__ import annotations

import logging
import os
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb

from .errors import BlobMissing, CorruptRecord
from .records import (
    ACCESS_ROW,
    FLAG_INLINE,
    FLAG_QUARANTINED,
    BlobRow,
    Entry,
    LeaseRecord,
    Manifest,
    decode_json,
    encode_json,
    manifest_key,
    manifest_prefix,
    ManifestRefs,
    manifest_refs,
)

if TYPE_CHECKING:
    from .index import Index
    from .layout import Layout

__all__ = ["DATABASES", "Tables", "Txn", "PHYSICAL", "LOGICAL", "PINNED", "BLOB_EPOCH", "BUDGET"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The named databases of the index.
DATABASES = ("blobs", "blobdata", "entries", "access", "components", "manifests", "leases", "stats", "meta")

#: Totals in ``meta`` that would otherwise need a full scan; ``verify --fix`` recounts them.
PHYSICAL = b"physical_bytes"
LOGICAL = b"logical_bytes"
PINNED = b"pinned_bytes"
#: In ``meta``: moved by every transaction that takes a blob row away from
#: lookups (drops it, quarantines it, replaces it), so that a lookup may trust
#: blob rows it checked before while this value is unchanged (``lookup.LookupMemo``).
BLOB_EPOCH = b"blob_epoch"
#: In ``meta``: the budget the daemon enforces (``budget.Budget``, JSON).
BUDGET = b"budget"

_I64 = struct.Struct("<q")
_UNLINK_BATCH = 1000


def _int(raw: bytes | None) -> int:
    return _I64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0


class Txn:
    """One LMDB transaction, typed by table.

    In a write transaction the changes to totals and counters are summed in
    memory and written once, before the commit (:meth:`finish`), so a batch
    of thousands of rows costs one read-modify-write per total.
    """

    __slots__ = ("raw", "_db", "_totals", "_counts", "_epoch_moved")

    def __init__(self, raw: lmdb.Transaction, db: Mapping[str, Any]) -> None:
        self.raw = raw
        self._db = db
        self._totals: Counter[bytes] = Counter()
        self._counts: Counter[bytes] = Counter()
        self._epoch_moved = False

    def finish(self) -> None:
        """Write the summed totals, counters and the epoch (write transactions only)."""
        meta, stats = self._db["meta"], self._db["stats"]
        for name, delta in self._totals.items():
            if delta:
                self.raw.put(name, _I64.pack(_int(self.raw.get(name, None, meta)) + delta), db=meta)
        for name, delta in self._counts.items():
            if delta:
                self.raw.put(name, _I64.pack(_int(self.raw.get(name, None, stats)) + delta), db=stats)
        if self._epoch_moved:
            self.raw.put(BLOB_EPOCH, _I64.pack(_int(self.raw.get(BLOB_EPOCH, None, meta)) + 1), db=meta)
        self._totals.clear()
        self._counts.clear()
        self._epoch_moved = False

    # -- totals, counters, meta ---------------------------------------------
    def total(self, name: bytes) -> int:
        return _int(self.raw.get(name, None, self._db["meta"])) + self._totals[name]

    def add_total(self, name: bytes, delta: int) -> None:
        self._totals[name] += delta

    def set_total(self, name: bytes, value: int) -> None:
        self._totals[name] = 0
        self.raw.put(name, _I64.pack(value), db=self._db["meta"])

    def has_total(self, name: bytes) -> bool:
        return self.raw.get(name, None, self._db["meta"]) is not None

    def epoch(self) -> bytes | None:
        """The blob epoch as stored (compared by value, never interpreted)."""
        return self.raw.get(BLOB_EPOCH, None, self._db["meta"])

    def move_epoch(self) -> None:
        self._epoch_moved = True

    def count(self, name: str, delta: int = 1) -> None:
        """Add ``delta`` to the persistent counter ``name`` (``misses.absent``, ``evictions``)."""
        self._counts[name.encode()] += delta

    def counters(self) -> dict[str, int]:
        return {bytes(k).decode(errors="replace"): _I64.unpack(v)[0]
                for k, v in self.raw.cursor(db=self._db["stats"]) if len(v) == 8}

    def meta(self, name: bytes) -> bytes | None:
        return self.raw.get(name, None, self._db["meta"])

    def put_meta(self, name: bytes, value: bytes) -> None:
        self.raw.put(name, value, db=self._db["meta"])

    def rows(self, table: str) -> int:
        """Number of rows in ``table``."""
        return int(self.raw.stat(self._db[table])["entries"])

    # -- entries, access, components ----------------------------------------
    def entry_row(self, key: bytes) -> bytes | None:
        return self.raw.get(key, None, self._db["entries"])

    def entry(self, key: str) -> Entry | None:
        """The entry of ``key`` with its last access and hits, or None."""
        raw_key = key.encode()
        raw = self.raw.get(raw_key, None, self._db["entries"])
        return None if raw is None else self.with_access(Entry.decode(raw_key, raw))

    def entry_rows(self, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """(key, row) of every entry, in key order from ``start``."""
        cur = self.raw.cursor(db=self._db["entries"])
        if start and not cur.set_range(start):
            return
        for k, v in cur:  # from the current position (the first row if none)
            yield bytes(k), bytes(v)

    def entries(self) -> Iterator[tuple[Entry, bytes]]:
        """Every decodable entry (with its row); undecodable rows are logged and skipped."""
        for k, v in self.entry_rows():
            try:
                yield Entry.decode(k, v), v
            except CorruptRecord as exc:
                log.warning("%s", exc)

    def put_entry(self, entry: Entry) -> None:
        """Write an entry row; the logical and pinned totals follow the row it replaces."""
        raw_key = entry.key.encode()
        old = self._decoded_or_none(raw_key, self.raw.get(raw_key, None, self._db["entries"]))
        self._entry_totals(old, -1)
        self._entry_totals(entry, +1)
        self.raw.put(raw_key, entry.encode(), db=self._db["entries"])

    def drop_entry(self, key: str, entry: Entry | None = None) -> None:
        """Delete an entry's rows (entry, access, components) and its share of the totals.

        ``entry`` is the decoded row when the caller has it; else it is read.
        """
        raw_key = key.encode()
        db = self._db
        if entry is None:
            entry = self._decoded_or_none(raw_key, self.raw.get(raw_key, None, db["entries"]))
        self._entry_totals(entry, -1)
        self.raw.delete(raw_key, db=db["entries"])
        self.raw.delete(raw_key, db=db["access"])
        self.raw.delete(raw_key, db=db["components"])

    def drop_entry_key(self, raw_key: bytes) -> None:
        """Delete an undecodable entry's rows (``verify --fix``); totals are recounted there."""
        for table in ("entries", "access", "components"):
            self.raw.delete(raw_key, db=self._db[table])

    def _entry_totals(self, entry: Entry | None, sign: int) -> None:
        if entry is not None:
            self._totals[LOGICAL] += sign * entry.bytes
            if entry.pinned:
                self._totals[PINNED] += sign * entry.bytes

    @staticmethod
    def _decoded_or_none(raw_key: bytes, raw: bytes | None) -> Entry | None:
        if raw is None:
            return None
        try:
            return Entry.decode(raw_key, raw)
        except CorruptRecord:
            return None

    def access(self, raw_key: bytes) -> tuple[float, int] | None:
        """(last access, hits) from the entry's ``access`` row; None if absent or unreadable."""
        raw = self.raw.get(raw_key, None, self._db["access"])
        return ACCESS_ROW.unpack(raw) if raw is not None and len(raw) == ACCESS_ROW.size else None

    def with_access(self, entry: Entry) -> Entry:
        """Fill in ``entry``'s last access and hits from its ``access`` row (if readable)."""
        access = self.access(entry.key.encode())
        if access is not None:
            entry.last_access, entry.hits = access
        return entry

    def put_access(self, key: str, when: float, hits: int) -> None:
        self.raw.put(key.encode(), ACCESS_ROW.pack(when, hits), db=self._db["access"])

    def stray_access_keys(self) -> list[bytes]:
        """Keys of access rows whose entry is gone."""
        entries = self._db["entries"]
        return [bytes(k) for k in self.raw.cursor(db=self._db["access"]).iternext(values=False)
                if self.raw.get(bytes(k), None, entries) is None]

    def drop_access(self, raw_key: bytes) -> None:
        self.raw.delete(raw_key, db=self._db["access"])

    def components(self, key: str) -> dict[str, Any]:
        raw = self.raw.get(key.encode(), None, self._db["components"])
        return {} if raw is None else decode_json(raw, "components", key.encode())

    def put_components(self, key: str, components: Mapping[str, Any]) -> None:
        if components:
            self.raw.put(key.encode(), encode_json(dict(components)), db=self._db["components"])

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
            for k, v in cur:
                yield bytes(k), bytes(v)
            return
        prefix = manifest_prefix(key)
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            if not k.startswith(prefix):
                break
            yield bytes(k), bytes(v)

    def manifests_of(self, key: str) -> Iterator[Manifest]:
        for mk, raw in self.manifest_rows(key):
            yield Manifest.decode(mk, raw)

    def put_manifest(self, manifest: Manifest) -> None:
        mk = manifest_key(manifest.key, manifest.rank, manifest.generation)
        self.raw.put(mk, manifest.encode(), db=self._db["manifests"])

    def drop_manifest(self, manifest: Manifest) -> list[str]:
        """Delete one manifest row and release its blob references; returns digests now unreferenced."""
        self.raw.delete(manifest_key(manifest.key, manifest.rank, manifest.generation), db=self._db["manifests"])
        return self.release(manifest.digests())

    def drop_manifest_row(self, mk: bytes) -> None:
        """Delete a manifest row whose references cannot be read back (``verify --fix`` recounts)."""
        self.raw.delete(mk, db=self._db["manifests"])

    def take_manifests_of(
        self,
        key: str,
        *,
        keep: Callable[[bool, float], bool] | None = None,
        known: Mapping[bytes, tuple[bytes, ManifestRefs]] | None = None,
    ) -> tuple[Counter[str], bool]:
        """Delete every manifest row of ``key``; returns the references they held and whether one was kept.

        The references are *not* released here: a batch sums them and calls
        :meth:`release` once.  ``keep(committed, created)`` spares a row (a
        save in flight).  ``known`` maps a manifest key to (row, its
        :func:`~adstore.store.records.manifest_refs`) as read earlier: a
        byte-identical row is not decoded again.
        """
        refs: Counter[str] = Counter()
        kept = False
        prefix = manifest_prefix(key)
        cur = self.raw.cursor(db=self._db["manifests"])
        found = cur.set_range(prefix)
        while found and cur.key().startswith(prefix):
            raw = cur.value()
            seen = known.get(cur.key()) if known is not None else None
            digests, committed, created = seen[1] if seen is not None and seen[0] == raw else manifest_refs(raw)
            if keep is not None and keep(committed, created):
                kept = True
                found = cur.next()
                continue
            refs.update(digests)
            found = cur.delete()  # moves to the next row
        return refs, kept

    # -- blobs ----------------------------------------------------------------
    def blob_row(self, digest: str) -> BlobRow | None:
        k = bytes.fromhex(digest)
        raw = self.raw.get(k, None, self._db["blobs"])
        return None if raw is None else BlobRow.decode(raw, k)

    def blob_row_raw(self, row_key: bytes) -> bytes | None:
        """A blob row's bytes by its 32-byte key (the lookup's hot path unpacks them itself)."""
        return self.raw.get(row_key, None, self._db["blobs"])

    def blob_rows(self) -> Iterator[tuple[bytes, bytes]]:
        """(row key, row) of every blob row, malformed ones included."""
        for k, v in self.raw.cursor(db=self._db["blobs"]):
            yield bytes(k), bytes(v)

    def inline_value(self, digest: str) -> bytes | None:
        """An inline blob's ``blobdata`` value (checksum head + bytes)."""
        return self.raw.get(bytes.fromhex(digest), None, self._db["blobdata"])

    def touch_blob(self, digest: str, row: BlobRow) -> None:
        """Rewrite a blob row that keeps its size and content (refs, last put)."""
        self.raw.put(bytes.fromhex(digest), row.encode(), db=self._db["blobs"])

    def put_blob(self, digest: str, row: BlobRow, *, inline: bytes | None) -> None:
        """Register a blob (new, or replacing a damaged row); ``inline`` is its ``blobdata`` value."""
        k = bytes.fromhex(digest)
        db = self._db
        old = self.raw.get(k, None, db["blobs"])
        if old is not None:
            self._totals[PHYSICAL] -= BlobRow.decode(old, k).size
            self._epoch_moved = True  # a repair: checks against the old row no longer hold
        self._totals[PHYSICAL] += row.size
        if inline is not None:
            self.raw.put(k, inline, db=db["blobdata"])
        else:
            self.raw.delete(k, db=db["blobdata"])
        self.raw.put(k, row.encode(), db=db["blobs"])

    def drop_blob(self, digest: str, row: BlobRow) -> None:
        """Delete a blob's rows (``row`` as read in this transaction); its file goes after the commit."""
        k = bytes.fromhex(digest)
        self.raw.delete(k, db=self._db["blobs"])
        self.raw.delete(k, db=self._db["blobdata"])
        self._totals[PHYSICAL] -= row.size
        self._epoch_moved = True

    def drop_blob_key(self, row_key: bytes) -> None:
        """Delete an undecodable blob row (``verify --fix``); totals are recounted there."""
        self.raw.delete(row_key, db=self._db["blobs"])
        self.raw.delete(row_key, db=self._db["blobdata"])
        self._epoch_moved = True

    def quarantine_blob(self, digest: str, row: BlobRow) -> None:
        """Flag a blob as failed: lookups miss on it from now on; its inline bytes go."""
        row.flags = (row.flags & ~FLAG_INLINE) | FLAG_QUARANTINED
        k = bytes.fromhex(digest)
        self.raw.delete(k, db=self._db["blobdata"])
        self.raw.put(k, row.encode(), db=self._db["blobs"])
        self._epoch_moved = True

    def hold(self, digests: Iterable[str]) -> None:
        """Take one reference on each blob; a blob without a row is :class:`BlobMissing`."""
        for digest in digests:
            row = self.blob_row(digest)
            if row is None:
                raise BlobMissing(digest, "not registered")
            row.refs += 1
            self.touch_blob(digest, row)

    def release(self, refs: Iterable[str] | Mapping[str, int]) -> list[str]:
        """Drop references (one per digest, or ``n`` per digest of a mapping); returns digests now at zero."""
        counts = refs if isinstance(refs, Mapping) else Counter(refs)
        zero: list[str] = []
        blobs = self._db["blobs"]
        for digest, n in counts.items():
            k = bytes.fromhex(digest)
            raw = self.raw.get(k, None, blobs)
            if raw is None:
                continue
            row = BlobRow.decode(raw, k)
            row.refs = max(0, row.refs - n)
            self.raw.put(k, row.encode(), db=blobs)
            if row.refs == 0:
                zero.append(digest)
        return zero

    # -- leases ---------------------------------------------------------------
    def put_lease(self, lease_id: bytes, record: LeaseRecord) -> None:
        self.raw.put(lease_id, record.encode(), db=self._db["leases"])

    def drop_lease(self, lease_id: bytes) -> None:
        self.raw.delete(lease_id, db=self._db["leases"])

    def leases(self) -> Iterator[tuple[bytes, LeaseRecord | None]]:
        """(lease id, record) of every lease; an undecodable row has record None."""
        for k, v in self.raw.cursor(db=self._db["leases"]):
            try:
                yield bytes(k), LeaseRecord.decode(bytes(k), bytes(v))
            except CorruptRecord:
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
        return Txn(self._txn, index.db)

    def __exit__(self, *exc: object) -> None:
        if self._txn is not None:
            self._tables.index.end_read(self._txn)


class Tables:
    """Typed transactions over one :class:`~adstore.store.index.Index`, plus the after-commit unlink."""

    __slots__ = ("index", "layout")

    def __init__(self, index: Index, layout: Layout) -> None:
        self.index = index
        self.layout = layout

    def read(self) -> _Reading:
        return _Reading(self)

    def write(self, fn: Callable[[Txn], T]) -> T:
        """Run ``fn`` in one write transaction and commit (``fn`` may run again after the map grew)."""
        def run(raw: lmdb.Transaction) -> T:
            t = Txn(raw, self.index.db)
            result = fn(t)
            t.finish()
            return result

        return self.index.write(run)

    def unlink_after_commit(self, digests: Sequence[str]) -> int:
        """Unlink the blob files of ``digests`` whose rows are gone; returns the bytes unlinked.

        Called once the transaction that dropped the rows committed
        (invariant 4).  Each unlink runs under the write lock, after checking
        that no writer registered the blob again meanwhile: a writer that
        sees its file inside its registering transaction may rely on it.
        """
        total = 0
        for i in range(0, len(digests), _UNLINK_BATCH):
            batch = digests[i:i + _UNLINK_BATCH]

            def fn(t: Txn, batch: Sequence[str] = batch) -> int:
                n = 0
                for digest in batch:
                    row = t.blob_row(digest)
                    if row is not None and not row.inline and not row.quarantined:
                        continue
                    path = self.layout.blob_path(digest)
                    size = self.layout.file_size(path)
                    try:
                        os.unlink(path)
                        n += size
                    except FileNotFoundError:
                        pass
                return n

            total += self.write(fn)
        return total
