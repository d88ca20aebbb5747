"""Lazy bookkeeping: hit times and counters kept in memory, written at most once per interval.

A hit refreshes the entry's last access and bumps counters in memory; a
background thread writes them at most once per ``flush_interval`` (and at
``close``/exit).  A lookup therefore never waits for a disk write, and LRU
order is exact to within that interval (docs/architecture.md, "How an entry lives").
A read-only store (``persist=False``) keeps them in memory for the life of
the process: no thread, no write (``Store.stats`` adds them to what it reads).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections import Counter
from pathlib import Path

from .index.tables import Tables, Txn

__all__ = ["Bookkeeping", "flush_root"]

log = logging.getLogger(__name__)

_OPEN: weakref.WeakSet[Bookkeeping] = weakref.WeakSet()


class Bookkeeping:
    """Pending counters and access times of one store, and the thread that writes them."""

    def __init__(self, tables: Tables, *, flush_interval: float, persist: bool = True) -> None:
        self._tables = tables
        self._persist = persist
        self.flush_interval = flush_interval
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._access: dict[str, tuple[float, int]] = {}
        self._started = False
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        _OPEN.add(self)

    def hit(self, key: str, *, count: bool) -> None:
        """A lookup hit ``key``: refresh its last access; count the hit (store and entry) only if ``count``.

        Lookups the store makes for itself (a remote restore checking what it
        committed, a push finding its entry) pass ``count=False``: they keep
        the entry fresh but are not hits anyone asked for.
        """
        with self._lock:
            hits = self._access.get(key, (0.0, 0))[1]
            self._access[key] = (self._tables.clock(), hits + 1 if count else hits)
            if count:
                self._counters["hits"] += 1
        self._ensure_flusher()

    def count(self, counts: dict[str, int]) -> None:
        with self._lock:
            self._counters.update(counts)
        self._ensure_flusher()

    def _ensure_flusher(self) -> None:
        """Make sure this process runs a flusher thread (started lazily, again after fork)."""
        if not self._persist or self._started or self._closed.is_set() or not self._claim_flusher():
            return
        with self._lock:
            ref = weakref.ref(self)
            closed = self._closed
            interval = self.flush_interval

            def run() -> None:
                while not closed.wait(interval):
                    book = ref()
                    if book is None:
                        return
                    book.flush()
                    del book

            self._thread = threading.Thread(target=run, name="adstore-flush", daemon=True)
            self._thread.start()

    def _claim_flusher(self) -> bool:
        """Whether this caller starts the flusher (one caller does, under the lock)."""
        with self._lock:
            if self._started:
                return False
            self._started = True
            return True

    def flush(self) -> None:
        """Write pending counters and access times; bookkeeping never fails a cache operation."""
        if not self._persist:
            return  # a read-only store: they stay in memory (``pending``)
        with self._lock:
            counters, self._counters = self._counters, Counter()
            access, self._access = self._access, {}
        if not counters and not access:
            return

        def fn(t: Txn) -> None:
            for name, delta in counters.items():
                t.count(name, delta)
            for key, (when, hits) in access.items():
                if t.entry_row(key.encode()) is None:
                    continue  # evicted meanwhile
                recorded = t.access(key.encode())
                if recorded is not None:
                    when, hits = max(recorded[0], when), recorded[1] + hits
                t.put_access(key, when, hits)

        try:
            self._tables.write(fn)
        except Exception as exc:
            log.warning("could not flush store counters: %s", exc)

    def pending(self) -> dict[str, int]:
        """Counters counted and not written yet (a read-only store's, all of them)."""
        with self._lock:
            return dict(self._counters)

    def close(self, *, flush: bool = True) -> None:
        """Stop the flusher, then write what is pending (``flush=False``: drop it, the index is damaged).

        The flusher may be inside a write (waiting for another process's write
        lock, even): it is joined before the store closes its environment,
        which must never close under a transaction another thread is using.
        """
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if flush:
            self.flush()
        else:  # a write into a damaged index can fault; a rebuild loses hits and access times anyway
            with self._lock:
                self._counters, self._access = Counter(), {}
        _OPEN.discard(self)

    def _forget(self) -> None:
        # A forked child inherits the parent's unflushed counters; the parent
        # flushes those itself, so the child must not count them again.
        self._counters = Counter()
        self._access = {}
        self._lock = threading.Lock()
        self._started = False  # threads do not survive fork
        self._thread = None


def flush_root(root: Path) -> None:
    """Write what every store of this process opened at ``root`` has pending (``Store.stats``)."""
    for book in list(_OPEN):
        if book._tables.layout.root == root:
            book.flush()


def _flush_all() -> None:
    for book in list(_OPEN):
        try:
            book.flush()
        except Exception:  # exit path: never turn a clean exit into a traceback
            log.debug("flush at exit failed", exc_info=True)


def _forget_all() -> None:
    for book in list(_OPEN):
        book._forget()


atexit.register(_flush_all)
os.register_at_fork(after_in_child=_forget_all)
