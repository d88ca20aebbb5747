"""One daemon per store: a lock file the daemon holds, and its status file.

The lock is an ``flock`` on ``<root>/daemon.lock``, held for the daemon's
whole life and released by the kernel when the process dies (even on
SIGKILL), so there is nothing stale to clean up.  The file is never replaced
(a rename would hand a fresh, unlocked inode to the next daemon); it only
records the holder's pid for the error message of a second daemon.

The status file ``<root>/daemon.status.json`` is published with the store's
atomic-write helper after every enforcement pass; ``adstore stats`` shows it
when its pid (and that process's start time) is still alive.  It is advisory:
nothing in the store depends on it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

import psutil

from adstore.daemon.errors import AlreadyRunning
from adstore.store.fsutil import atomic_write
from adstore.store.leases import hostname, process_start_time

__all__ = ["InstanceLock", "LOCK_NAME", "STATUS_NAME", "write_status", "read_status"]

log = logging.getLogger(__name__)

LOCK_NAME = "daemon.lock"
STATUS_NAME = "daemon.status.json"


def _started(pid: int) -> float | None:
    """When the running process ``pid`` started, or None if it is gone."""
    try:
        return process_start_time(pid)
    except (psutil.Error, OSError):
        return None


class InstanceLock:
    """An exclusive, non-blocking ``flock`` on ``<root>/daemon.lock``."""

    def __init__(self, path: Path, fd: int, *, writable: bool = True) -> None:
        self.path = path
        self._fd: int | None = fd
        self._writable = writable

    @classmethod
    def acquire(cls, root: Path) -> InstanceLock:
        """Take the lock or raise :class:`AlreadyRunning` naming the holder's pid."""
        path = Path(root) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o664)
            writable = True
        except PermissionError:
            # Created by another member of a shared store's group without g+w:
            # flock works on a read-only descriptor too; we just cannot record our pid.
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            writable = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                raw = os.pread(fd, 64, 0).decode(errors="replace").strip()
                pid: int | None = int(raw.split()[0]) if raw else None
            except (OSError, ValueError, IndexError):
                pid = None
            os.close(fd)
            raise AlreadyRunning(str(path), pid) from None
        except BaseException:
            os.close(fd)
            raise
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        log.debug("acquired %s", path)
        return cls(path, fd, writable=writable)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        if self._writable:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> InstanceLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def write_status(root: Path, status: dict[str, Any]) -> None:
    """Publish the daemon's status atomically; failures are logged, never fatal.

    The writer's identity (pid, its start time, host) is added here, where
    :func:`read_status` checks it.
    """
    status = {**status, "pid": os.getpid(), "pid_start": process_start_time(), "host": hostname()}
    try:
        atomic_write(Path(root) / STATUS_NAME, json.dumps(status, sort_keys=True, default=str).encode())
    except Exception as exc:  # advisory file: a full disk must not stop eviction
        log.warning("cannot write daemon status: %s", exc)


def read_status(root: Path) -> dict[str, Any] | None:
    """The running daemon's status, or None if there is none (or it is not running)."""
    try:
        data = json.loads((Path(root) / STATUS_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid, started = data.get("pid"), data.get("pid_start")
    if not isinstance(pid, int) or not isinstance(started, (int, float)):
        return None
    alive = _started(pid)
    # A one-shot pass (`adstore daemon --once`) leaves a status but no running daemon.
    data["running"] = (not data.get("once") and alive is not None and abs(alive - float(started)) < 1.0)
    return data
