"""The eviction daemon: events in, budget enforced, systemd kept informed.

Shape: one main thread runs a loop that sleeps in ``select`` on a socket pair
until the next deadline (watchdog ping, debounced filesystem event, fallback
timer, sweep timer) or a signal.  A watchdog (inotify) observer thread only
records that something was written under ``blobs/`` or ``index/`` and wakes
the loop with one byte (signals wake it through ``signal.set_wakeup_fd``, so
no handler ever takes a lock); all store work happens on the main thread, one pass at a time.
Idle, nothing runs: the inotify thread blocks in ``poll``, the loop sleeps
until the fallback timer or the next systemd watchdog ping.

Signals only set flags: SIGHUP reloads the configuration (an invalid file is
logged and the old settings stay), SIGTERM/SIGINT stop the loop after the
current eviction batch and the daemon exits 0.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from adstore.daemon.config import DaemonConfig
from adstore.daemon.enforce import Enforcer, PassResult
from adstore.daemon.lock import InstanceLock, write_status
from adstore.daemon.metrics import store_metrics, write_metrics
from adstore.daemon.notify import Notifier, watchdog_interval
from adstore.store import AdstoreError, ConfigError, Store

__all__ = ["Daemon", "configure_logging"]

log = logging.getLogger(__name__)

_WATCHED_EVENTS: list[type[FileSystemEvent]] = [FileCreatedEvent, FileModifiedEvent, FileMovedEvent, FileClosedEvent]
# A blocked store (over budget, nothing evictable) is re-swept at most this often.
_STUCK_SWEEP_INTERVAL = 60.0


def configure_logging(level: str, environ: Mapping[str, str] | None = None) -> None:
    """Log to stderr; under journald (``$JOURNAL_STREAM``) without our own timestamps."""
    env = os.environ if environ is None else environ
    fmt = (
        "%(levelname)s %(name)s: %(message)s"
        if env.get("JOURNAL_STREAM")
        else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(fmt))
        root.addHandler(handler)
    root.setLevel(level.upper())


class _Poke(FileSystemEventHandler):
    """Observer-thread side: note the event time and wake the main loop."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._daemon.poke()


class Daemon:
    """Keeps one store within the budget of a :class:`DaemonConfig`.

    ``run()`` blocks until SIGTERM/SIGINT (or :meth:`stop`) and returns the
    exit code.  ``once=True`` runs a single pass with a sweep and returns.
    """

    def __init__(
        self, config: DaemonConfig, *, notifier: Notifier | None = None, environ: Mapping[str, str] | None = None
    ) -> None:
        self.config = config
        self._env = dict(os.environ if environ is None else environ)
        self.notifier = notifier if notifier is not None else Notifier.from_env(self._env)
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._wsock.setblocking(False)
        self._mutex = threading.Lock()
        self._first_event: float | None = None
        self._last_event: float | None = None
        self._stop = False
        self._reload = False
        self._store: Store | None = None
        self._lock: InstanceLock | None = None
        self._observer: Any = None
        self._watchdog_every = watchdog_interval(self._env)
        self._next_watchdog = float("inf")
        self._last: PassResult | None = None
        self._last_eviction: PassResult | None = None
        self._status_written = -float("inf")
        self._budget_pending = False
        self._passes = 0
        self._started = time.time()

    # ------------------------------------------------------------ thread-safe entry points
    def poke(self) -> None:
        """Something was written to the store (called from the observer thread)."""
        now = time.monotonic()
        with self._mutex:
            if self._first_event is None:
                self._first_event = now
            self._last_event = now
        self._wakeup()

    def _wakeup(self) -> None:
        try:
            self._wsock.send(b"\0")
        except OSError:  # buffer full: a wake-up is already pending
            pass

    def _sleep(self, timeout: float) -> None:
        select.select([self._rsock], [], [], timeout)
        try:
            while self._rsock.recv(4096):
                pass
        except OSError:
            pass

    def stop(self) -> None:
        self._stop = True
        self._wakeup()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self._reload = True
        else:
            self._stop = True

    # ------------------------------------------------------------ lifecycle
    def _open(self) -> None:
        self._store = Store.open(self.config.root, grace_period=self.config.grace_period)
        try:
            self._lock = InstanceLock.acquire(self._store.root)
        except BaseException:
            self._store.close()
            self._store = None
            raise
        self._persist_budget()

    def _persist_budget(self) -> None:
        """Writers' inline eviction and `adstore stats` read the budget from the index.

        On a full disk the write may fail: the daemon starts (and evicts) all
        the same and tries again after its next pass.
        """
        assert self._store is not None
        try:
            self._store.set_budget(self.config.store_budget())
        except AdstoreError as exc:
            log.warning("cannot record the budget in the index yet (%s); retrying after the next pass", exc)
            self._budget_pending = True
        else:
            self._budget_pending = False

    def _publish_metrics(self) -> None:
        """Write the metrics file, if one is configured (never fatal: see :func:`write_metrics`)."""
        if self.config.metrics_path is None or self._store is None:
            return
        try:
            text = store_metrics(self._store, self.config.store_budget())
        except Exception as exc:  # a damaged index must not stop enforcement
            log.warning("cannot collect metrics: %s", exc)
            return
        write_metrics(self.config.metrics_path, text)

    def _start_observer(self) -> None:
        assert self._store is not None
        if not self.config.watch:
            log.info("filesystem events disabled (watch = false): checking every %ss", self.config.fallback_interval)
            return
        observer = Observer(timeout=30)
        handler = _Poke(self)
        watched = 0
        for sub in ("blobs", "index"):
            path = self._store.root / sub
            if not path.is_dir():
                continue
            try:
                observer.schedule(handler, str(path), recursive=True, event_filter=_WATCHED_EVENTS)
                watched += 1
            except OSError as exc:  # e.g. inotify watch limit: the fallback timer still runs
                log.warning(
                    "cannot watch %s (%s); relying on the %ss fallback timer", path, exc, self.config.fallback_interval
                )
        if watched:
            observer.daemon = True
            try:
                observer.start()
            except OSError as exc:  # inotify instance/watch limits hit when the emitters start
                log.warning(
                    "cannot start the inotify observer (%s); relying on the %ss fallback timer",
                    exc,
                    self.config.fallback_interval,
                )
                return
            self._observer = observer

    def _stop_observer(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None

    def _enforcer(self) -> Enforcer:
        assert self._store is not None
        return Enforcer(self._store, self.config, should_stop=lambda: self._stop, on_batch=self._maybe_ping)

    def _maybe_ping(self) -> None:
        if time.monotonic() >= self._next_watchdog:
            self.notifier.watchdog()
            self._next_watchdog = time.monotonic() + (self._watchdog_every or float("inf"))

    def _apply_reload(self) -> None:
        self._reload = False
        self.notifier.reloading()
        try:
            new = self.config.reload()
        except (ConfigError, OSError) as exc:
            log.error("reload failed, keeping the current configuration: %s", exc)
            self.notifier.ready(status=f"reload failed: {exc}")
            return
        if new.root != self.config.root:
            log.warning(
                "store root changed from %s to %s: a restart is needed; root unchanged", self.config.root, new.root
            )
            new = dataclasses.replace(new, root=self.config.root)
        configure_logging(new.log_level, self._env)
        assert self._store is not None
        if new.grace_period != self._store.grace_period:  # the store's plans take it at open
            root = self._store.root
            self._store.close()
            self._store = Store.open(root, grace_period=new.grace_period)
        self.config = new
        self._persist_budget()
        log.info("configuration reloaded from %s", new.source)
        self.notifier.ready(status="configuration reloaded")
        self.poke()  # re-check the budget under the new limits now

    def _status_text(self, result: PassResult) -> str:
        """``size … / budget …; last eviction …`` for systemd's STATUS= and the logs."""
        from adstore.daemon.format import human_age, human_size

        text = result.after.describe()
        last = self._last_eviction
        if last is not None:
            text += (
                f"; last eviction {human_age(last.finished)}: "
                f"{last.evicted_entries + last.aged_entries} entries, {human_size(last.bytes_freed)}"
            )
        if result.blocked:
            text += "; BLOCKED: remaining entries are leased, pinned or too young"
        return text

    def _publish_status(self, result: PassResult, *, once: bool = False) -> None:
        """STATUS= every pass; the status file when something happened or every 30 s."""
        assert self._store is not None
        acted = bool(result.evicted_entries or result.aged_entries or result.swept_items or result.blocked)
        if result.evicted_entries or result.aged_entries:
            self._last_eviction = result
        self.notifier.status(self._status_text(result))
        if self._budget_pending:
            self._persist_budget()
        self._publish_metrics()
        if not (acted or once or time.monotonic() - self._status_written >= 30.0):
            return
        self._status_written = time.monotonic()
        write_status(
            self._store.root,
            {
                "started": self._started,
                "updated": time.time(),
                "passes": self._passes,
                "once": once,
                "config": self.config.describe(),
                "size": result.after.size,
                "budget": result.after.limit,
                "high": result.after.high,
                "low": result.after.low,
                "last_pass": result.to_dict(),
                "last_eviction": self._last_eviction.to_dict() if self._last_eviction else None,
            },
        )

    def run(self, *, once: bool = False) -> int:
        configure_logging(self.config.log_level, self._env)
        if not once and not self.config.has_budget and self.config.max_age is None:
            raise ConfigError("max_size", "no budget to enforce: set max_size, min_free or max_age")
        self._open()
        assert self._store is not None
        previous: dict[int, Any] = {}
        previous_wakeup_fd: int | None = None
        try:
            if once:
                result = self._enforcer().run_pass(sweep=True)
                self._passes += 1
                self._publish_status(result, once=True)
                log.info("%s", self._status_text(result))
                return 0
            # `kill -USR1 <pid>` dumps every thread's stack to the journal (diagnosing hangs).
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            # Signals (main thread only) wake the select() through this socket.
            previous_wakeup_fd = signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                previous[sig] = signal.signal(sig, self._on_signal)
            self._start_observer()
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if previous_wakeup_fd is not None:
                signal.set_wakeup_fd(previous_wakeup_fd)
            self._stop_observer()
            self._store.close()
            self._rsock.close()
            self._wsock.close()
            if self._lock is not None:
                self._lock.release()

    def _loop(self) -> int:
        assert self._store is not None
        now = time.monotonic()
        if self._watchdog_every:
            self._next_watchdog = now + self._watchdog_every
        budget = self._enforcer().measure()
        self.notifier.ready(status=budget.describe())
        log.info("adstore daemon %d managing %s: %s", os.getpid(), self._store.root, budget.describe())
        next_fallback = now  # first pass (with a sweep) right away
        next_sweep = now
        last_stuck_sweep = -float("inf")
        while not self._stop:
            now = time.monotonic()
            with self._mutex:
                first, last = self._first_event, self._last_event
            event_due = None if first is None else min(last + self.config.debounce, first + self.config.max_delay)
            deadline = min(next_fallback, self._next_watchdog, event_due if event_due is not None else float("inf"))
            if deadline > now:
                self._sleep(min(deadline - now, 3600.0))
            if self._stop:
                break
            if self._reload:
                self._apply_reload()
                continue
            now = time.monotonic()
            self._maybe_ping()
            due_event = event_due is not None and now >= event_due
            if not (due_event or now >= next_fallback):
                continue
            with self._mutex:
                self._first_event = self._last_event = None
            sweep = now >= next_sweep
            stuck_ok = now - last_stuck_sweep >= _STUCK_SWEEP_INTERVAL
            try:
                result = self._enforcer().run_pass(sweep=sweep, sweep_if_stuck=stuck_ok)
            except Exception as exc:
                # Fail open: a damaged record (or a bug) must not stop budget
                # enforcement for good; the next pass retries, verify --fix repairs.
                if isinstance(exc, AdstoreError):
                    log.error("enforcement pass failed: %s", exc)
                else:
                    log.exception("enforcement pass failed unexpectedly")
                self.notifier.status(f"last pass failed: {exc}")
                next_fallback = time.monotonic() + self.config.fallback_interval
                continue
            self._passes += 1
            if result.swept:
                if sweep:
                    next_sweep = time.monotonic() + self.config.sweep_interval
                else:
                    last_stuck_sweep = time.monotonic()
            next_fallback = time.monotonic() + self.config.fallback_interval
            self._last = result
            self._publish_status(result)
        log.info("stopping (signal received); current batch finished")
        self.notifier.stopping(status="stopping")
        return 0
