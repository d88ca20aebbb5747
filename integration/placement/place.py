"""Blobs out of the store as code: the bytes loaded are the bytes checked.

Every blob that becomes code (an engine package, an Inductor kernel or
pickle, a precompiled header, a file of a vLLM tree) leaves the store here,
through ``Store.copy_blob_to``, which verifies the digest while it streams
and shows ``fstat`` of the descriptor it reads to a check before the first
byte (:func:`judge`: :func:`~adstore.integration.placement.rule.blob_refusal`).
The copy goes into a directory only this user can write
(:func:`~adstore.integration.placement.dirs.private_dir`, or a directory
:func:`~adstore.integration.placement.dirs.open_dir` judged and tightened),
under a temp name carrying this process's id, and is linked under its final
name without replacing anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from adstore.integration.errors import UnsafeCacheDir, UntrustedKernel
from adstore.integration.placement.dirs import open_dir, private_path, temp_name
from adstore.integration.placement.rule import Writer, blob_refusal

__all__ = ["copy_code", "judge", "place", "read_trusted"]


def judge(store: Any, digest: str, trusted: frozenset[int]) -> Callable[[os.stat_result | None], None]:
    """The ``check`` of ``Store.copy_blob_to``: refuse, before the first byte, a blob no trusted user wrote."""

    def check(st: os.stat_result | None) -> None:
        why = blob_refusal(store, Writer.of(st), trusted)
        if why is not None:
            raise UntrustedKernel(digest, why)

    return check


def copy_code(store: Any, ref: Any, dest: Path) -> Writer:
    """Copy blob ``ref`` to ``dest`` (in :func:`private_dir`), verified; who wrote the file the copy was read from.

    For a caller that judges later, before anything loads ``dest``
    (:func:`~adstore.integration.placement.rule.blob_refusal`; the engine
    cache judges once the record's metadata matched).
    """
    seen: list[Writer] = []
    store.copy_blob_to(ref, dest, check=lambda st: seen.append(Writer.of(st)))
    return seen[0]


def _copy_trusted(store: Any, ref: Any, dest: Path, trusted: frozenset[int]) -> None:
    store.copy_blob_to(ref, dest, check=judge(store, ref.digest, trusted))


def read_trusted(store: Any, ref: Any, trusted: frozenset[int]) -> bytes:
    """The verified content of blob ``ref``, from a trusted writer only (:class:`UntrustedKernel` otherwise)."""
    tmp = private_path(".blob")
    try:
        _copy_trusted(store, ref, tmp, trusted)
        return tmp.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)


def place(store: Any, ref: Any, *, directory: Path, name: str, trusted: frozenset[int], mode: int = 0o644) -> bool:
    """Copy blob ``ref`` to ``directory/name``, verified, from a trusted writer; False when the file exists already.

    ``directory`` (made 0700 when missing) must be this user's, under
    directories no untrusted user can rename in (:func:`open_dir`; a 0775
    directory of this user's is tightened).  The copy is written under a
    temp name and linked (never replacing) under ``name`` only once the
    store's read path has verified every byte.
    """
    if "/" in name or name in ("", ".", ".."):
        raise UnsafeCacheDir(str(directory), f"not a plain file name: {name!r}")
    os.close(open_dir(directory, trusted, create=True, own=True))
    target = directory / name
    if os.path.lexists(target):
        return False  # Inductor's own (or placed before): not ours to replace
    tmp = directory / temp_name()
    try:
        _copy_trusted(store, ref, tmp, trusted)
        os.chmod(tmp, mode & 0o755, follow_symlinks=False)
        try:
            os.link(tmp, target, follow_symlinks=False)
        except FileExistsError:
            return False  # another process placed it first
        return True
    finally:
        tmp.unlink(missing_ok=True)
