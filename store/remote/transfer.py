"""Blob transfer: verified downloads and deduplicated uploads.

A download streams into a new file while hashing it; a blob that does not
hash to its digest, or has another size than the record says, is deleted and
rejected, so unverified bytes are never handed to the store (README, "Remote
tier").  The download is bounded by the recorded size: a server sending more
is cut off.  An upload asks the server first (HEAD): content addressing makes
a blob another host already pushed cost nothing, and a re-push of a whole
entry sends 0 blob bytes.

The functions take the :class:`~adstore.store.remote.client.Remote` whose
guarded ``_call`` they go through and raise its errors; the ``Remote``
methods of the same names turn those into outcomes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import StoreError
from .addresses import Kind, check_digest
from .backend import local_write_error
from .errors import RemoteBlobMissing, RemoteChecksumMismatch
from .outcomes import Outcome

if TYPE_CHECKING:
    from .client import Remote

__all__ = ["BlobSink", "BlobSource", "HashingWriter", "BACKGROUND_HASH_BYTES", "fetch_blob", "push_blob", "pull_blobs", "publish"]

log = logging.getLogger(__name__)


class BlobSink(Protocol):
    """Where pulled blobs go: :class:`adstore.store.Store` has these methods."""

    def has_blob(self, digest: str) -> bool: ...

    def temp_path(self, suffix: str = ".tmp") -> Path: ...

    def put_file(self, path: str | os.PathLike[str]) -> Any: ...  # a BlobRef (digest, size)


class BlobSource(Protocol):
    """Where pushed blobs come from: :class:`adstore.store.Store` has these methods."""

    def blob_path(self, digest: str) -> Path | None: ...  # None for a blob kept inline in the index

    def get_bytes(self, digest: str) -> bytes: ...


class HashingWriter:
    """A write-only file that hashes (SHA-256) and counts what passes through it.

    With ``background=True`` the hashing and writing run in a helper thread
    fed through a small bounded queue, so they overlap with the network read
    (both release the GIL): a large download then runs at the speed of the
    slower of network and SHA-256, not of their sum.  :meth:`finish` must
    be called; it returns the helper's error, if any.
    """

    def __init__(self, fd: int, name: str, *, background: bool = False) -> None:
        self._fd = fd
        self.name = name
        self._sha = hashlib.sha256()
        self.size = 0
        self._error: BaseException | None = None
        self._queue: queue.Queue[bytes | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=4)
            self._thread = threading.Thread(target=self._drain, name="adstore-remote-hash", daemon=True)
            self._thread.start()

    def _consume(self, data: bytes) -> None:
        self._sha.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def _drain(self) -> None:
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._consume(item)
                except BaseException as exc:  # reported by write() or finish()
                    self._error = exc

    def write(self, data: bytes) -> int:
        if self._error is not None:
            raise self._error
        if self._queue is None:
            self._consume(data)
        else:
            self._queue.put(data)
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


#: Downloads at least this large hash and write in a helper thread (below it a thread costs more than it saves).
BACKGROUND_HASH_BYTES = 8 << 20


def fetch_blob(remote: Remote, digest: str, size: int, *, dest: Path, fsync: bool = False) -> Outcome[Path]:
    """Download blob ``digest`` into the new file ``dest`` (created exclusively, no symlink followed).

    Returns ``dest`` only if the content hashes to ``digest`` and is exactly
    ``size`` bytes; on any failure ``dest`` is removed.
    """
    check_digest(digest)
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise local_write_error(exc, dest) from exc
    writer = HashingWriter(fd, str(dest), background=size >= BACKGROUND_HASH_BYTES)
    try:
        try:
            n = remote._call("get", Kind.CAS, digest,
                             lambda: remote.backend.get_to(Kind.CAS, digest, writer, size))  # type: ignore[arg-type]
        finally:
            remote.count("bytes_down", writer.size)
            failed = writer.finish()  # raised below only if the download itself succeeded
        if isinstance(failed, OSError):
            raise local_write_error(failed, dest) from failed
        if failed is not None:
            raise failed
        if n is None:
            raise RemoteBlobMissing(digest)
        got = writer.hexdigest()
        if got != digest or writer.size != size:
            raise RemoteChecksumMismatch(digest, expected_size=size, got_size=writer.size, got_digest=got)
        if fsync:
            os.fsync(fd)
    except BaseException as exc:
        os.close(fd)
        dest.unlink(missing_ok=True)
        if isinstance(exc, RemoteChecksumMismatch):
            remote.count("checksum_rejected")
            log.warning("remote %s: %s", remote.url, exc)
        raise
    os.close(fd)
    remote.count("blobs_down")
    return Outcome(value=dest, nbytes=writer.size)


def push_blob(remote: Remote, digest: str, size: int, source: str | os.PathLike[str] | bytes) -> Outcome[int]:
    """Upload a blob unless the remote holds it with this size; the bytes sent."""
    check_digest(digest)
    have = remote._call("head", Kind.CAS, digest, lambda: remote.backend.head(Kind.CAS, digest))
    if have == size:
        remote.count("blobs_skipped")
        remote.count("bytes_skipped", size)
        return Outcome(value=0)
    if isinstance(source, (bytes, bytearray, memoryview)):
        sent = remote._call("put", Kind.CAS, digest, lambda: remote.backend.put(Kind.CAS, digest, source), write=True)
    else:
        with open(source, "rb") as f:
            sent = remote._call("put", Kind.CAS, digest, lambda: remote.backend.put(Kind.CAS, digest, f), write=True)
    remote.count("blobs_up")
    remote.count("bytes_up", sent)
    return Outcome(value=sent, nbytes=sent)


def pull_blobs(remote: Remote, refs: Iterable[tuple[str, int]], *, sink: BlobSink) -> Outcome[int]:
    """Fetch every blob of ``refs`` that ``sink`` lacks, verified, and store it there.

    Stops at the first failure (its outcome is returned): blobs stored before
    it are unreferenced and left to the store's gc, never half-committed.
    """
    total = 0
    for digest, size in refs:
        check_digest(digest)
        if sink.has_blob(digest):
            continue
        dest = sink.temp_path(".remote")
        got = fetch_blob(remote, digest, size, dest=dest)
        total += got.nbytes
        try:
            ref = sink.put_file(dest)
        finally:
            dest.unlink(missing_ok=True)
        if (getattr(ref, "digest", digest), getattr(ref, "size", size)) != (digest, size):
            raise StoreError(f"blob {digest}: changed between verification and store")  # never expected
    return Outcome(value=total, nbytes=total)


def publish(remote: Remote, key: str, rank: int, payload: Mapping[str, Any], refs: Iterable[tuple[str, int]],
            *, source: BlobSource) -> Outcome[int]:
    """Push the blobs the remote lacks, then this rank's signed record, last."""
    sent = 0
    for digest, size in refs:
        path = source.blob_path(digest)
        pushed = remote.push_blob(digest, size, path if path is not None else source.get_bytes(digest))
        if not pushed.ok:
            return pushed
        sent += pushed.nbytes
    record = remote.push_record(key, rank, payload)
    if not record.ok:
        return record
    return Outcome(value=sent, nbytes=sent + record.nbytes)
