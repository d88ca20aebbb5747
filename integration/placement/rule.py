"""The trust rule for files that become code: who may have written a file, and who else may write it.

One rule, at capture (before a file is stored) and at load (before a blob
is copied out to be loaded), always applied to ``fstat`` of the
``O_NOFOLLOW`` descriptor the bytes are read from, never to a path:

* a file is code-worthy when it is a regular file owned by a trusted uid
  (this user, root, ``ADSTORE_TRUSTED_UIDS``) that no untrusted user may
  write (:meth:`Writer.refusal`);
* a directory on the way to it is safe when a trusted uid owns it and no
  untrusted user may rename entries in it (:func:`dir_refusal`): not
  writable by others, or sticky like ``/tmp``;
* "no untrusted user may write" means no world write bit, and a group write
  bit only for a group no untrusted user belongs to (:func:`group_private`:
  Debian's and Ubuntu's user-private groups, under which umask 002 is safe).

An inline blob lives in the index, which records no writer: it is as
trustworthy as the index directory that holds it (:func:`blob_refusal`).
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adstore.store import trusted_uids  # the one parser of ADSTORE_TRUSTED_UIDS (the seed store judges by it too)

__all__ = ["Writer", "blob_refusal", "dir_refusal", "group_private", "trusted_uids"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@functools.lru_cache(maxsize=64)
def group_private(gid: int, trusted: frozenset[int]) -> bool:
    """Whether only trusted users belong to group ``gid`` (its listed members and the users whose primary group it is).

    A group the user database does not know has no member by name: only
    root could put a process into it.
    """
    try:
        names = grp.getgrgid(gid).gr_mem
    except KeyError:
        names = []
    for name in names:
        try:
            if pwd.getpwnam(name).pw_uid not in trusted:
                return False
        except KeyError:
            return False  # a member the user database cannot name: not known to be trusted
    return all(p.pw_uid in trusted for p in pwd.getpwall() if p.pw_gid == gid)


def _others_may_write(mode: int, gid: int, trusted: frozenset[int]) -> str | None:
    """Why a user outside ``trusted`` may write a file or directory of this mode and group (None: nobody may)."""
    if mode & stat.S_IWOTH:
        return f"writable by every user (mode {stat.filemode(mode)})"
    if mode & stat.S_IWGRP and not group_private(gid, trusted):
        return f"writable by group {gid}, which has untrusted members (mode {stat.filemode(mode)})"
    return None


@dataclass(frozen=True)
class Writer:
    """Who wrote a file and who else may write it, as ``fstat`` of the descriptor its bytes are read from.

    ``uid`` is None for a blob kept inline in the index, whose writer is unknown.
    """

    uid: int | None
    mode: int = 0
    gid: int = -1

    @classmethod
    def of(cls, st: os.stat_result | None) -> Writer:
        return cls(None) if st is None else cls(st.st_uid, st.st_mode, st.st_gid)

    def refusal(self, trusted: frozenset[int]) -> str | None:
        """Why bytes read from this file must not become code (None: they may); the one rule for files.

        A trusted owner is not enough: a file an untrusted user may write, or
        that is not a regular file, could hold anything.
        """
        if self.uid is None:
            return "it is stored inline, its writer cannot be verified"
        if not stat.S_ISREG(self.mode):
            return "not a regular file"
        if self.uid not in trusted:
            return f"owned by uid {self.uid}, not a trusted user (ADSTORE_TRUSTED_UIDS)"
        return _others_may_write(self.mode, self.gid, trusted)


def dir_refusal(st: os.stat_result, trusted: frozenset[int]) -> str | None:
    """Why entries of the directory ``st`` describes could be renamed by an untrusted user (None: they cannot).

    Accepted: owned by a trusted uid or root (who can replace anything
    anyway, so a caller that trusts no one else still walks ``/``), and
    either sticky (others may add entries, never rename or remove ours:
    ``/tmp``) or writable by no untrusted user.
    """
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid not in trusted and st.st_uid != 0:
        return f"owned by uid {st.st_uid}, not a trusted user (ADSTORE_TRUSTED_UIDS)"
    if st.st_mode & stat.S_ISVTX:
        return None
    return _others_may_write(st.st_mode, st.st_gid, trusted)


def blob_refusal(store: Any, writer: Writer, trusted: frozenset[int]) -> str | None:
    """Why a blob that ``writer`` wrote must not become code (None: it may).

    An inline blob (``writer.uid`` None) is as trustworthy as the index that
    holds it: trusted when a trusted user owns the index directory and no
    untrusted user can write it (a group-shared store's inline blobs are
    refused; umask 002 with a user-private group is fine).
    """
    if writer.uid is not None:
        return writer.refusal(trusted)
    try:
        fd = os.open(Path(store.root) / "index", _DIR_FLAGS)
    except OSError as exc:
        return f"inline blob, index directory not opened ({exc.strerror})"
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid not in trusted or _others_may_write(st.st_mode, st.st_gid, trusted) is not None:
        return "inline blob in an index other users can write: its writer is unknown"
    return None
