"""Errors of the remote tier, under the store's one error hierarchy.

Backends raise these (never a raw ``botocore``, ``http.client`` or socket
exception), the public layer (:class:`~adstore.store.remote.client.Remote`)
turns every one of them into an outcome with a reason, so nothing here
reaches a pipeline (docs/remote.md, "Failure costs").  Each carries data: the
operation, the object address, the HTTP status, the digests involved.
"""

from __future__ import annotations

from ..errors import StoreError
from ..reasons import Reason

__all__ = [
    "RemoteError",
    "RemoteUnavailable",
    "RemoteTimeout",
    "RemoteProtocolError",
    "RemoteRejected",
    "ReadOnlyRemote",
    "NotSupported",
    "RemoteBlobMissing",
    "RemoteChecksumMismatch",
    "UntrustedRecord",
]


class RemoteError(StoreError):
    """Something about the remote went wrong; ``reason`` names it."""

    reason: Reason = Reason.REMOTE_ERROR

    def __init__(self, detail: str, *, op: str = "", target: str = "", status: int | None = None) -> None:
        self.detail = detail
        self.op = op
        self.target = target
        self.status = status
        where = " ".join(p for p in (op, target) if p)
        super().__init__(f"remote {where}: {detail}" if where else f"remote: {detail}")


class RemoteUnavailable(RemoteError):
    """Connection refused or reset, a 5xx answer, or the circuit is open after one.

    ``retry_after`` is set on a fast failure of an open circuit: the seconds
    until the breaker lets a probe through.
    """

    reason: Reason = Reason.REMOTE_UNAVAILABLE

    def __init__(
        self,
        detail: str,
        *,
        op: str = "",
        target: str = "",
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.retry_after = retry_after
        super().__init__(detail, op=op, target=target, status=status)


class RemoteTimeout(RemoteUnavailable):
    """A connect or read took longer than the configured timeout."""

    reason: Reason = Reason.REMOTE_TIMEOUT


class RemoteProtocolError(RemoteUnavailable):
    """An answer that breaks the protocol (a length that is not ASCII digits): the server cannot serve.

    A failure of the remote like a 5xx, so it opens the circuit; its reason
    is ``remote_error``, since the server answered.
    """

    reason: Reason = Reason.REMOTE_ERROR


class RemoteRejected(RemoteError):
    """The server answered with a 4xx other than 404/412 (credentials, permissions, protocol)."""

    reason: Reason = Reason.REMOTE_ERROR


class ReadOnlyRemote(RemoteError):
    """A write was asked of a client in read mode; nothing was sent."""

    reason: Reason = Reason.REMOTE_READ_ONLY

    def __init__(self, op: str, target: str = "") -> None:
        super().__init__("the remote is read-only (set ADSTORE_REMOTE_MODE=read-write to write)", op=op, target=target)


class NotSupported(RemoteError):
    """The backend cannot do this operation (put-if-absent on a server without conditional writes)."""

    reason: Reason = Reason.REMOTE_UNSUPPORTED

    def __init__(self, backend: str, op: str) -> None:
        self.backend = backend
        super().__init__(f"{backend} does not support {op}", op=op)


class RemoteBlobMissing(RemoteError):
    """A blob a record references is not on the remote (evicted by the server)."""

    reason: Reason = Reason.REMOTE_BLOB_MISSING

    def __init__(self, digest: str) -> None:
        self.digest = digest
        super().__init__("blob is not on the remote", op="get", target=f"cas/{digest}")


class RemoteChecksumMismatch(RemoteError):
    """Remote bytes that do not hash to their digest, or that have another size than recorded.

    ``got_digest`` is None when the download stopped early because it ran
    past ``expected_size`` (a bounded download never reads more).
    """

    reason: Reason = Reason.REMOTE_CHECKSUM

    def __init__(self, digest: str, *, expected_size: int | None, got_size: int, got_digest: str | None) -> None:
        self.digest = digest
        self.expected_size = expected_size
        self.got_size = got_size
        self.got_digest = got_digest
        if got_digest is None:
            detail = f"more than the {expected_size} bytes recorded"
        elif got_digest != digest:
            detail = f"content hashes to {got_digest} ({got_size} bytes)"
        else:
            detail = f"{got_size} bytes, the record says {expected_size}"
        super().__init__(f"rejected: {detail}", op="get", target=f"cas/{digest}")


class UntrustedRecord(RemoteError):
    """A record that is unsigned, forged, tampered, signed by an unknown key, or of another version."""

    reason: Reason = Reason.UNTRUSTED_REMOTE

    def __init__(self, why: str, *, key_id: str | None = None, target: str = "") -> None:
        self.why = why
        self.key_id = key_id
        super().__init__(f"untrusted record: {why}", op="verify", target=target)
