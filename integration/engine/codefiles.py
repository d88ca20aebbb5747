"""Files that become code: the bytes loaded are the bytes checked.

An AOTInductor package and the files Inductor wrote (shared objects, Python
modules, pickles) run as code when they are loaded.  In a group-shared
store ``blobs/xx/`` and ``tmp/`` are group-writable without the sticky bit,
so any member can rename files there: a check of a path (``os.stat``) and a
load of a path may see two different files, and a member who wins the race
runs code in another user's process.  So, for every such file:

* its writer is judged from ``fstat`` of the ``O_NOFOLLOW`` descriptor its
  verified copy is read from (:func:`copy_code`, through
  ``Store.copy_blob_to(check=...)``), never from a path;
* the copy goes into a directory only this user can write, made once per
  process under a parent no one else can rename entries in
  (:func:`private_dir`), and is loaded from there.

(docs/engine-cache.md, "Trust".)
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adstore.integration.errors import EngineCacheError
from adstore.store import trusted_uids  # trusted_uids: the store's seed copies by the same rule

__all__ = ["Writer", "check_private", "copy_code", "private_dir", "private_path", "trusted_uids"]


@dataclass(frozen=True)
class Writer:
    """Who wrote a blob file, as ``fstat`` of the descriptor its copy was read from.

    ``uid`` is None for a blob kept inline in the index, whose writer is unknown.
    """

    uid: int | None
    mode: int = 0

    def refusal(self, trusted: frozenset[int]) -> str | None:
        """Why code from this file must not be loaded (None: it may).

        A trusted owner is not enough: a file another member may write (group
        or world write bits) or that is not a regular file could hold anything.
        """
        if self.uid is None:
            return "it is stored inline, its writer cannot be verified"
        if not stat.S_ISREG(self.mode):
            return "its blob is not a regular file"
        if self.uid not in trusted:
            return f"its blob is owned by uid {self.uid}, not a trusted user (ADSTORE_TRUSTED_UIDS)"
        if self.mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"its blob is writable by others (mode {stat.filemode(self.mode)})"
        return None


def copy_code(store: Any, ref: Any, dest: Path) -> Writer:
    """Copy blob ``ref`` of ``store`` to ``dest`` (in :func:`private_dir`), verified; who wrote the file read.

    The writer comes from the descriptor the copy streams from, so it
    describes exactly the bytes at ``dest``; the caller judges it
    (:meth:`Writer.refusal`) before anything loads ``dest``.
    """
    seen: list[Writer] = []

    def check(st: os.stat_result | None) -> None:
        seen.append(Writer(None) if st is None else Writer(st.st_uid, st.st_mode))

    store.copy_blob_to(ref, dest, check=check)
    return seen[0]


def check_private(path: Path) -> Path:
    """``path`` if it is a directory only this user can write, under parents no one else can rename in.

    Every parent must belong to root or this user and be writable by no one
    else, or carry the sticky bit (``/tmp``): otherwise another user could
    move the directory aside and put their own in its place.  Raises
    :class:`EngineCacheError` otherwise.
    """
    real = Path(os.path.realpath(path))
    me = os.geteuid()
    st = os.lstat(real)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != me or st.st_mode & 0o077:
        raise EngineCacheError(f"{real} is not a directory private to uid {me} (mode {stat.filemode(st.st_mode)})")
    for parent in real.parents:
        pst = os.lstat(parent)
        shared = pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pst.st_mode & stat.S_ISVTX
        if pst.st_uid not in (0, me) or shared:
            raise EngineCacheError(
                f"{real} is under {parent} (uid {pst.st_uid}, mode {stat.filemode(pst.st_mode)}), "
                "where another user could rename it: not a place for code"
            )
    return real


_lock = threading.Lock()
_dirs: dict[int, Path] = {}


def private_dir() -> Path:
    """This process's directory for files that become code (0700, in the system temp directory).

    Made once per process (a forked child makes its own) and removed at exit.
    """
    pid = os.getpid()
    with _lock:
        made = _dirs.get(pid)
        if made is None or not made.is_dir():
            made = check_private(Path(tempfile.mkdtemp(prefix=f"adstore-code-{pid}-")))
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
