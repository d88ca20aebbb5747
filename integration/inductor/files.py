"""Files that become code, in and out of the store: the bytes loaded are the bytes checked.

A cache entry of Inductor's is code twice over: its value is a pickle that
Inductor unpickles, and its kernel files are shared objects it ``dlopen``s
(or sources and a precompiled header the compiler reads).  So, as for an
engine (docs/engine-cache.md, "Trust"):

* a blob file is read through one ``O_NOFOLLOW`` descriptor, and its owner
  and type come from ``fstat`` of that descriptor (never ``stat`` of a path
  followed by an ``open``): owned by this user, root or ``ADSTORE_TRUSTED_UIDS``;
* an inline blob lives in the index, which records no writer: it is trusted
  only when the index directory is writable by its trusted owner alone (a
  group-shared store's inline blobs are refused);
* the content is hashed while it is written into the target, and the copy
  is linked under its final name only if the digest and size match; the
  target directory is opened ``O_NOFOLLOW`` and must be this user's with no
  group or world write, so nobody can swap the file before Inductor loads it.

A file whose final name exists already is left alone: Inductor names kernel
files by the hash of their source and flags, and that file is its own.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from adstore.integration.errors import ConfigError, CorruptKernel, UnsafeCacheDir, UntrustedKernel

__all__ = ["trusted_uids", "read_trusted", "place", "CHUNK"]

CHUNK = 1 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def trusted_uids(environ: Mapping[str, str] | None = None) -> frozenset[int]:
    """This user, root and ``ADSTORE_TRUSTED_UIDS`` (comma-separated): the engine cache's writers of code."""
    env = os.environ if environ is None else environ
    raw = env.get("ADSTORE_TRUSTED_UIDS", "")
    try:
        extra = {int(u) for u in raw.replace(" ", "").split(",") if u}
    except ValueError as exc:
        raise ConfigError("ADSTORE_TRUSTED_UIDS", f"expected comma-separated user ids, got {raw!r}") from exc
    return frozenset({os.geteuid(), 0} | extra)


def read_trusted(store: Any, ref: Any, trusted: frozenset[int]) -> Iterator[bytes]:
    """The content of blob ``ref``, in chunks, from a trusted writer only; the caller checks the digest.

    Raises :class:`UntrustedKernel` before the first byte when the writer is
    not trusted.  The chunks are the bytes as stored after decompression; the
    caller hashes exactly what it writes (see :func:`place`).
    """
    stored = store.stored_blob(ref)
    if stored is None:
        _check_private_index(store, ref.digest, trusted)
        yield store.get_bytes(ref)  # the store checks it too (xxh3); the caller hashes it again
        return
    try:
        fd = os.open(stored.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UntrustedKernel(ref.digest, f"blob file not opened without following links ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedKernel(ref.digest, "blob is not a regular file")
        if st.st_uid not in trusted:
            raise UntrustedKernel(
                ref.digest, f"blob file is owned by uid {st.st_uid}, not a trusted user (ADSTORE_TRUSTED_UIDS)"
            )
        if str(stored.encoding) == "zstd":
            import zstandard

            # Any zstd decoder reads the store's seekable layout as one stream (docs/architecture.md, "Blobs").
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True, closefd=False)
            try:
                while chunk := reader.read(CHUNK):
                    yield chunk
            except zstandard.ZstdError as exc:
                raise CorruptKernel(ref.digest, f"undecodable ({exc})", 0) from None
        else:
            while chunk := f.read(CHUNK):
                yield chunk


def _check_private_index(store: Any, digest: str, trusted: frozenset[int]) -> None:
    """An inline blob is as trustworthy as the index that holds it: refuse one another user could have written."""
    try:
        fd = os.open(Path(store.root) / "index", _DIR_FLAGS)
    except OSError as exc:
        raise UntrustedKernel(digest, f"inline blob, index directory not opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid not in trusted or st.st_mode & 0o022 or st.st_mode & stat.S_ISGID:
        raise UntrustedKernel(digest, "inline blob in an index other users can write: its writer is unknown")


def place(chunks: Iterator[bytes], *, digest: str, size: int, directory: Path, name: str, mode: int = 0o644) -> bool:
    """Write ``chunks`` as ``directory/name`` if they hash to ``digest``; False when the file exists already.

    ``directory`` (created 0700 when missing) must be this user's and not
    group or world writable: checked by ``fstat`` of the ``O_NOFOLLOW``
    descriptor every later step is relative to.  The copy goes to a temp name,
    is hashed as written, fsynced, and linked (never replacing) under ``name``
    only after the digest matched.  A mismatch raises :class:`CorruptKernel`.
    """
    if "/" in name or name in ("", ".", ".."):
        raise UnsafeCacheDir(str(directory), f"not a plain file name: {name!r}")
    dfd = _private_dir(directory)
    try:
        try:
            os.stat(name, dir_fd=dfd, follow_symlinks=False)
            return False  # Inductor's own (or placed before): not ours to replace
        except FileNotFoundError:
            pass
        tmp = f".adstore-{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        try:
            h = hashlib.sha256()
            n = 0
            with os.fdopen(fd, "wb", closefd=False) as out:
                for chunk in chunks:
                    h.update(chunk)
                    n += len(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(fd)
            if h.hexdigest() != digest or n != size:
                raise CorruptKernel(digest, h.hexdigest(), n)
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                return False  # another process placed it first
            return True
        finally:
            os.close(fd)
            os.unlink(tmp, dir_fd=dfd)
    finally:
        os.close(dfd)


def _private_dir(directory: Path) -> int:
    """An ``O_NOFOLLOW`` descriptor of ``directory`` (made 0700 if missing), checked to be this user's alone."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        raise UnsafeCacheDir(str(directory), f"not opened as a directory without following links ({exc})") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise UnsafeCacheDir(
            str(directory), f"owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o7777)}: others could swap files"
        )
    return fd
