"""Files into the store as code: the same rule before a file is stored as before a blob is loaded.

Torch's default cache directory is ``/tmp/torchinductor_$USER``, and torch
never checks who owns it: a local user who creates it first supplies the
kernels and headers found there.  Stored, they would reach every host that
reads the store (signed by this one, with a remote).  So a file is stored
as code only when:

* every directory from ``/`` to it is owned by a trusted uid and no
  untrusted user can rename in it, each judged on its ``O_NOFOLLOW``
  descriptor (:func:`~adstore.integration.placement.dirs.open_dir`; a 0775
  directory of this user's is tightened);
* the file, opened ``O_NOFOLLOW`` relative to that directory's descriptor,
  is by ``fstat`` of its descriptor a regular file a trusted uid owns and
  no untrusted user may write (:meth:`~adstore.integration.placement.rule.Writer.refusal`);
* the bytes stored are read from that same descriptor (hashed once; sent
  to ``Store.put_stream`` only when the store lacks them, and checked to
  hash the same again).

A refused file is left out with its reason; the caller counts it and goes on.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adstore.integration.errors import UnsafeCacheDir, UntrustedKernel
from adstore.integration.placement.dirs import open_dir
from adstore.integration.placement.rule import Writer
from adstore.store import AdstoreError, BlobRef, StoreError

__all__ = ["Captured", "capture_files", "read_files"]

_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CHUNK = 1 << 20


@dataclass
class Captured:
    """What :func:`capture_files` stored (path -> blob) and refused (path -> the error saying why)."""

    refs: dict[str, BlobRef] = field(default_factory=dict)
    refused: dict[str, AdstoreError] = field(default_factory=dict)


class _Reader:
    """Opens files under the rule, each directory walked and judged once (its descriptor kept until :meth:`close`)."""

    def __init__(self, trusted: frozenset[int]) -> None:
        self.trusted = trusted
        self._dirs: dict[Path, int | UnsafeCacheDir] = {}

    def open(self, path: str | os.PathLike[str]) -> int:
        """A descriptor of the file ``path`` that the rule accepts (the caller closes it); raises why not."""
        p = Path(os.path.abspath(path))
        dfd = self._dirs.get(p.parent)
        if dfd is None:
            try:
                dfd = open_dir(p.parent, self.trusted, own=False)
            except UnsafeCacheDir as exc:
                dfd = exc
            self._dirs[p.parent] = dfd
        if isinstance(dfd, UnsafeCacheDir):
            raise dfd
        try:
            fd = os.open(p.name, _FILE_FLAGS, dir_fd=dfd)
        except OSError as exc:  # ELOOP: a symlink; ENOENT: gone; ENXIO: a socket
            raise UnsafeCacheDir(str(p), f"not opened as a file without following links ({exc.strerror})") from None
        try:
            why = Writer.of(os.fstat(fd)).refusal(self.trusted)
            if why is not None:
                raise UntrustedKernel(hashlib.sha256(str(p).encode()).hexdigest(), f"{p} not stored: {why}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        for dfd in self._dirs.values():
            if isinstance(dfd, int):
                os.close(dfd)
        self._dirs.clear()


def capture_files(store: Any, paths: Iterable[str], trusted: frozenset[int]) -> Captured:
    """Store each file of ``paths`` that the rule accepts, read from the descriptor judged; never raises for a file.

    A file refused (an unsafe directory, another owner, writable by others,
    not a regular file, gone) is in :attr:`Captured.refused` with an
    :class:`~adstore.integration.errors.InductorCacheError` (its ``reason``).
    A store error (disk full, ...) is raised: nothing more can be stored.
    """
    out = Captured()
    reader = _Reader(trusted)
    try:
        for path in dict.fromkeys(str(p) for p in paths):
            try:
                fd = reader.open(path)
            except (UntrustedKernel, UnsafeCacheDir) as exc:
                out.refused[path] = exc
                continue
            try:
                out.refs[path] = _store(store, fd, path)
            finally:
                os.close(fd)
    finally:
        reader.close()
    return out


def read_files(paths: Iterable[str], trusted: frozenset[int]) -> dict[str, bytes]:
    """The bytes of each file of ``paths``, read under the rule (raises for the first it refuses)."""
    reader = _Reader(trusted)
    out: dict[str, bytes] = {}
    try:
        for path in paths:
            fd = reader.open(path)
            try:
                out[path] = b"".join(_chunks(fd))
            finally:
                os.close(fd)
    finally:
        reader.close()
    return out


def _store(store: Any, fd: int, path: str) -> BlobRef:
    """The blob of the file open at ``fd``: hashed once, sent to the store only when it lacks it."""
    h = hashlib.sha256()
    size = 0
    for chunk in _chunks(fd):
        h.update(chunk)
        size += len(chunk)
    ref = BlobRef(h.hexdigest(), size)
    if store.has_blob(ref):
        return ref
    stored = store.put_stream(_chunks(fd))
    if (stored.digest, stored.size) != (ref.digest, ref.size):
        raise StoreError(f"{path} changed while it was being stored")
    return stored


def _chunks(fd: int) -> Iterator[bytes]:
    """The file's bytes from its start, read from ``fd`` (``pread``: the descriptor's offset is not used)."""
    offset = 0
    while chunk := os.pread(fd, _CHUNK, offset):
        offset += len(chunk)
        yield chunk
