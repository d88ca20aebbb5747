"""Blob transfer: bounded, verified downloads and deduplicated uploads.

A download streams into its destination while it is hashed, once: into a
new file beside ``dest`` (:func:`fetch_blob`), or straight into the local
store's blob file (:func:`pull_blob`, the store's ``BlobWriter``: temp,
fsync, rename, register).  Bytes that do not hash to their digest, or have
another size than the record declares, are dropped and rejected, never
handed to the store (docs/remote.md, "Failure costs").  A download never reads past
the declared size, and it has a deadline: the remote's limit for one call
plus the size at the minimum throughput (``deadline.Limits``), within the
deadline of the whole operation it belongs to.  The download itself runs in
a worker thread (``deadline.run_bounded``) that owns what it writes: a
caller that gave up at its deadline cancels it, and the worker removes its
own temp file.

An upload asks the server first (HEAD): content addressing makes a blob
another host already pushed cost nothing, and a re-push of a whole entry
sends 0 blob bytes.

The functions take the :class:`~adstore.store.remote.client.Remote` (as a
:class:`Door`: this module does not import the client) whose guarded
``_call`` they go through and raise its errors; the ``Remote`` methods of
the same names turn those into outcomes.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..blobwriter import BACKGROUND_HASH_BYTES, Cancelled, HashingWriter
from ..codec import Encoding
from ..errors import ChecksumMismatch
from ..index.rows import BlobRef
from ..names import validate_digest
from ..records.format import RECORD_FORMAT
from .addresses import Kind
from .backend import RemoteBackend, local_write_error
from .deadline import Deadline, Limits
from .errors import RemoteBlobMissing, RemoteChecksumMismatch
from .outcomes import Outcome

if TYPE_CHECKING:
    from ..blobs import StoredBlob
    from ..blobwriter import BlobWriter
    from ..maintenance.reservations import Reservation

__all__ = [
    "Door",
    "BlobSink",
    "BlobSource",
    "fetch_blob",
    "pull_blob",
    "pull_blobs",
    "push_blob",
    "publish",
    "plan_publish",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Door(Protocol):
    """What a transfer needs of the remote: :class:`~adstore.store.remote.client.Remote` is one.

    A protocol rather than the class, so this module does not import the
    client that imports it (the store's modules import one way only).
    """

    @property
    def url(self) -> str: ...

    @property
    def backend(self) -> RemoteBackend: ...

    @property
    def limits(self) -> Limits: ...

    def count(self, name: str, n: int = 1) -> None: ...

    def _call(
        self,
        op: str,
        kind: Kind,
        digest: str,
        fn: Callable[[], T],
        *,
        write: bool = False,
        deadline: Deadline | None = None,
        on_expire: Callable[[], None] | None = None,
    ) -> T: ...

    def push_blob(
        self, digest: str, size: int, source: str | Path | bytes, *, kind: Kind | str = Kind.CAS
    ) -> Outcome[int]: ...

    def push_record(self, key: str, rank: int, payload: Mapping[str, Any]) -> Outcome[int]: ...


class BlobSink(Protocol):
    """Where pulled blobs go: :class:`adstore.store.Store` has these methods."""

    def has_blob(self, digest: str) -> bool: ...

    def admit(self, nbytes: int) -> Reservation: ...  # room held for nbytes, or OverBudget / StoreFull before any byte

    def blob_writer(
        self,
        ref: BlobRef,
        *,
        source: Encoding = ...,
        frame_size: int | None = ...,
        cancelled: threading.Event | None = ...,
    ) -> BlobWriter: ...


class BlobSource(Protocol):
    """Where pushed blobs come from: :class:`adstore.store.Store` has these methods."""

    def stored_blob(self, digest: str) -> StoredBlob | None: ...  # None for a blob kept inline in the index

    def get_bytes(self, digest: str) -> bytes: ...

    def copy_blob_to(self, digest: str, dest: str | os.PathLike[str]) -> Path: ...

    def temp_path(self, suffix: str = ...) -> Path: ...


def _rejected(remote: Door, exc: RemoteChecksumMismatch) -> RemoteChecksumMismatch:
    remote.count("checksum_rejected")
    log.warning("remote %s: %s", remote.url, exc)
    return exc


def fetch_blob(
    remote: Door, digest: str, size: int, *, dest: Path, fsync: bool = False, deadline: Deadline | None = None
) -> Outcome[Path]:
    """Download blob ``digest`` into the new file ``dest`` (never replacing or following anything there).

    Returns ``dest`` only if the content hashes to ``digest`` and is exactly
    ``size`` bytes; on any failure nothing is left at ``dest``.
    """
    validate_digest(digest)
    cancelled = threading.Event()
    commit_lock = threading.Lock()
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.part")

    def run() -> int:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise local_write_error(exc, dest) from exc
        writer = HashingWriter(
            fd, str(dest), background=size >= BACKGROUND_HASH_BYTES, durable=fsync, cancelled=cancelled
        )
        try:
            try:
                n = remote.backend.get_to(Kind.CAS, digest, writer, size)  # type: ignore[arg-type]
            finally:
                remote.count("bytes_down", writer.size)
                failed = writer.finish()  # raised below only if the download itself succeeded
            if isinstance(failed, OSError):
                raise local_write_error(failed, dest) from failed
            if failed is not None:
                raise failed
            if n is None:
                raise RemoteBlobMissing(digest)
            if writer.hexdigest() != digest or writer.size != size:
                raise RemoteChecksumMismatch(
                    digest, expected_size=size, got_size=writer.size, got_digest=writer.hexdigest()
                )
            if fsync:
                os.fsync(fd)
            with commit_lock:
                if cancelled.is_set():
                    raise Cancelled(f"blob {digest}: the caller gave up at its deadline")
                try:
                    os.link(tmp, dest)  # fails on anything already at dest, follows no symlink there
                except OSError as exc:
                    raise local_write_error(exc, dest) from exc
            return writer.size
        finally:
            os.close(fd)
            tmp.unlink(missing_ok=True)

    def expire() -> None:
        with commit_lock:
            cancelled.set()

    try:
        n = remote._call(
            "get", Kind.CAS, digest, run, deadline=remote.limits.start(size).sooner(deadline), on_expire=expire
        )
    except RemoteChecksumMismatch as exc:
        raise _rejected(remote, exc) from None
    remote.count("blobs_down")
    return Outcome(value=dest, nbytes=n)


def pull_blob(
    remote: Door, digest: str, size: int, *, sink: BlobSink, frame: int | None = None, deadline: Deadline | None = None
) -> int:
    """Stream blob ``digest`` into ``sink`` (a Store), verified while written; the bytes received.

    ``frame``: the blob travels as a compressed file of that many bytes (``zcas/``),
    written into its file as it arrives and decoded at the commit; else its
    raw ``size`` bytes come from ``cas/``.
    """
    validate_digest(digest)
    cancelled = threading.Event()
    kind, limit = (Kind.CAS, size) if frame is None else (Kind.ZCAS, frame)

    def run() -> int:
        with sink.blob_writer(
            BlobRef(digest, size),
            source=Encoding.RAW if frame is None else Encoding.ZSTD,
            frame_size=frame,
            cancelled=cancelled,
        ) as writer:
            try:
                n = remote.backend.get_to(kind, digest, writer, limit)  # type: ignore[arg-type]
            except ChecksumMismatch:  # the writer refused a byte past the declared size
                raise RemoteChecksumMismatch(
                    digest, expected_size=limit, got_size=writer.received + 1, got_digest=None
                ) from None
            finally:
                remote.count("bytes_down", writer.received)
            if n is None:
                raise RemoteBlobMissing(digest)
            try:
                writer.commit()
            except ChecksumMismatch as exc:
                raise RemoteChecksumMismatch(
                    digest, expected_size=size, got_size=writer.received, got_digest=exc.got
                ) from None
            return n

    try:
        n = remote._call(
            "get", kind, digest, run, deadline=remote.limits.start(limit).sooner(deadline), on_expire=cancelled.set
        )
    except RemoteChecksumMismatch as exc:
        raise _rejected(remote, exc) from None
    remote.count("blobs_down")
    return n


def pull_blobs(
    remote: Door,
    refs: Iterable[tuple[str, int]],
    *,
    sink: BlobSink,
    stored: Mapping[str, tuple[Encoding, int]] | None = None,
    deadline: Deadline | None = None,
) -> Outcome[int]:
    """Stream every blob of ``refs`` that ``sink`` lacks into it: all, or the first failure.

    ``stored`` (a record's): the blobs that travel compressed, and their
    files' sizes.  The declared total of what will be downloaded is
    admitted first (``sink.admit``: budget and free space, with what other
    downloads reserved), so a record that announces more than the store may
    hold costs no download at all, and it stays reserved until it is written.  The
    whole pull has a deadline: ``deadline``, else the remote's limit for
    that total.  Blobs stored before a failure are unreferenced and left to
    the store's gc, never half-committed.
    """
    frames = dict(stored or {})
    wanted = sorted({(validate_digest(d), int(s)) for d, s in refs})
    missing = [(d, s, frames[d][1] if d in frames else None) for d, s in wanted if not sink.has_blob(d)]
    total = sum(s if f is None else f for _, s, f in missing)
    whole = deadline if deadline is not None else remote.limits.start(total)
    received = 0
    with sink.admit(total) as reservation:  # held until each blob is in place, the rest released at the end
        for digest, size, frame in missing:
            received += pull_blob(remote, digest, size, sink=sink, frame=frame, deadline=whole)
            reservation.consume(size if frame is None else frame)
    return Outcome(value=received, nbytes=received)


def push_blob(
    remote: Door, digest: str, size: int, source: str | os.PathLike[str] | bytes, *, kind: Kind = Kind.CAS
) -> Outcome[int]:
    """Upload a blob (``cas/``: its content; ``zcas/``: its compressed file) unless the remote holds it with this size.

    The bytes sent (0 when it had it).
    """
    validate_digest(digest)
    have = remote._call("head", kind, digest, lambda: remote.backend.head(kind, digest))
    if have == size:
        remote.count("blobs_skipped")
        remote.count("bytes_skipped", size)
        return Outcome(value=0)
    deadline = remote.limits.start(size)

    def send() -> int:
        if isinstance(source, (bytes, bytearray, memoryview)):
            return remote.backend.put(kind, digest, source)
        with open(source, "rb") as f:
            return remote.backend.put(kind, digest, f)

    sent = remote._call("put", kind, digest, send, write=True, deadline=deadline)
    remote.count("blobs_up")
    remote.count("bytes_up", sent)
    return Outcome(value=sent, nbytes=sent)


def publish(
    remote: Door,
    key: str,
    rank: int,
    payload: Mapping[str, Any],
    refs: Iterable[tuple[str, int]],
    *,
    source: BlobSource,
) -> Outcome[int]:
    """Push the blobs the remote lacks, then this rank's signed record, last.

    A blob the store keeps compressed travels as its file (``zcas/``)
    where the remote takes frames (S3), and the record says so (``stored``,
    format 2); elsewhere every blob travels raw (``cas/``, the Bazel HTTP
    protocol's), decoded on the way when the store keeps it compressed.
    """
    sent = 0
    stored: dict[str, tuple[Encoding, int]] = {}
    for digest, size in refs:
        kind, travels, found = _travel(remote, digest, size, source)
        if found is None:  # inline in the index
            pushed = remote.push_blob(digest, size, source.get_bytes(digest))
        elif kind is Kind.ZCAS:
            pushed = remote.push_blob(digest, travels, found.path, kind=Kind.ZCAS)
            stored[digest] = (Encoding.ZSTD, travels)
        elif found.encoding is Encoding.RAW:
            pushed = remote.push_blob(digest, size, found.path)
        else:
            pushed = _push_decoded(remote, digest, size, source)
        if not pushed.ok:
            return pushed
        sent += pushed.nbytes
    if stored:
        payload = {
            **payload,
            "format": RECORD_FORMAT,
            "stored": {d: [str(enc), n] for d, (enc, n) in sorted(stored.items())},
        }
    record = remote.push_record(key, rank, payload)
    if not record.ok:
        return record
    return Outcome(value=sent, nbytes=sent + record.nbytes)


def _travel(remote: Door, digest: str, size: int, source: BlobSource) -> tuple[Kind, int, StoredBlob | None]:
    """How :func:`publish` sends a blob: its kind, the bytes that travel, and the store's file (None: inline).

    A compressed file travels as it is (``zcas/``) where the remote takes frames; everything else raw.
    """
    found = source.stored_blob(digest)
    if found is not None and found.encoding is not Encoding.RAW and remote.backend.transfer is Encoding.ZSTD:
        return Kind.ZCAS, found.stored, found
    return Kind.CAS, size, found


def plan_publish(remote: Door, refs: Iterable[tuple[str, int]], *, source: BlobSource) -> list[tuple[str, int, bool]]:
    """What :func:`publish` would send, asking HEADs only: per blob (digest, bytes that travel, the remote has it)."""
    plan = []
    for digest, size in refs:
        validate_digest(digest)
        kind, travels, _ = _travel(remote, digest, size, source)
        have = remote._call("head", kind, digest, functools.partial(remote.backend.head, kind, digest))
        plan.append((digest, travels, have == travels))
    return plan


def _push_decoded(remote: Door, digest: str, size: int, source: BlobSource) -> Outcome[int]:
    """Upload the raw content of a blob the store keeps compressed (decoded, verified, into a temp file)."""
    tmp = source.temp_path(".push")
    try:
        source.copy_blob_to(digest, tmp)
        return remote.push_blob(digest, size, tmp)
    finally:
        tmp.unlink(missing_ok=True)
