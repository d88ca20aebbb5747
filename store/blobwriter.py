"""Streaming a blob of known digest into the store: hashed while written, once.

The remote tier downloads a blob whose digest and size a record declared.
:class:`BlobWriter` takes its bytes as they arrive and keeps ``put_file``'s
discipline without its second pass: a unique temp file in ``tmp/`` (memory,
below the inline threshold), SHA-256 while writing, then on :meth:`commit`
digest and size checked, fsync, read-only, rename into ``blobs/``, row
registered (invariant 1).  Bytes that do not hash to the digest are never
registered.  :meth:`cancel` (from any thread) makes every later write and the
commit fail, so a caller that gave up at a deadline can leave the writer to
the thread still feeding it, which then removes the temp file itself.

:class:`HashingWriter` is the part shared with the remote tier's plain
downloads (``Remote.fetch_blob``): an fd that hashes and counts what it is
given, optionally in a helper thread so that hashing and writing overlap the
network read.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from types import TracebackType
from typing import TYPE_CHECKING

from .errors import ChecksumMismatch, StoreError
from .fsutil import is_disk_full, start_writeback, unique_temp
from .index.rows import BlobRef

if TYPE_CHECKING:
    from .blobs import Blobs

__all__ = ["HashingWriter", "BlobWriter", "BACKGROUND_HASH_BYTES", "Cancelled"]

#: Blobs at least this large hash and write in a helper thread (below it a thread costs more than it saves).
BACKGROUND_HASH_BYTES = 8 << 20
#: A durable download starts the writeback of every stretch this long as soon as it is written.
WRITEBACK_BYTES = 8 << 20


class Cancelled(StoreError):
    """The writer was cancelled (its caller gave up); nothing it received is kept."""


class HashingWriter:
    """A write-only file descriptor that hashes (SHA-256) and counts what passes through it.

    With ``background=True`` the hashing and writing run in a helper thread
    fed through a small bounded queue, so they overlap with the network read
    (both release the GIL): a large download then runs at the speed of the
    slower of network and SHA-256, not of their sum.  :meth:`finish` must be
    called; it returns the helper's error, if any.
    """

    def __init__(self, fd: int, name: str, *, background: bool = False, durable: bool = False,
                 cancelled: threading.Event | None = None) -> None:
        self._fd = fd
        self.name = name
        self._durable = durable  # to be fsynced: start the writeback of each written stretch early
        self._written_back = 0
        self._written = 0
        self._sha = hashlib.sha256()
        self.size = 0
        self._cancelled = cancelled
        self._error: BaseException | None = None
        self._queue: queue.Queue[bytes | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=4)
            self._thread = threading.Thread(target=self._drain, name="adstore-hash", daemon=True)
            self._thread.start()

    def _consume(self, data: bytes) -> None:
        self._sha.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]
        self._written += len(data)
        if self._durable and self._written - self._written_back >= WRITEBACK_BYTES:
            start_writeback(self._fd, self._written_back, self._written - self._written_back)
            self._written_back = self._written

    def _drain(self) -> None:
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._consume(item)
                except BaseException as exc:  # reported by write() or finish()
                    self._error = exc

    def write(self, data: bytes) -> int:
        if self._cancelled is not None and self._cancelled.is_set():
            raise Cancelled(f"writing {self.name}: cancelled")
        if self._error is not None:
            raise self._error
        if self._queue is None:
            self._consume(data)
        else:
            self._queue.put(bytes(data))
        self.size += len(data)
        return len(data)

    def finish(self) -> BaseException | None:
        """Wait for the helper thread (if any); the error it failed with, if any."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None
        return self._error

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class BlobWriter:
    """One blob of known ``ref`` streamed into the store (see the module docstring).

    Use as a context manager: leaving the block without :meth:`commit`
    (an exception, a cancel) removes what was written.
    """

    def __init__(self, blobs: Blobs, ref: BlobRef, *, cancelled: threading.Event | None = None) -> None:
        self.ref = ref
        self._blobs = blobs
        self._cancelled = cancelled if cancelled is not None else threading.Event()
        self._done = False
        self._buffer: bytearray | None = None
        self._hasher: HashingWriter | None = None
        self._fd = -1
        self._tmp = None
        if ref.size < blobs.inline_threshold:
            self._buffer = bytearray()
            return
        tmp = unique_temp(blobs.layout.tmp, ".remote")
        self._fd = blobs.layout.open_temp(tmp)
        self._tmp = tmp
        self._hasher = HashingWriter(self._fd, str(tmp), background=ref.size >= BACKGROUND_HASH_BYTES,
                                     durable=True, cancelled=self._cancelled)

    @property
    def size(self) -> int:
        """Bytes received so far."""
        return len(self._buffer) if self._buffer is not None else self._hasher.size  # type: ignore[union-attr]

    def write(self, data: bytes) -> int:
        """Take the next bytes; past the declared size is damage (nothing past it is written)."""
        if self._cancelled.is_set() or self._done:
            raise Cancelled(f"blob {self.ref.digest}: writer cancelled")
        if self.size + len(data) > self.ref.size:
            raise ChecksumMismatch(self.ref.digest, "(not read past the declared size)", self.size + len(data))
        if self._buffer is not None:
            self._buffer += data
            return len(data)
        try:
            return self._hasher.write(data)  # type: ignore[union-attr]
        except OSError as exc:
            raise self._local_error(exc) from exc

    def cancel(self) -> None:
        """Refuse every later write and the commit (thread-safe)."""
        self._cancelled.set()

    def commit(self) -> BlobRef:
        """Check digest and size, make the blob durable and register it; the ref."""
        if self._cancelled.is_set() or self._done:
            raise Cancelled(f"blob {self.ref.digest}: writer cancelled")
        ref = self.ref
        if self._buffer is not None:
            data = bytes(self._buffer)
            got = hashlib.sha256(data).hexdigest()
            if got != ref.digest or len(data) != ref.size:
                raise ChecksumMismatch(ref.digest, got, len(data))
            self._blobs.register_inline(ref, data)
            self._done = True
            return ref
        hasher, tmp = self._hasher, self._tmp
        assert hasher is not None and tmp is not None
        failed = hasher.finish()
        if failed is not None:
            raise self._local_error(failed) if isinstance(failed, OSError) else failed
        if hasher.hexdigest() != ref.digest or hasher.size != ref.size:
            raise ChecksumMismatch(ref.digest, hasher.hexdigest(), hasher.size)
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise self._local_error(exc) from exc
        self._close()
        if self._cancelled.is_set():
            raise Cancelled(f"blob {ref.digest}: writer cancelled")
        self._blobs.publish_verified(ref, tmp)
        self._done = True
        return ref

    def discard(self) -> None:
        """Drop what was written (idempotent; after a commit, nothing to do)."""
        if self._hasher is not None:
            self._hasher.finish()
        self._close()
        if not self._done and self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
        self._done = True

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _local_error(self, exc: OSError) -> StoreError:
        from .errors import StoreFull

        if is_disk_full(exc):
            return StoreFull(str(self._tmp), os.strerror(exc.errno or 0))
        return StoreError(f"writing blob {self.ref.digest}: {exc}")

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._done:
            self.discard()
