"""The kill-point machinery of the SIGKILL tests: count a forked child's I/O steps, die at one.

A child process installs a ``Trap`` that wraps every file-system call the
store makes (``os.open/write/fsync/chmod/replace/rename/unlink/mkdir``) and
both sides of every LMDB write-transaction commit with a counter, and
SIGKILLs itself at tick ``kill_at``.  Each tick is reported through a pipe
before it runs, so the parent knows exactly where the child died: kill
points are deterministic, not timing luck.  Shared by the drivers of
``test_kill_points.py`` (save, commit, remove, sweep) and
``test_eviction_kill_points.py`` (the daemon's eviction pass).
"""

from __future__ import annotations

import os
import signal

__all__ = ["Trap", "kill_point", "verify_failures", "wait_for_trap"]


_TRAPPED_OS = ("open", "write", "fsync", "chmod", "replace", "rename", "unlink", "mkdir")


def wait_for_trap(pid: int, r_fd: int) -> tuple[int, list[str]]:
    """Read a trapped child's step trace until it exits (or is killed); returns (status, lines)."""
    chunks = []
    while chunk := os.read(r_fd, 65536):
        chunks.append(chunk)
    os.close(r_fd)
    _, status = os.waitpid(pid, 0)
    return status, b"".join(chunks).decode().splitlines()


class Trap:
    """Counts I/O steps in a forked child; SIGKILLs the process at step ``kill_at``."""

    def __init__(self, kill_at: int, report_fd: int) -> None:
        self.kill_at = kill_at
        self.n = 0
        self.fd = report_fd
        self.real_write = os.write

    def note(self, label: str) -> None:
        self.real_write(self.fd, (label + "\n").encode())

    def tick(self, label: str) -> None:
        self.note(f"{self.n}:{label}")
        if self.n == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.n += 1

    def install(self) -> None:
        from adstore.store.index.env import Index

        for name in _TRAPPED_OS:
            real = getattr(os, name)

            def wrapper(*args, __real=real, __name=name, **kwargs):
                self.tick(f"os.{__name}")
                return __real(*args, **kwargs)

            setattr(os, name, wrapper)
        real_txn = Index.write

        def write(index, fn):
            def inner(txn):
                result = fn(txn)
                self.tick("txn.before_commit")  # killed holding LMDB's writer lock
                return result

            result = real_txn(index, inner)
            self.tick("txn.after_commit")
            return result

        Index.write = write  # type: ignore[method-assign]


def kill_point(k: int, trace: list[str]) -> str:
    """How a driver's failure lines name a kill point: ``k`` and the last line the child reported."""
    return f"k={k} ({trace[-1] if trace else 'before start'})"


def verify_failures(store, where: str) -> list[str]:
    """The first check after every kill: ``verify()`` problems as failure lines (none for a sound store)."""
    rep = store.verify()
    return [] if rep.ok else [f"{where}: verify problems {rep.problems[:3]}"]
