"""The circuit breaker: a failing remote costs one timeout, not one per lookup.

Closed, every call goes to the server.  A transport failure (timeout,
refused or reset connection, 5xx) opens the circuit for a cool-down: calls
then fail at once (well under a millisecond) with the reason of the failure
that opened it.  After the cool-down one call is let through as a probe
(half-open); its success closes the circuit, its failure opens it again for
twice the cool-down, up to a maximum (docs/remote.md, "Failure costs").  An answer
that is an error (403, 400) still proves the server is there, so it counts
as a success here.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import Any

from ..reasons import Reason
from .errors import RemoteTimeout, RemoteUnavailable

__all__ = ["BreakerState", "CircuitBreaker", "DEFAULT_COOLDOWN", "DEFAULT_MAX_COOLDOWN"]

DEFAULT_COOLDOWN = 30.0
DEFAULT_MAX_COOLDOWN = 300.0


class BreakerState(enum.StrEnum):
    CLOSED = "closed"  # calls go to the server
    OPEN = "open"  # calls fail at once until the cool-down ends
    HALF_OPEN = "half_open"  # one probe call is in flight; the others fail at once


class CircuitBreaker:
    """Thread-safe; ``before()`` guards a call, ``success()``/``failure()`` report how it went."""

    def __init__(
        self,
        *,
        cooldown: float = DEFAULT_COOLDOWN,
        max_cooldown: float = DEFAULT_MAX_COOLDOWN,
        failure_threshold: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cooldown < 0 or max_cooldown < cooldown or failure_threshold < 1:
            raise ValueError("need 0 <= cooldown <= max_cooldown and failure_threshold >= 1")
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.failure_threshold = failure_threshold
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._cooldown = cooldown
        self._open_until = 0.0
        self._opener: RemoteUnavailable | None = None

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
                return BreakerState.HALF_OPEN
            return self._state

    def before(self, op: str = "", target: str = "") -> None:
        """Let the call through, or raise the fast failure of an open circuit."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return
            now = self._clock()
            if self._state is BreakerState.OPEN and now >= self._open_until:
                self._state = BreakerState.HALF_OPEN  # this call is the probe
                return
            opener = self._opener
            retry_after = max(0.0, self._open_until - now)
        cls = RemoteTimeout if isinstance(opener, RemoteTimeout) else RemoteUnavailable
        raise cls(
            f"circuit open after {opener.detail if opener else 'a failure'}; next try in {retry_after:.1f}s",
            op=op,
            target=target,
            retry_after=retry_after,
        )

    def refusal(self) -> Reason | None:
        """Why a call now would fail at once (open, or a probe already in flight), else None; changes nothing.

        The lookup path asks this before anything else: with the circuit
        open, a local miss then costs what it cost without a remote.
        """
        if self._state is BreakerState.CLOSED:  # one attribute read: no lock on the common path
            return None
        return self._refusal_locked()

    def _refusal_locked(self) -> Reason | None:
        with self._lock:  # the state may have changed since the caller's unlocked look
            if self._state is BreakerState.CLOSED:
                return None
            if self._state is BreakerState.OPEN and self._clock() >= self._open_until:
                return None  # the next call is the probe
            return Reason.REMOTE_TIMEOUT if isinstance(self._opener, RemoteTimeout) else Reason.REMOTE_UNAVAILABLE

    def success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._cooldown = self.base_cooldown
            self._opener = None

    def failure(self, error: RemoteUnavailable) -> bool:
        """Record a transport failure; True if it opened the circuit."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN:
                self._cooldown = min(self._cooldown * 2, self.max_cooldown)
            elif self._state is BreakerState.OPEN or self._failures < self.failure_threshold:
                return False
            self._state = BreakerState.OPEN
            self._open_until = self._clock() + self._cooldown
            self._opener = error
            return True

    def snapshot(self) -> dict[str, Any]:
        """State, current cool-down and seconds until the next probe (for ``adstore remote``)."""
        state = self.state
        with self._lock:
            return {
                "state": state.value,
                "cooldown": self._cooldown,
                "retry_after": max(0.0, self._open_until - self._clock()) if state is BreakerState.OPEN else 0.0,
                "last_failure": str(self._opener) if self._opener else None,
            }
