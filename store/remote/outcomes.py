"""Outcomes: what the public layer returns instead of raising.

A remote is an optimisation, so nothing it does may fail a pipeline (docs/remote.md,
"Failure costs"): every public call of :class:`~adstore.store.remote.client.Remote`
returns an :class:`Outcome` carrying either a value or a reason (a word of the
store's reason list), the error behind it, the bytes moved and the seconds
spent, and the caller turns a failed one into a miss.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import AdstoreError

__all__ = ["Outcome", "Mode"]

T = TypeVar("T")


class Mode(enum.StrEnum):
    """Whether this process may write the remote (the ccache/sccache convention)."""

    READ = "read"  # clients: fetch only (the default)
    READ_WRITE = "read-write"  # builders: fetch, upload, take build leases


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """A value (``reason is None``) or a reason; never an exception.

    ``value`` may be None on success where absence is an answer (``get`` and
    ``head`` of a missing object).  ``nbytes`` is what crossed the network
    (down or up) for this call.
    """

    value: T | None = None
    reason: str | None = None
    error: AdstoreError | None = None
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.reason is None
