"""One daemon per store: a lock file the daemon holds, and its status file.

The lock is an ``flock`` on ``<root>/daemon.lock``, held for the daemon's
whole life and released by the kernel when the process dies (even on
SIGKILL), so there is nothing stale to clean up.  The file is never replaced
(a rename would hand a fresh, unlocked inode to the next daemon); it only
records the holder's pid for the error message of a second daemon.

A store may be shared by a group (docs/configuration.md, "A store shared by several users"),
so the lock file is hostile ground: it is created with ``O_EXCL`` and opened
with ``O_NOFOLLOW`` (a symlink planted there is refused as ``unsafe_root``,
never followed to another user's file), checked to be a regular file with one
link, owned by us, the root's owner or the store's group, and written only
once the lock is held.  A new lock file gets the store's group-shared mode
whatever the creator's umask, so no member locks the others out.  Holding an
``flock`` needs no disk space; recording the pid may, so on a full disk the
pid is left out and the daemon still starts (docs/reliability.md, "What the suites do").

The status file ``<root>/daemon.status.json`` is published with the store's
atomic-write helper after every enforcement pass; ``adstore stats`` shows it
when its pid (and that process's start time) is still alive.  It is advisory:
nothing in the store depends on it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import psutil

from adstore.daemon.errors import AlreadyRunning
from adstore.store import Layout, UnsafeRoot, atomic_write, hostname, process_start_time

__all__ = ["InstanceLock", "LOCK_NAME", "STATUS_NAME", "open_regular", "write_status", "read_status"]

log = logging.getLogger(__name__)

LOCK_NAME = "daemon.lock"
STATUS_NAME = "daemon.status.json"
_STATUS_MAX = 1 << 20  # a status file is a few KiB; never read more than this


def _started(pid: int) -> float | None:
    """When the running process ``pid`` started, or None if it is gone."""
    try:
        return process_start_time(pid)
    except (psutil.Error, OSError):
        return None


def open_regular(path: Path, flags: int, *, root: Path) -> int:
    """Open ``path`` without following a symlink; refuse anything but a plain, singly linked file.

    ``O_NONBLOCK`` keeps a FIFO planted there from hanging the open; a
    symlink, a FIFO, a device or a hard link to someone else's file is
    :class:`UnsafeRoot` (reason ``unsafe_root``).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeRoot(str(root), f"{path} is a symbolic link; remove it") from None
        if exc.errno == errno.EISDIR:
            raise UnsafeRoot(str(root), f"{path} is not a regular file; remove it") from None
        raise
    try:
        _check_regular(fd, path, root)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(fd: int, path: Path, root: Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeRoot(str(root), f"{path} is not a regular file; remove it")
    if st.st_nlink != 1:
        raise UnsafeRoot(str(root), f"{path} has {st.st_nlink} hard links (it may be another file); remove it")
    try:
        owner = os.stat(root)
    except OSError:
        return
    if st.st_uid not in (os.geteuid(), owner.st_uid, 0) and not (
        owner.st_mode & stat.S_ISGID and st.st_gid == owner.st_gid
    ):
        raise UnsafeRoot(
            str(root), f"{path} belongs to uid {st.st_uid}, outside the store's owner and group; remove it"
        )


class InstanceLock:
    """An exclusive, non-blocking ``flock`` on ``<root>/daemon.lock``."""

    def __init__(self, path: Path, fd: int, *, writable: bool = True) -> None:
        self.path = path
        self._fd: int | None = fd
        self._writable = writable

    @classmethod
    def acquire(cls, root: Path) -> InstanceLock:
        """Take the lock or raise :class:`AlreadyRunning` naming the holder's pid.

        :class:`UnsafeRoot` if ``daemon.lock`` is a symlink or not a plain file.
        """
        root = Path(root)
        fd, writable = cls._open(root / LOCK_NAME, root)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                raw = os.pread(fd, 64, 0).decode(errors="replace").strip()
                pid: int | None = int(raw.split()[0]) if raw else None
            except (OSError, ValueError, IndexError):
                pid = None
            os.close(fd)
            raise AlreadyRunning(str(root / LOCK_NAME), pid) from None
        except BaseException:
            os.close(fd)
            raise
        if writable:
            _record_pid(fd, root / LOCK_NAME)
        log.debug("acquired %s", root / LOCK_NAME)
        return cls(root / LOCK_NAME, fd, writable=writable)

    @staticmethod
    def _open(path: Path, root: Path) -> tuple[int, bool]:
        """A descriptor on the lock file (created if missing) and whether we may write it."""
        mode = 0o664 if Layout(root).group_shared else 0o644
        for _ in range(8):  # a racing creator or remover: try again
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
            except FileExistsError:
                pass
            else:
                os.fchmod(fd, mode)  # the creator's umask must not lock the group out
                return fd, True
            try:
                return open_regular(path, os.O_RDWR, root=root), True
            except FileNotFoundError:
                continue
            except PermissionError:
                pass
            # Created by another member of a shared store's group without g+w:
            # flock works on a read-only descriptor too; we just cannot record our pid.
            try:
                return open_regular(path, os.O_RDONLY, root=root), False
            except FileNotFoundError:
                continue
        raise UnsafeRoot(str(root), f"{path} keeps appearing and disappearing")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock.  The pid stays in the file (a holder always overwrites it), so the
        file keeps its data block and the next start on a full disk needs no space."""
        if self._fd is None:
            return
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> InstanceLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _record_pid(fd: int, path: Path) -> None:
    """Write our pid over the old one; on a full disk (or any write error) leave the file empty."""
    data = f"{os.getpid()}\n".encode()
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    except OSError as exc:
        try:
            os.ftruncate(fd, 0)  # no stale pid for a second daemon's message; needs no space
        except OSError:
            pass
        log.warning(
            "cannot record the daemon's pid in %s (%s); the lock is held all the same", path, exc.strerror or exc
        )


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
    """The running daemon's status, or None if there is none (or it is not running).

    Read without following a symlink and only from a regular file, so a FIFO
    or a link planted in a shared root neither hangs nor leaks into ``stats``.
    """
    try:
        fd = open_regular(Path(root) / STATUS_NAME, os.O_RDONLY, root=Path(root))
    except (OSError, UnsafeRoot):
        return None
    try:
        raw = os.read(fd, _STATUS_MAX)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    pid, started = data.get("pid"), data.get("pid_start")
    if not isinstance(pid, int) or not isinstance(started, (int, float)):
        return None
    alive = _started(pid)
    # A one-shot pass (`adstore daemon --once`) leaves a status but no running daemon.
    data["running"] = not data.get("once") and alive is not None and abs(alive - float(started)) < 1.0
    return data
