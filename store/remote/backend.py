"""The backend interface: what a remote server must offer, and nothing more.

A backend speaks one protocol (S3, the Bazel HTTP cache, memory) and raises
only the remote tier's errors.  It holds no policy: read-only mode, timeouts
as outcomes, the circuit breaker, digest verification and signatures live in
the public layer above it, so a user who adds a backend for another service
implements five small methods and inherits all of that (docs/remote.md, "URLs
and modes").  ``kind`` is ``cas`` (blobs) or ``ac`` (records, leases); every
implementation passes the digest through :func:`object_name` (or
:func:`check_digest`) before it builds a URL or an object key.
"""

from __future__ import annotations

import abc
import enum
import errno
import io
import os
import sys
from collections.abc import Iterable
from typing import BinaryIO

from ..codec import Encoding
from ..errors import StoreError, StoreFull
from .addresses import Kind
from .errors import NotSupported, RemoteChecksumMismatch, RemoteError, RemoteRejected, RemoteTimeout, RemoteUnavailable

__all__ = [
    "RemoteBackend",
    "ConditionalWrites",
    "Body",
    "body_size",
    "copy_limited",
    "local_write_error",
    "transport_error",
    "status_error",
    "CHUNK",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_READ_TIMEOUT",
]

#: Seconds to open a connection: a reachable server on a LAN or in-region answers in milliseconds.
DEFAULT_CONNECT_TIMEOUT = 2.0
#: Seconds a read (or write) may stall: bounds a stopped or hung server, not a slow large download.
DEFAULT_READ_TIMEOUT = 10.0

#: Bytes or a readable binary file positioned at the start of the body.
Body = bytes | bytearray | memoryview | BinaryIO

#: Transfer chunk size: large enough that per-chunk Python overhead stays
#: well below the network's cost, small enough to keep memory bounded.
CHUNK = 1 << 20


class ConditionalWrites(enum.StrEnum):
    """How far a backend's :meth:`RemoteBackend.put_if_absent` can be trusted."""

    ATOMIC = "atomic"  # the server checks and writes in one step (AWS S3, MinIO, the memory backend)
    SERVER_DEPENDENT = "server_dependent"  # sent as If-None-Match: *; honoured (atomically or not) by the server
    NONE = "none"  # put_if_absent raises NotSupported


def body_size(data: Body) -> int:
    """Length of ``data``: bytes, or a file from its current position to its end."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return memoryview(data).nbytes
    pos = data.tell()
    try:
        return os.fstat(data.fileno()).st_size - pos
    except (AttributeError, OSError, io.UnsupportedOperation):
        end = data.seek(0, os.SEEK_END)
        data.seek(pos)
        return end - pos


def copy_limited(chunks: Iterable[bytes | memoryview], fileobj: BinaryIO, *, max_bytes: int, digest: str) -> int:
    """Write ``chunks`` to ``fileobj``, refusing to write past ``max_bytes``.

    A server that sends more than the record says is cut off at the limit
    (RemoteChecksumMismatch, nothing more is read), so a hostile or damaged
    remote cannot fill the disk.
    """
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > max_bytes:
            raise RemoteChecksumMismatch(digest, expected_size=max_bytes, got_size=total, got_digest=None)
        try:
            fileobj.write(chunk)
        except OSError as exc:  # the local side: never mistaken for a remote failure
            raise local_write_error(exc, getattr(fileobj, "name", "download")) from exc
    return total


def local_write_error(exc: OSError, name: object) -> StoreError:
    """A failed local write while downloading: StoreFull on a full disk, else a StoreError."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return StoreFull(str(name), os.strerror(exc.errno))
    return StoreError(f"writing {name}: {exc}")


def transport_error(exc: BaseException, *, op: str, target: str) -> RemoteError:
    """The remote error for a socket-level failure: a timeout, or anything else that broke the connection."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, TimeoutError):
        return RemoteTimeout(detail, op=op, target=target)
    return RemoteUnavailable(detail, op=op, target=target)


def status_error(status: int, detail: str, *, op: str, target: str) -> RemoteError:
    """The remote error for an HTTP status that is not an answer (neither 2xx, 404 nor 412).

    A 5xx (and 429, too many requests) says the server cannot serve now: it
    trips the circuit breaker.  Any other 4xx says the request is wrong
    (credentials, permissions): an error, but asking again soon is harmless.
    """
    if status >= 500 or status == 429:
        return RemoteUnavailable(f"HTTP {status} {detail}".rstrip(), op=op, target=target, status=status)
    return RemoteRejected(f"HTTP {status} {detail}".rstrip(), op=op, target=target, status=status)


class RemoteBackend(abc.ABC):
    """get / get_to / put / head / put_if_absent / delete on ``cas`` and ``ac`` objects.

    Every method raises only :class:`~adstore.store.remote.errors.RemoteError`
    subclasses (plus InvalidDigest for a bad digest): RemoteUnavailable for
    refused or reset connections and 5xx answers, RemoteTimeout for timeouts,
    RemoteRejected for other 4xx answers.  A missing object is ``None``, not
    an error.  Implementations must be safe to call from several threads.

    Each call runs in a worker the caller gives up on at its deadline.  A
    backend that can cut a blocked call short (shut its socket down) says
    how while it blocks, with :func:`~adstore.store.remote.interruptible`;
    one that cannot is abandoned to its own timeouts, and never keeps the
    process alive.
    """

    #: The URL the backend was opened with, without credentials (for status and logs).
    url: str = ""
    conditional_writes: ConditionalWrites = ConditionalWrites.NONE
    #: How blobs the store keeps compressed travel: as their compressed files (``zcas/``), or raw (``cas/``:
    #: what the Bazel HTTP protocol's clients expect there).
    transfer: Encoding = Encoding.RAW

    @abc.abstractmethod
    def get_to(self, kind: Kind, digest: str, fileobj: BinaryIO, max_bytes: int) -> int | None:
        """Stream the object into ``fileobj``; its size, or None if it is absent.

        Never writes more than ``max_bytes`` (RemoteChecksumMismatch past it).
        """

    def get(self, kind: Kind, digest: str) -> bytes | None:
        """The whole object, or None if it is absent (small objects: records, leases)."""
        buf = io.BytesIO()
        if self.get_to(kind, digest, buf, sys.maxsize) is None:
            return None
        return buf.getvalue()

    @abc.abstractmethod
    def put(self, kind: Kind, digest: str, data: Body) -> int:
        """Store the object (replacing any); returns the bytes sent."""

    @abc.abstractmethod
    def head(self, kind: Kind, digest: str) -> int | None:
        """The object's size, or None if it is absent."""

    def put_if_absent(self, kind: Kind, digest: str, data: Body) -> bool:
        """Store the object only if none exists; True if this call created it.

        Atomic where :attr:`conditional_writes` says so.  The default raises
        NotSupported: single-flight then falls back to a best-effort lease
        (docs/remote.md, "Failure costs").
        """
        raise NotSupported(type(self).__name__, "put_if_absent")

    def list_digests(self, kind: Kind) -> list[str]:
        """The digests of every ``kind`` object (``adstore pull --all``); names that are not digests are left out.

        Optional: the Bazel HTTP protocol has no listing, so the default raises
        NotSupported (``remote_unsupported``); S3, WebDAV servers and memory list.
        """
        raise NotSupported(type(self).__name__, f"listing {kind.value}/")

    @abc.abstractmethod
    def delete(self, kind: Kind, digest: str) -> None:
        """Remove the object if it exists (lease release; remote eviction is the server's job)."""

    def close(self) -> None:
        """Release connections; the backend may not be used afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
