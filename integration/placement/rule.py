"""The trust rule as placement uses it: the store's one rule (``adstore.store``'s ``file_refusal``,
``dir_refusal``, ``group_private``, ``trusted_uids``), plus what only placement needs.

Placement judges ``fstat`` of the ``O_NOFOLLOW`` descriptor the bytes are
read from, never a path, at capture (before a file is stored) and at load
(before a blob is copied out to be loaded).  :class:`Writer` is that
``fstat``, or an inline blob's unknown writer: an inline blob lives in the
index, which records no writer, and is as trustworthy as the index
directory that holds it (:func:`blob_refusal`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adstore.store import dir_refusal, file_refusal, group_private, others_may_write, trusted_uids

__all__ = ["Writer", "blob_refusal", "dir_refusal", "group_private", "trusted_uids"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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
        return file_refusal(self, trusted)

    @property
    def st_uid(self) -> int:
        return -1 if self.uid is None else self.uid

    @property
    def st_mode(self) -> int:
        return self.mode

    @property
    def st_gid(self) -> int:
        return self.gid


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
    if st.st_uid not in trusted or others_may_write(st, trusted) is not None:
        return "inline blob in an index other users can write: its writer is unknown"
    return None
