"""Deadlines: a remote operation costs bounded time as a whole, not per socket read.

A socket timeout bounds one read; a server that drips its answer a byte at a
time never trips it.  So every remote operation also has a :class:`Deadline`
(a point on a monotonic clock), and ``calls.run_bounded`` runs each backend
call in a worker thread that the caller waits for only until the deadline.
When it passes, the caller gets :class:`RemoteTimeout` at once and the call
is cut short through what it registered (the HTTP backend's socket);
whatever the worker was writing refuses further bytes and cleans up after
itself.  This holds for every backend, including a user's that knows nothing
about deadlines.

How long an operation may take (:class:`Limits`): ``deadline`` for one call
whose size is small or unknown (a record, a HEAD, a lease), plus, for a blob,
its declared size at ``min_throughput``; a whole restore gets the sum over
its blobs.  A remote slower than that is, for a cache, a miss.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import RemoteTimeout

__all__ = ["Clock", "Deadline", "Limits", "DEFAULT_DEADLINE", "DEFAULT_MIN_THROUGHPUT"]

#: ``clock() -> seconds`` on a monotonic scale (injected by tests).
Clock = Callable[[], float]

#: Seconds one small call (record, HEAD, lease) may take in all: connect, send, every read.
DEFAULT_DEADLINE = 30.0
#: Bytes per second below which a blob download is given up: 1 MiB/s, far under any usable remote.
DEFAULT_MIN_THROUGHPUT = 1 << 20


@dataclass(frozen=True, slots=True)
class Deadline:
    """The time by which an operation must be over (``clock()`` seconds) and its budget, for messages."""

    at: float
    seconds: float
    clock: Clock = time.monotonic

    @classmethod
    def after(cls, seconds: float, *, clock: Clock = time.monotonic) -> Deadline:
        return cls(clock() + seconds, seconds, clock)

    def remaining(self) -> float:
        return self.at - self.clock()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def sooner(self, other: Deadline | None) -> Deadline:
        """Whichever of the two ends first (a blob's own deadline inside its restore's)."""
        return self if other is None or self.at <= other.at else other

    def check(self, op: str, target: str = "") -> None:
        """Raise :class:`RemoteTimeout` if the deadline has passed."""
        if self.expired():
            raise RemoteTimeout(f"deadline of {self.seconds:g}s passed", op=op, target=target)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """How long remote operations may take (``ADSTORE_REMOTE_DEADLINE``, ``ADSTORE_REMOTE_MIN_THROUGHPUT``)."""

    deadline: float = DEFAULT_DEADLINE
    min_throughput: float = DEFAULT_MIN_THROUGHPUT
    clock: Clock = time.monotonic

    def __post_init__(self) -> None:
        if not self.deadline > 0 or not self.min_throughput > 0:
            raise ValueError("the remote deadline and minimum throughput must be positive")

    def seconds_for(self, nbytes: int = 0) -> float:
        """The time allowed to move ``nbytes`` (0: a small call)."""
        return self.deadline + max(0, nbytes) / self.min_throughput

    def start(self, nbytes: int = 0) -> Deadline:
        """A deadline starting now for moving ``nbytes``."""
        return Deadline.after(self.seconds_for(nbytes), clock=self.clock)
