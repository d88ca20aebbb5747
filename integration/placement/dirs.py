"""Directories that hold code: reached by descriptor, judged on the way, tightened when they are this user's.

:func:`open_dir` walks a path from ``/`` one component at a time, each
opened ``O_NOFOLLOW`` relative to the descriptor of the one before, and
judges every directory by ``fstat`` of its descriptor before it trusts an
entry in it (:func:`~adstore.integration.placement.rule.dir_refusal`).  No
path is looked at twice, so nothing renamed in between passes for what was
judged.  A symlink anywhere on the way is refused: the files would land
(or come from) somewhere else.

The directory at the end is tightened when this user owns it and its group
or others may write it (umask 002 makes torch's and vLLM's directories
0775): ``fchmod`` of its descriptor drops those bits instead of refusing it.

:func:`private_dir` is this process's own 0700 directory for copies that
are loaded (named ``adstore-code-<pid>-*``, so a sweep can tell a dead
process's from a live one's).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

from adstore.integration.errors import UnsafeCacheDir
from adstore.integration.placement.rule import dir_refusal, trusted_uids

__all__ = ["CODE_DIR_PREFIX", "open_dir", "checked_dir", "private_dir", "private_path", "temp_name"]

logger = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: The private code directories' prefix: ``adstore-code-<pid>-`` (the sweep's pattern, store/deadtemps.py).
CODE_DIR_PREFIX = "adstore-code-"


def temp_name(suffix: str = ".tmp") -> str:
    """A unique temporary name that carries this process's id: ``.adstore-<pid>-<random><suffix>``."""
    import secrets

    return f".adstore-{os.getpid()}-{secrets.token_hex(8)}{suffix}"


def open_dir(path: str | os.PathLike[str], trusted: frozenset[int], *, create: bool = False, own: bool = True) -> int:
    """A descriptor of the directory ``path``, every directory from ``/`` to it judged; the caller closes it.

    ``create``: missing components are made (0700).  ``own``: the directory
    must be this user's (where files are placed); else any directory no
    untrusted user can rename in (where files are captured from).  A
    directory of this user's that its group or others may write is
    tightened first.  Raises :class:`UnsafeCacheDir` naming the directory
    and why.
    """
    absolute = Path(os.path.abspath(path))
    walked = Path("/")
    fd = os.open("/", _DIR_FLAGS)
    try:
        for name in absolute.parts[1:]:
            why = dir_refusal(os.fstat(fd), trusted)
            if why is not None:
                raise UnsafeCacheDir(str(walked), f"{why}: another user could rename what is under it")
            walked = walked / name
            child = _step(fd, name, walked, create=create)
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid == me and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)  # umask 002: tightened, not refused
            logger.debug("adstore: tightened %s (was mode %s)", walked, stat.filemode(st.st_mode))
            st = os.fstat(fd)
        if own and st.st_uid != me:
            raise UnsafeCacheDir(str(walked), f"owned by uid {st.st_uid}, not by this user ({me})")
        why = dir_refusal(st, trusted)
        if why is not None:
            raise UnsafeCacheDir(str(walked), why)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _step(fd: int, name: str, walked: Path, *, create: bool) -> int:
    """The descriptor of ``name`` in the directory ``fd``, made 0700 when missing and ``create``."""
    try:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise UnsafeCacheDir(str(walked), "no such directory") from None
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: a file
        raise UnsafeCacheDir(str(walked), f"a symlink or not a directory ({exc.strerror})") from None


def checked_dir(path: str | os.PathLike[str], *, create: bool = False) -> Path:
    """``path`` if it is (after tightening) a directory only this user can write, under safe parents."""
    os.close(open_dir(path, trusted_uids({}), create=create, own=True))
    return Path(os.path.abspath(path))


_lock = threading.Lock()
_dirs: dict[int, Path] = {}


def private_dir() -> Path:
    """This process's directory for files that become code (0700, in the system temp directory).

    Made once per process (a forked child makes its own) and removed at exit;
    a killed process's is swept (``adstore gc``, ``enable()``).
    """
    pid = os.getpid()
    with _lock:
        made = _dirs.get(pid)
        if made is None or not made.is_dir():
            made = checked_dir(tempfile.mkdtemp(prefix=f"{CODE_DIR_PREFIX}{pid}-"))
            _dirs[pid] = made
            atexit.register(_remove, pid, made)
        return made


def _remove(pid: int, path: Path) -> None:
    if os.getpid() == pid:  # never a parent's directory from a forked child
        shutil.rmtree(path, ignore_errors=True)


def private_path(suffix: str) -> Path:
    """A new, unique file name in :func:`private_dir` (nothing is created there yet)."""
    fd, name = tempfile.mkstemp(suffix=suffix, dir=private_dir())
    os.close(fd)
    os.unlink(name)
    return Path(name)
