"""Bounded calls: a backend call runs in a worker the caller waits for only until its deadline.

Why workers of its own, and daemon threads: a call the caller gave up on may
never end by itself (S3 waiting for response headers, a user's backend that
cannot be interrupted), and a worker that is joined at exit, as
``concurrent.futures`` joins its own, then keeps the process alive long after
its caller was released.  A worker here never delays exit: the call it was
running is abandoned with the process, and whatever it was writing is a
unique temp file the sweep removes (docs/remote.md, "Failure costs").

Why a token per call, never a thread: at the deadline the call is cut short
through what *it* registered while it ran (:func:`interruptible`: the HTTP
backend's socket, the S3 body being read).  The thread that ran it may
already run another call, and cutting "the thread's" connection would cut
that one.  A call that ends on its own is reported as it ended, whatever it
raised (a ``TimeoutError`` of its own included): only the deadline passing
is "not done within the deadline".
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .deadline import Deadline
from .errors import RemoteTimeout

__all__ = ["Call", "interruptible", "run_bounded", "MAX_WORKERS"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Worker threads for bounded calls: enough for the pipeline's ranks and an uploader in one process.
MAX_WORKERS = 32


class _State(enum.Enum):
    PENDING = "pending"  # queued, no worker took it yet
    RUNNING = "running"
    DONE = "done"
    ABANDONED = "abandoned"  # given up before a worker took it: never runs


class Call(Generic[T]):
    """One bounded call: its state, its outcome, and how to cut it short (what it registered)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn: Callable[[], T] | None = fn
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._state = _State.PENDING
        self._result: T | None = None
        self._error: BaseException | None = None
        self._cuts: list[Callable[[], None]] = []
        self.interrupted = False

    def run(self) -> None:
        """Run the call in this thread (a worker's), unless it was abandoned before it started."""
        with self._lock:
            if self._state is not _State.PENDING:
                return
            self._state = _State.RUNNING
            fn, self._fn = self._fn, None
        outer = getattr(_current, "call", None)
        _current.call = self
        try:
            assert fn is not None
            self._result = fn()
        except BaseException as exc:  # handed to the caller as the call's own outcome
            self._error = exc
        finally:
            _current.call = outer
            with self._lock:
                self._state = _State.DONE
                self._cuts.clear()
                late = self.interrupted
            self._done.set()
        if late and self._error is not None:
            log.debug("remote call given up at its deadline ended with %s: %s", type(self._error).__name__, self._error)

    def wait(self, timeout: float) -> bool:
        """True once the call is over (within ``timeout`` seconds)."""
        return self._done.wait(timeout)

    def outcome(self) -> T:
        """The call's result, or the exception it raised, unchanged (only once it is over)."""
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def abandon(self) -> bool:
        """True if the call had not started: it never will."""
        with self._lock:
            if self._state is _State.PENDING:
                self._state = _State.ABANDONED
                self._fn = None
                return True
            return False

    def interrupt(self, on_expire: Callable[[], None] | None = None) -> bool:
        """Give the running call up: ``on_expire``, then every cut it registered; False if it was over.

        Runs under the call's lock, which the call also takes to register or
        drop a cut and to finish, so a cut never reaches anything the call
        no longer uses.  Cuts must be quick and must not block (a socket
        shutdown); a failing one is logged, never raised.
        """
        with self._lock:
            if self._state is _State.DONE:
                return False
            self.interrupted = True
            for cut in ([on_expire] if on_expire is not None else []) + self._cuts:
                try:
                    cut()
                except Exception as exc:  # interrupting is best effort
                    log.debug("interrupting a remote call past its deadline failed: %s", exc)
            return True

    def _register(self, cut: Callable[[], None]) -> None:
        with self._lock:
            if self.interrupted:
                raise RemoteTimeout("given up at its deadline before it went on")
            self._cuts.append(cut)

    def _unregister(self, cut: Callable[[], None]) -> None:
        with self._lock:
            with contextlib.suppress(ValueError):
                self._cuts.remove(cut)


_current = threading.local()


@contextlib.contextmanager
def interruptible(cut: Callable[[], None]) -> Iterator[None]:
    """While the block runs, ``cut()`` cuts the current bounded call short if its deadline passes.

    For backends: wrap the part of a call that can block on something
    another thread can stop (``sock.shutdown``).  ``cut`` is called at most
    once, from the caller's thread, only while the block runs, and must be
    quick.  Outside a bounded call (no deadline) this does nothing; inside
    one whose deadline already passed it raises :class:`RemoteTimeout`, so
    the worker stops before it sends anything more.
    """
    call = getattr(_current, "call", None)
    if call is None:
        yield
        return
    call._register(cut)
    try:
        yield
    finally:
        call._unregister(cut)


class _Workers:
    """Daemon worker threads, made as needed up to a limit and kept (an HTTP connection lives in each).

    Threads do not survive ``fork``: a child starts with none and makes its own.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._reset()

    def _reset(self) -> None:
        """No workers (at start, and in a forked child, where a lock held by a parent's thread stays held)."""
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Call[object]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one permit per idle worker
        self._count = 0

    def submit(self, call: Call[T]) -> None:
        with self._lock:
            self._queue.put(call)  # type: ignore[arg-type]
            if self._idle.acquire(blocking=False) or self._count >= self._limit:
                return  # an idle worker takes it, or the next one to finish does
            self._count += 1
            name = f"adstore-remote-{self._count}"
            work, idle = self._queue, self._idle
        threading.Thread(target=_work, args=(work, idle), name=name, daemon=True).start()


def _work(work: queue.SimpleQueue[Call[object]], idle: threading.Semaphore) -> None:
    while True:
        work.get().run()
        idle.release()


_WORKERS = _Workers(MAX_WORKERS)
os.register_at_fork(after_in_child=_WORKERS._reset)


def run_bounded(
    fn: Callable[[], T],
    deadline: Deadline | None,
    *,
    op: str,
    target: str = "",
    on_expire: Callable[[], None] | None = None,
) -> T:
    """``fn()``'s outcome, or :class:`RemoteTimeout` as soon as ``deadline`` passes.

    ``fn`` runs in a daemon worker; at the deadline ``on_expire`` runs and
    the call is cut short through what it registered (:func:`interruptible`),
    and the worker is left to finish on its own: ``fn`` must own and clean up
    whatever it creates (it must not hand anything to a caller that gave up,
    see ``BlobWriter.cancel``).  Whatever ``fn`` raises before the deadline is
    raised as it is.  Without a deadline ``fn`` runs in the caller's thread.
    """
    if deadline is None:
        return fn()
    deadline.check(op, target)
    call = Call(fn)
    _WORKERS.submit(call)
    if call.wait(max(0.0, deadline.remaining())):
        return call.outcome()
    if call.abandon():  # every worker was busy: nothing started, nothing to cut
        raise RemoteTimeout(f"no worker free within the deadline of {deadline.seconds:g}s", op=op, target=target)
    if not call.interrupt(on_expire):  # it ended just now: its own outcome
        return call.outcome()
    raise RemoteTimeout(f"not done within the deadline of {deadline.seconds:g}s", op=op, target=target)
