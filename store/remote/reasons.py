"""Reasons of the remote tier, the same words as the store's ``Reason`` list.

A :class:`RemoteReason` is a ``StrEnum`` like :class:`adstore.store.Reason`,
so ``RemoteReason.REMOTE_TIMEOUT == "remote_timeout"`` and counter names,
JSON and events read the same words whichever enum produced them.  The
store's list holds them too (errors carry those); this enum stays as the
remote package's own vocabulary (README, "Remote tier").
"""

from __future__ import annotations

import enum

__all__ = ["RemoteReason"]


class RemoteReason(enum.StrEnum):
    """Why a remote call, a remote record or a single-flight wait did not succeed."""

    # -- the server --------------------------------------------------------
    REMOTE_UNAVAILABLE = "remote_unavailable"  # refused, reset, DNS, 5xx, or the circuit is open after one
    REMOTE_TIMEOUT = "remote_timeout"  # a connect or read timed out (or the circuit is open after one)
    REMOTE_ERROR = "remote_error"  # the server refused the request (4xx other than 404/412): credentials, protocol
    REMOTE_READ_ONLY = "remote_read_only"  # a write asked of a client in read mode (never sent)
    REMOTE_UNSUPPORTED = "remote_unsupported"  # the backend lacks the operation (put-if-absent)

    # -- what the remote holds ---------------------------------------------
    REMOTE_BLOB_MISSING = "remote_blob_missing"  # a record references a blob the remote no longer has
    REMOTE_CHECKSUM = "remote_checksum"  # a remote blob does not hash to its digest or has another size
    UNTRUSTED_REMOTE = "untrusted_remote"  # a record unsigned, forged, tampered, by an unknown key, or misplaced

    # -- single-flight builds ----------------------------------------------
    SINGLE_FLIGHT_TIMEOUT = "single_flight_timeout"  # the builder did not publish within the wait
    BUILDER_GONE = "builder_gone"  # the builder's lease expired, its process died, or it released without a record
