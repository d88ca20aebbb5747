"""Writing a blob: one pass that hashes, encodes and writes, then the commit that publishes it.

Every blob the store writes goes through :class:`BlobWriter`, whatever the
source (``put_bytes``, ``put_file``, ``put_stream``, a remote download), so
invariant 1 lives here once: a unique temp file in ``tmp/`` (memory, below
the inline threshold), the content hashed (SHA-256) while it is encoded and
written, then on :meth:`BlobWriter.commit` digest and size checked, fsync,
read-only, rename into ``blobs/``, row registered.  Bytes that do not hash
to the expected digest are never registered.

The file holds the content raw or as zstd frames (``codec``): decided
from the first :data:`~.codec.SAMPLE_BYTES` of the content unless the caller
knows.  A remote object that already is a compressed file (``source=ZSTD``)
is written as it arrives (not hashed: its compressed bytes name nothing) and
read back at the commit through the writer's own descriptor, by the one
read path (``reading``), bounded by the declared size, to check its digest.

:meth:`BlobWriter.cancel` (from any thread) makes every later write and the
commit fail, so a caller that gave up at a deadline can leave the writer to
the thread still feeding it, which then removes the temp file itself.
:class:`HashingWriter` is the write-side pipeline (hash, encode, write; in a
helper thread for large blobs, so that it overlaps a network read), also
used alone by the remote tier's plain downloads (``Remote.fetch_blob``).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from pathlib import Path
from types import TracebackType
from typing import Protocol

from .codec import SAMPLE_BYTES, Encoding, FrameWriter, choose
from .errors import ChecksumMismatch, StoreError, StoreFull
from .fsutil import is_disk_full, start_writeback, unique_temp
from .index.rows import BlobRef
from .layout import Layout
from .reading import VerifiedRead

__all__ = ["HashingWriter", "BlobWriter", "BlobHome", "BACKGROUND_HASH_BYTES", "WRITEBACK_BYTES", "Cancelled"]

#: Blobs at least this large hash and write in a helper thread (below it a thread costs more than it saves).
BACKGROUND_HASH_BYTES = 8 << 20
#: A durable write starts the writeback of every stretch this long as soon as it is written.
WRITEBACK_BYTES = 8 << 20


class Cancelled(StoreError):
    """The writer was cancelled (its caller gave up); nothing it received is kept."""


class BlobHome(Protocol):
    """Where a :class:`BlobWriter` puts what it verified (``blobs.Blobs``; named here, so neither imports the other)."""

    layout: Layout
    inline_threshold: int

    def register_inline(self, ref: BlobRef, data: bytes) -> None: ...

    def publish_verified(self, ref: BlobRef, tmp: Path, *, encoding: Encoding, stored: int) -> None: ...


class _Fd:
    """A file descriptor as a file that can only be written (what ``FrameWriter`` writes to)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        n = view.nbytes
        while view:
            view = view[os.write(self.fd, view) :]
        self.written += n
        return n


class HashingWriter:
    """Content in, file out: hashes (SHA-256) and counts the content, writes it raw or as zstd frames.

    With ``background=True`` hashing, encoding and writing run in a helper
    thread fed through a small bounded queue, so they overlap with the
    network read (they release the GIL).  ``durable``: the file will be
    fsynced, so the kernel's writeback of each stretch starts as soon as it
    is written and the final fsync waits for the tail only.  :meth:`finish`
    must be called; it returns the helper's error, if any.
    """

    def __init__(
        self,
        fd: int,
        name: str,
        *,
        encoding: Encoding = Encoding.RAW,
        background: bool = False,
        durable: bool = False,
        hash_content: bool = True,
        cancelled: threading.Event | None = None,
    ) -> None:
        self.name = name
        self._out = _Fd(fd)
        self._frame = FrameWriter(self._out) if encoding is Encoding.ZSTD else None
        self._sha = hashlib.sha256() if hash_content else None
        self.size = 0  # content bytes
        self._durable = durable
        self._written_back = 0
        self._cancelled = cancelled
        self._error: BaseException | None = None
        self._queue: queue.Queue[bytes | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=4)
            self._thread = threading.Thread(target=self._drain, name="adstore-hash", daemon=True)
            self._thread.start()

    @property
    def stored(self) -> int:
        """Bytes written to the file so far (compressed ones, when compressing)."""
        return self._out.written

    def _consume(self, data: bytes | bytearray | memoryview) -> None:
        if self._sha is not None:
            self._sha.update(data)
        if self._frame is not None:
            self._frame.write(data)
        else:
            self._out.write(data)
        if self._durable and self._out.written - self._written_back >= WRITEBACK_BYTES:
            start_writeback(self._out.fd, self._written_back, self._out.written - self._written_back)
            self._written_back = self._out.written

    def _drain(self) -> None:
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._consume(item)
                except BaseException as exc:  # reported by write() or finish()
                    self._error = exc

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._cancelled is not None and self._cancelled.is_set():
            raise Cancelled(f"writing {self.name}: cancelled")
        if self._error is not None:
            raise self._error
        n = memoryview(data).nbytes
        if self._queue is None:
            self._consume(data)
        else:
            self._queue.put(bytes(data))
        self.size += n
        return n

    def finish(self, *, complete: bool = True) -> BaseException | None:
        """Wait for the helper thread (if any) and, if ``complete``, end the frames; the error it failed with, if any.

        ``complete=False``: the file is being dropped, so its last frame and
        seek table are neither compressed nor written.
        """
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None
        if not complete:
            self._frame = None
        if self._error is None and self._frame is not None:
            try:
                self._frame.finish()
            except BaseException as exc:
                self._error = exc
            self._frame = None
        return self._error

    def hexdigest(self) -> str:
        assert self._sha is not None, "a writer told not to hash has no digest"
        return self._sha.hexdigest()


class BlobWriter:
    """One blob streamed into the store (see the module docstring); a context manager.

    ``ref``: the expected digest and size (None: whatever the content hashes
    to, for ``put_stream``).  ``encoding``: how the file holds it (None:
    decided from the content's start).  ``source``: what :meth:`write`
    receives, the content (RAW) or its compressed file (ZSTD, of
    ``frame_size`` bytes: never more is read).  ``prehashed``: the caller
    hashed this very content to ``ref`` and it cannot change (an immutable
    ``bytes``, ``put_bytes``), so it is not hashed a second time.  Leaving
    the block without :meth:`commit` (an exception, a cancel) removes what
    was written.
    """

    def __init__(
        self,
        blobs: BlobHome,
        ref: BlobRef | None,
        *,
        encoding: Encoding | None = None,
        source: Encoding = Encoding.RAW,
        frame_size: int | None = None,
        prehashed: bool = False,
        cancelled: threading.Event | None = None,
    ) -> None:
        if source is Encoding.ZSTD and (ref is None or frame_size is None):
            raise ValueError("a frame from elsewhere needs the digest and sizes it must decode to")
        if prehashed and (ref is None or source is not Encoding.RAW):
            raise ValueError("only content the caller hashed to ref can skip the hash")
        self._prehashed = prehashed
        self.ref = ref
        self.frame_size = frame_size  # for source=ZSTD: the frame's declared size (a remote record's)
        self._blobs = blobs
        self._encoding = Encoding.ZSTD if source is Encoding.ZSTD else encoding
        self._source = source
        self._cancelled = cancelled if cancelled is not None else threading.Event()
        self._done = False
        self._head = bytearray()  # content held back until the encoding (or inline) is decided
        self._hasher: HashingWriter | None = None
        self._fd = -1
        self._tmp: Path | None = None
        self.received = 0  # bytes received (content, or frame bytes)

    # -- writing -----------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Take the next bytes; past the declared size is damage (nothing past it is written)."""
        if self._cancelled.is_set() or self._done:
            raise Cancelled(f"blob {self._name}: writer cancelled")
        n = memoryview(data).nbytes
        limit = self._limit
        if limit is not None and self.received + n > limit:
            raise ChecksumMismatch(self._name, "(not read past the declared size)", self.received + n)
        self.received += n
        if self._hasher is None and self._source is Encoding.RAW:
            if not self._head and n >= max(SAMPLE_BYTES, self._blobs.inline_threshold):
                self._open(data)  # decided from its own start: a large buffer is not copied
                return n
            self._head += data
            if len(self._head) < max(SAMPLE_BYTES, self._blobs.inline_threshold):
                return n
            self._open(bytes(self._head))
            self._head = bytearray()
            return n
        if self._hasher is None:
            self._open(b"")
        try:
            self._hasher.write(data)  # type: ignore[union-attr]
        except OSError as exc:
            raise self._local_error(exc) from exc
        return n

    @property
    def _name(self) -> str:
        return self.ref.digest if self.ref is not None else "(stream)"

    @property
    def _limit(self) -> int | None:
        """Most bytes :meth:`write` may receive: the content's size, or the frame's (declared by the caller)."""
        if self.ref is None:
            return None
        return self.frame_size if self._source is Encoding.ZSTD else self.ref.size

    def _open(self, head: bytes | bytearray | memoryview) -> None:
        """Decide the encoding from ``head`` (the content's start), open the temp file, write ``head``."""
        if self._encoding is None:
            self._encoding = choose(head)
        tmp = unique_temp(self._blobs.layout.tmp, ".blob")
        self._fd = self._blobs.layout.open_temp(tmp, readable=self._source is Encoding.ZSTD)
        self._tmp = tmp
        size = self.ref.size if self.ref is not None else None
        big = size is None or size >= BACKGROUND_HASH_BYTES
        self._hasher = HashingWriter(
            self._fd,
            str(tmp),
            encoding=self._encoding if self._source is Encoding.RAW else Encoding.RAW,
            background=big and not self._prehashed,  # nothing to overlap with: the caller has all of it
            durable=True,
            hash_content=not self._prehashed and self._source is Encoding.RAW,  # frames: checked decoded, at the commit
            cancelled=self._cancelled,
        )
        if head:
            try:
                self._hasher.write(head)
            except OSError as exc:
                raise self._local_error(exc) from exc

    def cancel(self) -> None:
        """Refuse every later write and the commit (thread-safe)."""
        self._cancelled.set()

    # -- the commit ----------------------------------------------------------
    def commit(self) -> BlobRef:
        """Check digest and size, make the blob durable and register it; its ref."""
        if self._cancelled.is_set() or self._done:
            raise Cancelled(f"blob {self._name}: writer cancelled")
        if self._hasher is None and self._source is Encoding.RAW:
            if len(self._head) < self._blobs.inline_threshold:
                return self._commit_inline(bytes(self._head))
            self._open(bytes(self._head))
            self._head = bytearray()
        if self._hasher is None:
            self._open(b"")
        hasher, tmp = self._hasher, self._tmp
        assert hasher is not None and tmp is not None
        failed = hasher.finish()
        if failed is not None:
            raise self._local_error(failed) if isinstance(failed, OSError) else failed
        if self._source is Encoding.ZSTD:
            assert self.ref is not None
            if self.ref.size < self._blobs.inline_threshold:  # a small blob that came compressed
                return self._commit_inline(self._verified().whole(), checked=True)
            ref = self._decoded_ref()
        else:
            digest = self.ref.digest if self._prehashed and self.ref is not None else hasher.hexdigest()
            ref = self._checked(digest, hasher.size)
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise self._local_error(exc) from exc
        self._close()
        if self._cancelled.is_set():
            raise Cancelled(f"blob {ref.digest}: writer cancelled")
        assert self._encoding is not None
        self._blobs.publish_verified(ref, tmp, encoding=self._encoding, stored=hasher.stored)
        self._done = True
        return ref

    def _checked(self, digest: str, size: int) -> BlobRef:
        ref = self.ref if self.ref is not None else BlobRef(digest, size)
        if digest != ref.digest or size != ref.size:
            raise ChecksumMismatch(ref.digest, digest, size)
        return ref

    def _commit_inline(self, data: bytes, *, checked: bool = False) -> BlobRef:
        ref = (
            self.ref if checked and self.ref is not None else self._checked(hashlib.sha256(data).hexdigest(), len(data))
        )
        if self._cancelled.is_set():
            raise Cancelled(f"blob {ref.digest}: writer cancelled")
        self.discard()
        self._blobs.register_inline(ref, data)
        self._done = True
        return ref

    def _verified(self) -> VerifiedRead:
        """The one read path over the compressed temp file, through our own descriptor (a swept file still reads)."""
        assert self.ref is not None
        return VerifiedRead(self._fd, self.ref.digest, encoding=Encoding.ZSTD, size=self.ref.size)

    def _decoded_ref(self) -> BlobRef:
        """Check that the compressed temp file decodes to ``ref`` (bounded by its size): :class:`ChecksumMismatch`."""
        assert self.ref is not None
        for _ in self._verified().chunks():
            pass
        return self.ref

    def discard(self) -> None:
        """Drop what was written (idempotent; after a commit, nothing to do)."""
        if self._hasher is not None:
            self._hasher.finish(complete=False)
        self._close()
        if not self._done and self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
        self._done = True

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _local_error(self, exc: OSError) -> StoreError:
        if is_disk_full(exc):
            return StoreFull(str(self._tmp), os.strerror(exc.errno or 0))
        return StoreError(f"writing blob {self._name}: {exc}")

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done:
            self.discard()
