"""A reserve of disk space so a full disk cannot lock the store (docs/operations.md, "Damage and repair").

Freeing space needs an LMDB commit, and a commit needs free pages on disk:
at 0 bytes free, ``adstore gc`` would fail exactly when it is needed.  So
every store keeps ``<root>/ballast``, a file of real (not sparse) blocks
sized for a few commits.  Eviction and sweeps run with
:func:`spending_allowed`; when one of their commits fails for lack of space,
the index releases the ballast (unlinks it) and retries the commit once.
The ballast is recreated afterwards, and at every open, whenever the
filesystem has room for it (four times its size free), never by filling
the last bytes.  It is created with ``O_EXCL | O_NOFOLLOW``: a symlink
planted in its place is never written through.
"""

from __future__ import annotations

import contextvars
import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["Ballast", "BALLAST_SIZE", "spending_allowed", "may_spend"]

log = logging.getLogger(__name__)

#: Enough for a few LMDB commits of an eviction batch (tens of pages each).
BALLAST_SIZE = 1 << 20
_CHUNK = 1 << 16
_MAY_SPEND: contextvars.ContextVar[bool] = contextvars.ContextVar("adstore_may_spend_ballast", default=False)


def may_spend() -> bool:
    """May a commit that failed for lack of space release the ballast (inside :func:`spending_allowed`)?"""
    return _MAY_SPEND.get()


class Ballast:
    """The ballast file of one store root."""

    __slots__ = ("path", "size")

    def __init__(self, root: Path, size: int = BALLAST_SIZE) -> None:
        self.path = root / "ballast"
        self.size = size

    def present(self) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.path).st_mode)
        except FileNotFoundError:
            return False

    def ensure(self) -> bool:
        """Create the ballast if it is missing and the disk has room; returns whether it is there."""
        if os.path.lexists(self.path):
            return self.present()
        try:
            if shutil.disk_usage(self.path.parent).free < 4 * self.size:
                return False
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:  # another process made it meanwhile
            return self.present()
        except OSError as exc:
            log.debug("cannot create the ballast %s: %s", self.path, exc)
            return False
        try:
            zeros = bytes(_CHUNK)
            for _ in range(self.size // _CHUNK):
                os.write(fd, zeros)  # real blocks: a sparse file would free nothing
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("cannot create the ballast %s: %s", self.path, exc)
            return False
        os.close(fd)
        return True

    def release(self) -> bool:
        """Unlink the ballast (a regular file only); returns whether space was freed."""
        if not self.present():
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        log.warning("disk full: released the store's ballast %s (%d bytes) to commit", self.path, self.size)
        return True


@contextmanager
def spending_allowed(ballast: Ballast | None) -> Iterator[None]:
    """Let the commits inside release the ballast; recreate it afterwards if space allows."""
    token = _MAY_SPEND.set(True)
    try:
        yield
    finally:
        _MAY_SPEND.reset(token)
        if ballast is not None:
            ballast.ensure()
