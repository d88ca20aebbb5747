"""The toolchain entry's restore in the background, and the one deadline a process waits for it.

:func:`~adstore.integration.inductor.plug.enable` learns the answers to
Inductor's ISA probes from the store (their own small entry) in a daemon
thread while Dynamo traces; the ~150 MB precompiled header of the toolchain
entry is looked up (fetched from a remote) and placed only by
:meth:`Toolchain.wait_done`, which Inductor's
header step calls the first time it really builds a kernel
(:mod:`~adstore.integration.inductor.header`): a start whose kernels all
come from the store copies no header.  The header step waits for the lookup,
but the process waits :attr:`Toolchain.wait`
seconds *in all*, counted from :meth:`Toolchain.start`: once that deadline
is past, every later step goes on at once (a stuck remote costs one wait,
not one per step), and the timeout is counted once
(``inductor.failopen.remote_timeout``).  An ISA probe without a recorded
answer waits for the entry's answers at most :attr:`Toolchain.answers_wait`
of that deadline, once: the probes themselves cost about a second, so a
slow download of the header does not hold them longer than that.

The same thread then sweeps what killed processes left in Inductor's and
vLLM's directories (``adstore.store.plan_dead_temps``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from adstore.integration.inductor.entries import InductorEntries, note_failure
from adstore.store import Reason

__all__ = ["Toolchain"]

logger = logging.getLogger(__name__)


def _event_wait(event: threading.Event, timeout: float) -> bool:
    return event.wait(timeout)


class Toolchain:
    """One process's toolchain restore: a thread, two events (answers known, done) and one deadline.

    ``clock`` and ``waiter`` (``waiter(event, timeout) -> set``) are injected in tests.
    """

    def __init__(
        self,
        entries: InductorEntries,
        *,
        wait: float,
        answers_wait: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        waiter: Callable[[threading.Event, float], bool] = _event_wait,
        sweep: bool = True,
    ) -> None:
        self.entries = entries
        self.wait = wait
        self.answers_wait = answers_wait
        self._answers_given_up = False
        self.answered = threading.Event()
        self.done = threading.Event()
        self._clock = clock
        self._waiter = waiter
        self._sweep = sweep
        self._deadline: float | None = None
        self._expired = False
        self._lock = threading.Lock()
        self._placed = False  # the headers: placed by the first wait_done after the lookup
        self._place_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="adstore-inductor-toolchain", daemon=True)

    def start(self) -> None:
        """Start the restore; the deadline counts from now."""
        self._deadline = self._clock() + self.wait
        self.thread.start()

    def _run(self) -> None:
        try:
            # fails open: counted and logged there; a store that failed has no header to place either
            self._placed = not self.entries.find_toolchain(self.answered)
        finally:
            self.answered.set()
            self.done.set()
        if self._sweep:
            sweep_dead_temps(self.entries.store)

    def wait_answers(self) -> None:
        """Until the ISA answers are known: :attr:`answers_wait` at most, once, within the deadline; never raises."""
        if self._answers_given_up or self.answered.is_set():
            return
        self._until(self.answered, "the ISA probes' answers", cap=self.answers_wait)
        self._answers_given_up = not self.answered.is_set()

    def wait_done(self) -> None:
        """Until the lookup is done, or the process's deadline, then place the headers found (once); never raises."""
        self._until(self.done, "the precompiled header")
        if not self.done.is_set() or threading.current_thread() is self.thread:
            return
        with self._place_lock:
            if self._placed:
                return
            self._placed = True
            placed = self.entries.place_toolchain()  # fails open: counted and logged there
            logger.info("adstore: %d toolchain files placed (pid %d)", placed, os.getpid())

    def _until(self, event: threading.Event, what: str, *, cap: float | None = None) -> None:
        if event.is_set() or self._expired or self._deadline is None or threading.current_thread() is self.thread:
            return
        left = self._deadline - self._clock()
        if cap is not None and cap < left:
            self._waiter(event, cap)  # the probes run without the answers; the deadline stands for the header
            return
        if left > 0 and self._waiter(event, left):
            return
        with self._lock:
            if event.is_set() or self._expired:
                return
            self._expired = True
        why = f"toolchain restore still running after {self.wait:g} s; Inductor builds {what} itself"
        note_failure(str(Reason.REMOTE_TIMEOUT), why, self.entries.store)

    def join(self) -> None:
        """Wait for the thread until the deadline (it uses the store a disable closes next)."""
        if self._deadline is None or not self.thread.is_alive() or threading.current_thread() is self.thread:
            return
        self.thread.join(max(0.0, self._deadline - self._clock()) + 1.0)


def sweep_dead_temps(store: Any = None) -> int:
    """Remove what killed processes left in Inductor's, vLLM's and the temp directory (this user's); never raises."""
    try:
        from adstore.store import plan_dead_temps

        plan = plan_dead_temps()
        if not plan.victims:
            return 0
        freed = plan.execute()
        logger.info("adstore: swept %d leftovers of dead processes (%d bytes)", len(plan.victims), freed)
        if store is not None:
            store.count({"inductor.dead_temps_swept": len(plan.victims)})
        return len(plan.victims)
    except Exception as exc:  # noqa: BLE001 - a sweep is housekeeping: the next one tries again
        logger.debug("sweeping dead processes' leftovers: %s", exc)
        return 0
