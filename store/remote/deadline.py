"""Deadlines: a remote operation costs bounded time as a whole, not per socket read.

A socket timeout bounds one read; a server that drips its answer a byte at a
time never trips it.  So every remote operation also has a :class:`Deadline`
(a point on a monotonic clock), and :func:`run_bounded` runs each backend
call in a worker thread that the caller waits for only until the deadline.
When it passes, the caller gets :class:`RemoteTimeout` at once and the
backend is asked to interrupt the call (``RemoteBackend.interrupt``: the HTTP
backend shuts its socket down); whatever the worker was writing refuses
further bytes and cleans up after itself.  This holds for every backend,
including a user's that knows nothing about deadlines.

How long an operation may take (:class:`Limits`): ``deadline`` for one call
whose size is small or unknown (a record, a HEAD, a lease), plus, for a blob,
its declared size at ``min_throughput``; a whole restore gets the sum over
its blobs.  A remote slower than that is, for a cache, a miss.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import RemoteTimeout

__all__ = ["Clock", "Deadline", "Limits", "run_bounded", "DEFAULT_DEADLINE", "DEFAULT_MIN_THROUGHPUT"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: ``clock() -> seconds`` on a monotonic scale (injected by tests).
Clock = Callable[[], float]

#: Seconds one small call (record, HEAD, lease) may take in all: connect, send, every read.
DEFAULT_DEADLINE = 30.0
#: Bytes per second below which a blob download is given up: 1 MiB/s, far under any usable remote.
DEFAULT_MIN_THROUGHPUT = 1 << 20

#: Worker threads for bounded calls: enough for the pipeline's ranks and an uploader in one process.
_MAX_WORKERS = 32


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


class _Pool:
    """One executor per process (threads do not survive ``fork``: a child makes its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        pid = os.getpid()
        if self._executor is None or self._pid != pid:
            with self._lock:
                if self._executor is None or self._pid != pid:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        max_workers=_MAX_WORKERS, thread_name_prefix="adstore-remote"
                    )
                    self._pid = pid
        return self._executor


_POOL = _Pool()


def _log_late(future: concurrent.futures.Future[Any]) -> None:
    exc = future.exception()
    if exc is not None:
        log.debug("remote call abandoned at its deadline ended with %s: %s", type(exc).__name__, exc)


def run_bounded(
    fn: Callable[[], T],
    deadline: Deadline | None,
    *,
    op: str,
    target: str = "",
    interrupt: Callable[[threading.Thread], None] | None = None,
) -> T:
    """``fn()``'s result, or :class:`RemoteTimeout` as soon as ``deadline`` passes.

    ``fn`` runs in a worker thread; at the deadline ``interrupt(worker)`` is
    called (best effort) and the worker is left to finish on its own: ``fn``
    must own and clean up whatever it creates (it must not hand anything to a
    caller that gave up, see ``BlobWriter.cancel``).  Without a deadline
    ``fn`` runs in the caller's thread.
    """
    if deadline is None:
        return fn()
    deadline.check(op, target)
    worker: list[threading.Thread] = []

    def run() -> T:
        worker.append(threading.current_thread())
        return fn()

    future = _POOL.get().submit(run)
    try:
        return future.result(timeout=max(0.0, deadline.remaining()))
    except concurrent.futures.TimeoutError:
        pass
    if future.cancel():  # never started (every worker busy): nothing to interrupt
        raise RemoteTimeout(f"no worker free within the deadline of {deadline.seconds:g}s", op=op, target=target)
    if interrupt is not None and worker:
        try:
            interrupt(worker[0])
        except Exception as exc:  # interrupting is best effort
            log.debug("interrupting a remote call past its deadline failed: %s", exc)
    future.add_done_callback(_log_late)
    raise RemoteTimeout(f"not done within the deadline of {deadline.seconds:g}s", op=op, target=target)
