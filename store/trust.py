"""The one trust rule: who may have written a file or a row, and who else may write it.

Everything that decides whether bytes on disk can vouch for anything calls
this module: the seal (a record file vouches for its index rows), a seed
store (its records, before a row is copied), placement (files that become
code, and the directories on the way to them) and the torch key record.
One trusted set (:func:`trusted_uids`: this user, root, ``ADSTORE_TRUSTED_UIDS``)
and three questions, always asked of ``fstat`` of the descriptor the bytes
are read from, never of a path looked at earlier:

* :func:`file_refusal`: a regular file, owned by a trusted uid, that no
  untrusted user may write;
* :func:`dir_refusal`: a directory owned by a trusted uid or root, in which no
  untrusted user may rename entries: writable by no untrusted user, or sticky
  like ``/tmp``;
* "no untrusted user may write" (:func:`others_may_write`): no world write
  bit, and a group write bit only for a group *known* to hold no untrusted
  user (:func:`group_private`).  A group the group database does not know is
  not known to be private: container runtimes hand such gids to processes of
  other uids (Kubernetes ``fsGroup``, ``docker --group-add``).

(docs/architecture.md, "Files that become code".)
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import stat
from collections.abc import Iterable, Mapping
from typing import Protocol

from .errors import ConfigError
from .units import parse_count

__all__ = ["StatLike", "trusted_uids", "group_private", "others_may_write", "file_refusal", "dir_refusal"]


class StatLike(Protocol):
    """What the rule reads of ``fstat``: the file type and mode, the owner and the group."""

    @property
    def st_mode(self) -> int: ...

    @property
    def st_uid(self) -> int: ...

    @property
    def st_gid(self) -> int: ...


def trusted_uids(environ: Mapping[str, str] | None = None, extra: Iterable[int] = ()) -> frozenset[int]:
    """Who may have written what this process trusts: this user, root, ``extra`` and ``ADSTORE_TRUSTED_UIDS``
    (comma-separated).  :class:`ConfigError` for a value that is not a list of user ids."""
    env = os.environ if environ is None else environ
    raw = env.get("ADSTORE_TRUSTED_UIDS", "")
    try:
        uids = {parse_count(u, field="ADSTORE_TRUSTED_UIDS") for u in raw.replace(" ", "").split(",") if u}
        uids |= {int(u) for u in extra}
    except (ValueError, TypeError) as exc:
        raise ConfigError("ADSTORE_TRUSTED_UIDS", f"expected comma-separated user ids, got {raw!r}") from exc
    return frozenset({os.geteuid(), 0} | uids)


@functools.lru_cache(maxsize=64)
def group_private(gid: int, trusted: frozenset[int]) -> bool:
    """Whether group ``gid`` is known to hold only trusted users: its listed members and the users whose
    primary group it is (Debian's and Ubuntu's user-private groups, under which umask 002 is safe).

    A gid the group database does not know is not private: nothing says who holds it, and container
    runtimes give such gids to other users' processes.  A member the user database cannot name is not
    known to be trusted either.
    """
    try:
        names = grp.getgrgid(gid).gr_mem
    except KeyError:
        return False
    for name in names:
        try:
            if pwd.getpwnam(name).pw_uid not in trusted:
                return False
        except KeyError:
            return False
    return all(p.pw_uid in trusted for p in pwd.getpwall() if p.pw_gid == gid)


def others_may_write(st: StatLike, trusted: frozenset[int]) -> str | None:
    """Why a user outside ``trusted`` may write the file or directory ``st`` describes (None: nobody may)."""
    if st.st_mode & stat.S_IWOTH:
        return f"writable by every user (mode {stat.filemode(st.st_mode)})"
    if st.st_mode & stat.S_IWGRP and not group_private(st.st_gid, trusted):
        return f"writable by group {st.st_gid}, not known to hold only trusted users (mode {stat.filemode(st.st_mode)})"
    return None


def file_refusal(st: StatLike, trusted: frozenset[int]) -> str | None:
    """Why bytes read from the file ``st`` describes cannot vouch for anything (None: they can).

    A trusted owner is not enough: a file an untrusted user may write, or that is not a regular file,
    could hold anything.
    """
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid not in trusted:
        return f"owned by uid {st.st_uid}, not a trusted user (ADSTORE_TRUSTED_UIDS)"
    return others_may_write(st, trusted)


def dir_refusal(st: StatLike, trusted: frozenset[int]) -> str | None:
    """Why entries of the directory ``st`` describes could be renamed by an untrusted user (None: they cannot).

    Owned by a trusted uid or root (who can replace anything anyway, so a caller that trusts no one else
    still walks ``/``), and either sticky (others may add entries, never rename or remove ours: ``/tmp``) or
    writable by no untrusted user.
    """
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid not in trusted and st.st_uid != 0:
        return f"owned by uid {st.st_uid}, not a trusted user (ADSTORE_TRUSTED_UIDS)"
    if st.st_mode & stat.S_ISVTX:
        return None
    return others_may_write(st, trusted)
