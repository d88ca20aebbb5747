"""The store's clock: where "now" comes from, so tests move time instead of sleeping.

Times the store keeps (a blob's last put, an entry's creation and last
access, a lease's expiry) are compared across processes and survive
restarts, so they are wall-clock seconds (``time.time``).  Every part of the
store asks its ``Tables.clock`` for them; ``Store(clock=...)`` injects
another, such as :class:`ManualClock`.  File modification times (temp files,
record files) come from the filesystem and stay real: a test that ages files
moves its clock forward, never backward.  The remote tier's deadlines use a
monotonic clock of their own (``remote.deadline``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Clock", "system_clock", "ManualClock"]

#: ``clock() -> seconds since the epoch``.
Clock = Callable[[], float]

system_clock: Clock = time.time


class ManualClock:
    """The system clock plus however far a test moved it: ``clock()``, ``clock.advance(seconds)``.

    It keeps running with real time, so files the store writes (whose
    modification times are real) are never in this clock's future, and a
    test ages everything at once by advancing it instead of sleeping.
    """

    def __init__(self) -> None:
        self._offset = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return time.time() + self._offset

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (never back); the new time."""
        if seconds < 0:
            raise ValueError("a clock only moves forward")
        with self._lock:
            self._offset += seconds
        return self()
