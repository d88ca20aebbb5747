"""Reasons of the remote tier: the remote words of the store's one ``Reason`` list.

:data:`RemoteReason` is a ``StrEnum`` holding exactly the remote tier's words
(``RemoteReason.REMOTE_TIMEOUT == Reason.REMOTE_TIMEOUT == "remote_timeout"``),
built from :class:`adstore.store.Reason` so the words are written once;
counter names, JSON and events read the same whichever enum produced them
(README, "Remote tier").
"""

from __future__ import annotations

import enum

from ..reasons import Reason

__all__ = ["RemoteReason", "REMOTE_WORDS"]

#: The store's reasons that belong to the remote tier (server, what it holds, single-flight builds).
REMOTE_WORDS = (
    Reason.REMOTE_UNAVAILABLE, Reason.REMOTE_TIMEOUT, Reason.REMOTE_ERROR, Reason.REMOTE_READ_ONLY,
    Reason.REMOTE_UNSUPPORTED, Reason.REMOTE_BLOB_MISSING, Reason.REMOTE_CHECKSUM, Reason.UNTRUSTED_REMOTE,
    Reason.SINGLE_FLIGHT_TIMEOUT, Reason.BUILDER_GONE,
)

#: Why a remote call, a remote record or a single-flight wait did not succeed.
RemoteReason = enum.StrEnum("RemoteReason", [(r.name, r.value) for r in REMOTE_WORDS],  # type: ignore[misc]
                            module=__name__)
