"""The background uploader: pushes run behind the pipeline, never in its way.

A save commits locally and hands the upload (blobs the remote lacks, then
the signed record) to one worker thread through a bounded queue.  A full
queue drops the job (counted, logged) instead of blocking a pipeline; a
failed upload is counted and logged, never raised; :meth:`flush` waits a
bounded time at exit, by default from an ``atexit`` hook (docs/remote.md, "Failure
costs").
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .client import Remote
from .outcomes import Outcome
from .transfer import BlobSource

__all__ = ["BackgroundUploader", "DEFAULT_QUEUE", "DEFAULT_EXIT_FLUSH"]

log = logging.getLogger(__name__)

DEFAULT_QUEUE = 64
#: Seconds the exit hook waits for queued uploads before the process ends anyway.
DEFAULT_EXIT_FLUSH = 30.0

Job = Callable[[], Outcome[Any]]
_STOP = object()


class BackgroundUploader:
    """One daemon thread running upload jobs from a bounded queue; counters on the Remote."""

    def __init__(
        self, remote: Remote, *, max_queue: int = DEFAULT_QUEUE, exit_flush: float | None = DEFAULT_EXIT_FLUSH
    ) -> None:
        self.remote = remote
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._cond = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        if exit_flush is not None:
            ref = weakref.ref(self)
            atexit.register(lambda: (u := ref()) is not None and u.close(exit_flush))

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return self._pending

    def submit(self, job: Job, *, label: str = "upload") -> bool:
        """Queue ``job``; False (counted ``uploads.dropped``) when the queue is full or closed."""
        with self._cond:
            if self._closed:
                accepted = False
            else:
                try:
                    self._queue.put_nowait((job, label))
                    self._pending += 1
                    accepted = True
                except queue.Full:
                    accepted = False
            if accepted and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="adstore-remote-upload", daemon=True)
                self._thread.start()
        if not accepted:
            self.remote.count("uploads.dropped")
            log.warning("remote upload of %s dropped: the upload queue is full or closed", label)
        else:
            self.remote.count("uploads.queued")
        return accepted

    def publish(
        self, key: str, rank: int, payload: Mapping[str, Any], refs: Iterable[tuple[str, int]], *, source: BlobSource
    ) -> bool:
        """Queue :meth:`Remote.publish` of one rank's entry (blobs, then the record)."""
        refs = list(refs)
        return self.submit(
            lambda: self.remote.publish(key, rank, payload, refs, source=source), label=f"{key} rank {rank}"
        )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, label = item
            try:
                out = job()
                if out.ok:
                    self.remote.count("uploads.done")
                else:
                    self.remote.count("uploads.failed")
                    log.warning("remote upload of %s failed: %s (%s)", label, out.reason, out.error)
            except Exception:
                self.remote.count("uploads.failed")
                log.exception("remote upload of %s failed", label)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every queued job; True if none is left."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = DEFAULT_EXIT_FLUSH) -> bool:
        """Flush, then stop the thread; later submits are dropped.  True if everything went."""
        drained = self.flush(timeout)
        with self._cond:
            self._closed = True
            thread = self._thread
        if thread is not None and drained:
            self._queue.put(_STOP)
            thread.join(timeout)
        if not drained:
            log.warning("remote uploads: %d still pending after %.1fs; abandoned", self.pending, timeout)
        return drained
