"""Files that become code, out of the store: the bytes loaded are the bytes checked.

A cache entry of Inductor's is code twice over: its value is a pickle that
Inductor unpickles, and its kernel files are shared objects it ``dlopen``s
(or sources and a precompiled header the compiler reads).  So they follow
the engine cache's rule (:mod:`adstore.integration.engine.codefiles`,
docs/engine-cache.md, "Trust"), through the store's one read path:

* a blob is copied out by ``Store.copy_blob_to``, which verifies its digest
  while it streams; its writer is judged from ``fstat`` of the descriptor the
  copy reads (owned by this user, root or ``ADSTORE_TRUSTED_UIDS``, a regular
  file no one else may write) before the first byte;
* an inline blob lives in the index, which records no writer: it is trusted
  only when the index directory is writable by its trusted owner alone (a
  group-shared store's inline blobs are refused);
* a copy goes into a directory only this user can write, and is linked under
  its final name without replacing anything, so nobody can swap the file
  before Inductor loads it.

A file whose final name exists already is left alone: Inductor names kernel
files by the hash of their source and flags, and that file is its own.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adstore.integration.engine.codefiles import Writer, private_path
from adstore.integration.errors import UnsafeCacheDir, UntrustedKernel

__all__ = ["read_trusted", "place", "refusal"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def read_trusted(store: Any, ref: Any, trusted: frozenset[int]) -> bytes:
    """The verified content of blob ``ref``, from a trusted writer only (:class:`UntrustedKernel` otherwise)."""
    tmp = private_path(".blob")  # a directory only this process's user can write
    try:
        store.copy_blob_to(ref, tmp, check=_judge(store, ref.digest, trusted))
        return tmp.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)


def place(store: Any, ref: Any, *, directory: Path, name: str, trusted: frozenset[int], mode: int = 0o644) -> bool:
    """Copy blob ``ref`` to ``directory/name``, verified, from a trusted writer; False when the file exists already.

    ``directory`` (created 0700 when missing) must be this user's and not
    group or world writable, as ``fstat`` of its ``O_NOFOLLOW`` descriptor
    says.  The copy is written under a temp name and linked (never replacing)
    under ``name`` only once the store's read path has verified every byte.
    """
    if "/" in name or name in ("", ".", ".."):
        raise UnsafeCacheDir(str(directory), f"not a plain file name: {name!r}")
    _check_private_dir(directory)
    target = directory / name
    if os.path.lexists(target):
        return False  # Inductor's own (or placed before): not ours to replace
    tmp = directory / f".adstore-{secrets.token_hex(8)}.tmp"
    try:
        store.copy_blob_to(ref, tmp, check=_judge(store, ref.digest, trusted))
        os.chmod(tmp, mode, follow_symlinks=False)
        try:
            os.link(tmp, target, follow_symlinks=False)
        except FileExistsError:
            return False  # another process placed it first
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _judge(store: Any, digest: str, trusted: frozenset[int]) -> Callable[[os.stat_result | None], None]:
    """The ``check`` of ``Store.copy_blob_to``: refuse, before the first byte, a blob no trusted user wrote."""

    def check(st: os.stat_result | None) -> None:
        why = refusal(store, Writer(None) if st is None else Writer(st.st_uid, st.st_mode), trusted)
        if why is not None:
            raise UntrustedKernel(digest, why)

    return check


def refusal(store: Any, writer: Writer, trusted: frozenset[int]) -> str | None:
    """Why code read from a blob that ``writer`` wrote must not be loaded (None: it may); the one rule here.

    An inline blob (``writer.uid`` None) is judged by the index that holds it.
    """
    return _inline_refusal(store, trusted) if writer.uid is None else writer.refusal(trusted)


def _inline_refusal(store: Any, trusted: frozenset[int]) -> str | None:
    """An inline blob is as trustworthy as the index that holds it: None when no other user can write it."""
    try:
        fd = os.open(Path(store.root) / "index", _DIR_FLAGS)
    except OSError as exc:
        return f"inline blob, index directory not opened ({exc.strerror})"
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid not in trusted or st.st_mode & 0o022 or st.st_mode & stat.S_ISGID:
        return "inline blob in an index other users can write: its writer is unknown"
    return None


def _check_private_dir(directory: Path) -> None:
    """``directory`` (made 0700 if missing) must be this user's alone, as its ``O_NOFOLLOW`` descriptor says."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        raise UnsafeCacheDir(str(directory), f"not opened as a directory without following links ({exc})") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UnsafeCacheDir(
            str(directory), f"owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o7777)}: others could swap files"
        )
