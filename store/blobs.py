"""Blob bytes: content-addressed files plus small blobs inline in LMDB.

Write order (invariant 1): hash, write a unique temp in ``tmp/``, fsync,
make it read-only, rename into ``blobs/ab/<hex>``, fsync the directory, and
only then register the row in a write transaction.  Registration re-checks
that the file is there *inside* the transaction: gc unlinks files only while
holding the write lock after their rows are gone, so a writer that sees its
file under the lock knows no gc can remove it afterwards.

Reads verify (``reading``, the one read path): the content must hash to its
digest.  Proven damage (a mismatch, a file the codec refuses, something
other than a regular file) moves the file to ``quarantine/``, flags the
row and raises; the next writer of the same content repairs it.  Any other
failure (out of descriptors, an I/O error) is a ``BlobUnreadable`` and the
blob stays.  A read-only store writes nothing: its puts raise
:class:`ReadOnlyStore`, and damage found by a read raises as anywhere else
but the file stays where it is (there is no ``quarantine/`` to move it to).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from .blobwriter import BlobWriter
from .codec import Encoding
from .errors import BlobMissing, ChecksumMismatch, ReadOnlyStore, StoreError
from .fsutil import atomic_write, fsync_dir, publish_temp
from .index.rows import FLAG_INLINE, FLAG_ZSTD, BlobRef, BlobRow, pack_inline, unpack_inline
from .index.tables import Tables, Txn
from .names import validate_digest
from .reading import CHUNK_SIZE, DAMAGE, VerifiedRead, open_blob

__all__ = ["Blobs", "StoredBlob", "Swept", "CHUNK_SIZE", "BLOB_MODE", "unlink_dropped"]

log = logging.getLogger(__name__)

BLOB_MODE = 0o444


def _digest_of(ref_or_digest: BlobRef | str) -> str:
    return ref_or_digest.digest if isinstance(ref_or_digest, BlobRef) else validate_digest(ref_or_digest)


class StoredBlob(NamedTuple):
    """How a blob file holds its content (``Store.stored_blob``): what the remote tier uploads."""

    path: Path
    encoding: Encoding
    stored: int  # the file's size


class Swept(StoreError):
    """A blob's temp file was swept (a zero grace period) before it was in place: write it again, if you can."""


class _FileVanished(Exception):
    """gc removed our file before we registered it: write again.

    Either the blob file between rename and registration, or the temp file
    before the rename (a sweep inside a zero grace period takes temps that
    are still being written).
    """


class Blobs:
    """Put and get blob content; rows live in the ``blobs`` database."""

    def __init__(
        self,
        tables: Tables,
        *,
        inline_threshold: int,
        grace_period: float,
        reserve: Callable[[int], None],
        on_dedup: Callable[[int], None],
        read_only: bool = False,
    ) -> None:
        self._tables = tables
        self._read_only = read_only
        self._layout = tables.layout
        self.layout = tables.layout
        self.file_ok = tables.layout.has_file
        self.inline_threshold = inline_threshold
        self._grace = grace_period
        self._reserve = reserve
        self._on_dedup = on_dedup

    # -- write -----------------------------------------------------------
    def _writable(self) -> None:
        if self._read_only:
            raise ReadOnlyStore(str(self._layout.root), "storing a blob")

    def put_bytes(self, data: bytes | bytearray | memoryview) -> BlobRef:
        self._writable()
        view = memoryview(data).cast("B")
        ref = BlobRef(hashlib.sha256(view).hexdigest(), view.nbytes)
        if self._existing(ref):
            return ref
        if ref.size < self.inline_threshold:
            self._register_inline(ref, bytes(view))
            return ref
        self._write_file(ref, lambda: (view,), prehashed=type(data) is bytes)
        return ref

    def put_file(self, path: str | os.PathLike[str]) -> BlobRef:
        """Hash the file, then copy it only if the store lacks it.

        Two passes instead of one: re-putting a stored blob costs one read and
        a hash, no write; a new blob's second read comes from the page cache.
        """
        self._writable()
        src = Path(path)
        h = hashlib.sha256()
        size = 0
        for chunk in self._read_chunks(src):
            h.update(chunk)
            size += len(chunk)
        ref = BlobRef(h.hexdigest(), size)
        if self._existing(ref):
            return ref
        if size < self.inline_threshold:
            data = src.read_bytes()
            if hashlib.sha256(data).hexdigest() != ref.digest:
                raise StoreError(f"{src} changed while it was being stored")
            self._register_inline(ref, data)
            return ref
        self._write_file(ref, lambda: self._read_chunks(src))
        return ref

    def put_stream(self, chunks: Iterable[bytes]) -> BlobRef:
        """Store a stream of chunks, hashing while writing (one pass, bounded memory)."""
        self._writable()
        with self.writer(None) as w:
            for chunk in chunks:
                w.write(chunk)
            return w.commit()

    def writer(
        self,
        ref: BlobRef | None,
        *,
        source: Encoding = Encoding.RAW,
        frame_size: int | None = None,
        cancelled: threading.Event | None = None,
    ) -> BlobWriter:
        """A writer streaming a blob into place as its bytes arrive (``blobwriter``).

        ``ref`` None: whatever the content hashes to.  ``source=ZSTD``: the
        bytes are a compressed file of ``frame_size`` bytes (a remote's object, ``codec``).
        """
        self._writable()
        return BlobWriter(self, ref, source=source, frame_size=frame_size, cancelled=cancelled)

    def register_inline(self, ref: BlobRef, data: bytes) -> None:
        """Register a small blob whose bytes the caller has verified against ``ref`` (unless stored already)."""
        if not self._existing(ref):
            self._register_inline(ref, data)

    def publish_verified(self, ref: BlobRef, tmp: Path, *, encoding: Encoding, stored: int) -> None:
        """Rename a verified, fsynced temp file into place and register it; once only (a stream cannot be re-read).

        A blob stored meanwhile (another writer of the same content) wins:
        this file is dropped.
        """
        if self._existing(ref):
            tmp.unlink(missing_ok=True)
            return
        try:
            self._publish_and_register(ref, tmp, encoding, stored)
        except _FileVanished:
            raise Swept(
                f"blob {ref.digest}: its temp file was swept while being stored (grace period {self._grace:g}s)"
            ) from None

    def _existing(self, ref: BlobRef) -> bool:
        """True when the blob is stored intact; refreshes its freshness if stale.

        Freshness protects a zero-ref blob between a writer's put and its
        publish; it is written only when older than a quarter of the grace
        period, so re-putting hot blobs costs no write transaction.
        """
        with self._tables.read() as t:
            row = t.blob_row(ref.digest)
        if row is None:
            return False
        if row.quarantined or row.size != ref.size:
            return False
        if not row.inline and not self.file_ok(ref.digest, row.stored):
            return False
        if self._tables.clock() - row.touched > self._grace / 4:
            if not self._touch(ref):
                return False
        self._on_dedup(ref.size)
        return True

    def _touch(self, ref: BlobRef) -> bool:
        def fn(t: Txn) -> bool:
            row = t.blob_row(ref.digest)
            if row is None or row.quarantined or (not row.inline and not self.file_ok(ref.digest, row.stored)):
                return False
            row.touched = t.clock()
            t.touch_blob(ref.digest, row)
            return True

        return self._tables.write(fn)

    def _write_file(
        self, ref: BlobRef, chunks: Callable[[], Iterable[bytes | memoryview]], *, prehashed: bool = False
    ) -> None:
        """Write a blob whose source can be read again (a swept temp file is written once more)."""
        self._reserve(ref.size)
        for _attempt in range(3):
            with BlobWriter(self, ref, prehashed=prehashed) as w:
                for chunk in chunks():
                    w.write(chunk)
                try:
                    w.commit()
                except ChecksumMismatch:
                    raise StoreError("source changed while it was being stored") from None
                except Swept:
                    continue  # this source can be read again
                return
        raise StoreError(f"blob {ref.digest} kept disappearing while being stored")

    def _publish_and_register(self, ref: BlobRef, tmp: Path, encoding: Encoding, stored: int) -> None:
        dest = self._layout.blob_path(ref.digest)
        self._layout.mkdir(dest.parent)
        try:
            publish_temp(tmp, dest, mode=BLOB_MODE)
        except FileNotFoundError:
            raise _FileVanished from None
        flags = FLAG_ZSTD if encoding is Encoding.ZSTD else 0

        def fn(t: Txn) -> None:
            if not self.file_ok(ref.digest, stored):  # gc took it between the rename and now
                raise _FileVanished
            row = t.blob_row(ref.digest)
            now = t.clock()
            if (
                row is not None
                and not row.quarantined
                and row.size == ref.size
                and not row.inline
                and row.flags == flags
                and row.stored == stored
            ):
                row.touched = now  # the same file again
                t.touch_blob(ref.digest, row)
                return
            # New, or repairing a damaged row (or one whose file a writer of the same content replaced).
            t.put_blob(
                ref.digest, BlobRow(ref.size, row.refs if row is not None else 0, now, flags, stored), inline=None
            )
            t.count("bytes_written", ref.size)

        self._tables.write(fn)

    def _register_inline(self, ref: BlobRef, data: bytes) -> None:
        value = pack_inline(data)

        def fn(t: Txn) -> None:
            row = t.blob_row(ref.digest)
            now = t.clock()
            if (
                row is not None
                and not row.quarantined
                and row.size == ref.size
                and (row.inline or self.file_ok(ref.digest, row.stored))
            ):
                row.touched = now
                t.touch_blob(ref.digest, row)
                return
            t.put_blob(
                ref.digest,
                BlobRow(ref.size, row.refs if row is not None else 0, now, FLAG_INLINE, ref.size),
                inline=value,
            )
            t.count("bytes_written", ref.size)

        self._tables.write(fn)

    # -- read ------------------------------------------------------------
    def _read_chunks(self, path: Path) -> Iterator[bytes]:
        """Chunks of the file ``path`` (a source being stored: not a blob, nothing to verify it against)."""
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK_SIZE):
                yield chunk

    def row(self, digest: str) -> BlobRow | None:
        with self._tables.read() as t:
            return t.blob_row(validate_digest(digest))

    def has(self, ref_or_digest: BlobRef | str) -> bool:
        digest = _digest_of(ref_or_digest)
        row = self.row(digest)
        if row is None or row.quarantined:
            return False
        return row.inline or self.file_ok(digest, row.stored)

    def stored(self, ref_or_digest: BlobRef | str) -> StoredBlob | None:
        """The file of a blob kept as a file: where, how it holds the content, its size; None if inline or absent."""
        digest = _digest_of(ref_or_digest)
        row = self.row(digest)
        if row is None or row.inline or row.quarantined:
            return None
        return StoredBlob(self._layout.blob_path(digest), Encoding.ZSTD if row.compressed else Encoding.RAW, row.stored)

    def path(self, ref_or_digest: BlobRef | str) -> Path | None:
        digest = _digest_of(ref_or_digest)
        row = self.row(digest)
        if row is None or row.inline:
            return None
        return self._layout.blob_path(digest)

    def get_bytes(self, ref_or_digest: BlobRef | str) -> bytes:
        """The blob's content, verified: SHA-256 for files (decoded from their frames, bounded by the size), the
        inline checksum for inline blobs.

        The hot path of small reads is one get: an inline blob's value in
        ``blobdata`` exists only while its row is inline and not quarantined,
        and carries its own checksum (:func:`records.pack_inline`).
        """
        digest = ref_or_digest.digest if type(ref_or_digest) is BlobRef else _digest_of(ref_or_digest)
        row = None
        with self._tables.read() as t:
            value = t.inline_value(digest)
            if value is None:
                row = t.blob_row(digest)
        if value is None:
            if row is None:
                raise BlobMissing(digest, "not registered")
            if row.quarantined:
                raise BlobMissing(digest, "quarantined after failing verification")
            if row.inline:
                self.quarantine(digest)  # flag the row: lookups miss on it from now on
                raise BlobMissing(digest, "inline data missing")
            with self._reading(digest, row) as read:
                return read.whole()
        data, intact = unpack_inline(value)
        if intact:
            return data
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            self.quarantine(digest, content=data)
            raise ChecksumMismatch(digest, got, len(data))
        return data  # a damaged checksum over intact bytes

    @contextmanager
    def _reading(
        self, digest: str, row: BlobRow, check: Callable[[os.stat_result | None], None] | None = None
    ) -> Iterator[VerifiedRead]:
        """A verified read of a blob file (``reading``); proven damage (and only that) quarantines it.

        ``check`` sees ``fstat`` of the descriptor the bytes are read from,
        before the first byte: a caller that decides whether to trust the file
        judges the very file it reads.
        """
        try:
            fd = open_blob(self._layout.blob_path(digest), digest)
            try:
                if check is not None:
                    check(os.fstat(fd))
                encoding = Encoding.ZSTD if row.compressed else Encoding.RAW
                yield VerifiedRead(fd, digest, encoding=encoding, size=row.size, stored=row.stored)
            finally:
                os.close(fd)
        except DAMAGE:
            self.quarantine(digest)
            raise

    def copy_to(
        self,
        ref_or_digest: BlobRef | str,
        dest: str | os.PathLike[str],
        *,
        check: Callable[[os.stat_result | None], None] | None = None,
    ) -> Path:
        """Copy a blob to ``dest`` (atomically), verifying while streaming.

        ``check`` sees ``fstat`` of the descriptor the bytes are read from
        (None for an inline blob) before the first byte is read, so a caller
        deciding whether to trust the file judges the file it copies.
        """
        digest = _digest_of(ref_or_digest)
        row = self.row(digest)
        if row is None:
            raise BlobMissing(digest, "not registered")
        if row.inline or row.quarantined:
            if check is not None:
                check(None)
            return atomic_write(dest, self.get_bytes(digest))

        def verified() -> Iterator[bytes]:
            with self._reading(digest, row, check) as read:
                yield from read.chunks()

        return atomic_write(dest, verified())

    def quarantine(self, digest: str, *, content: bytes | None = None) -> None:
        """Move a corrupt blob aside and flag its row; manifests then miss on it (a read-only store: neither)."""
        validate_digest(digest)
        if self._read_only:
            log.warning("corrupt blob %s left in place: the store is read-only", digest)
            return
        qpath = self._layout.quarantine / f"{digest}.{time.time_ns()}"
        try:
            if content is not None:
                atomic_write(qpath, content, tmp_dir=self._layout.tmp)
            else:
                os.replace(self._layout.blob_path(digest), qpath)
                fsync_dir(self._layout.quarantine)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not move corrupt blob %s to quarantine: %s", digest, exc)
        log.warning("quarantined corrupt blob %s", digest)

        def fn(t: Txn) -> None:
            row = t.blob_row(digest)
            if row is None or (not row.inline and self.file_ok(digest, row.stored)):
                return  # gone, or a writer repaired it meanwhile
            t.quarantine_blob(digest, row)

        self._tables.write(fn)


#: Blob files unlinked per lock-only transaction.
_UNLINK_BATCH = 1000


def unlink_dropped(tables: Tables, digests: Sequence[str]) -> int:
    """Unlink the blob files of ``digests`` whose rows a committed transaction dropped; returns bytes.

    Files go only after the rows (invariant 4).  Each unlink runs under the
    write lock (a lock-only transaction), after checking that no writer
    registered the blob again meanwhile: a writer that sees its file inside
    its registering transaction may rely on it.
    """
    layout, total = tables.layout, 0
    for i in range(0, len(digests), _UNLINK_BATCH):

        def fn(t: Txn, batch: Sequence[str] = digests[i : i + _UNLINK_BATCH]) -> int:
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
    return total
