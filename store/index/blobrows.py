"""The blob tables (``blobs``, ``blobdata``) of the typed transaction layer.

A part of :class:`~adstore.store.index.tables.Txn`, kept apart to keep modules
small: registering, touching, referencing, quarantining and dropping blob
rows, with the physical-bytes total and the blob epoch following every change
that can take a blob away from a hit (docs/architecture.md, "How an entry lives").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..errors import BlobMissing, CorruptRow
from .lmdbio import RawTxn
from .rows import BLOB_ROW, FLAG_INLINE, FLAG_QUARANTINED, BlobRow
from .schema import CONTENT_BYTES, PHYSICAL_BYTES

__all__ = ["BlobRows"]


class BlobRows:
    """Blob-row methods of :class:`~adstore.store.index.tables.Txn` (a mixin: no state of its own)."""

    __slots__ = ()
    raw: RawTxn
    _db: Mapping[str, Any]
    move_epoch: Callable[[], None]  # Txn's: this transaction takes a blob row away from lookups

    def _add_to(self, table: str, name: bytes, delta: int) -> None:  # pragma: no cover - Txn's
        raise NotImplementedError

    def _add(self, name: bytes, delta: int) -> None:
        """Add ``delta`` to the total ``name`` in ``meta`` (written once, before the commit)."""
        self._add_to("meta", name, delta)

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

    def decoded_blob_rows(self) -> Iterator[tuple[str, BlobRow]]:
        """(digest, row) of every blob row that decodes; malformed ones are ``verify``'s to report."""
        for k, v in self.raw.cursor(db=self._db["blobs"]):
            if len(k) != 32:
                continue
            try:
                yield k.hex(), BlobRow.decode(v, k)
            except CorruptRow:
                continue

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
            replaced = BlobRow.decode(old, k)
            self._add(PHYSICAL_BYTES, -replaced.stored)
            self._add(CONTENT_BYTES, -replaced.size)
            self.move_epoch()  # a repair: checks against the old row no longer hold
        self._add(PHYSICAL_BYTES, row.stored)
        self._add(CONTENT_BYTES, row.size)
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
        self._add(PHYSICAL_BYTES, -row.stored)
        self._add(CONTENT_BYTES, -row.size)
        self.move_epoch()

    def drop_blob_key(self, row_key: bytes) -> None:
        """Delete an undecodable blob row (``verify --fix``); totals are recounted there."""
        self.raw.delete(row_key, db=self._db["blobs"])
        self.raw.delete(row_key, db=self._db["blobdata"])
        self.move_epoch()

    def quarantine_blob(self, digest: str, row: BlobRow) -> None:
        """Flag a blob as failed: lookups miss on it from now on; its inline bytes go."""
        row.flags = (row.flags & ~FLAG_INLINE) | FLAG_QUARANTINED
        k = bytes.fromhex(digest)
        self.raw.delete(k, db=self._db["blobdata"])
        self.raw.put(k, row.encode(), db=self._db["blobs"])
        self.move_epoch()

    def hold(self, digests: Iterable[str]) -> None:
        """Take one reference on each blob; a blob without a row is :class:`BlobMissing`."""
        for digest in digests:
            row = self.blob_row(digest)
            if row is None:
                raise BlobMissing(digest, "not registered")
            row.refs += 1
            self.touch_blob(digest, row)

    def release(self, digests: Iterable[str]) -> list[str]:
        """Drop one reference per digest (hex); returns the digests now unreferenced."""
        return self.release_counts(Counter(bytes.fromhex(d) for d in digests))

    def release_counts(self, counts: Mapping[bytes, int]) -> list[str]:
        """Drop ``n`` references per blob (by 32-byte row key); returns the digests (hex) now unreferenced.

        Rows are unpacked in place and visited in key order through one
        cursor: an eviction batch releases thousands.
        """
        zero: list[str] = []
        cur = self.raw.cursor(db=self._db["blobs"])
        for k in sorted(counts):
            if not cur.set_key(k):
                continue
            raw = cur.value()
            if len(raw) != BLOB_ROW.size:
                raise CorruptRow("blobs", k.hex(), f"row of {len(raw)} bytes, expected {BLOB_ROW.size}")
            size, held, touched, flags, stored = BLOB_ROW.unpack(raw)
            held = max(0, held - counts[k])
            cur.put(k, BLOB_ROW.pack(size, held, touched, flags, stored))
            if held == 0:
                zero.append(k.hex())
        return zero
