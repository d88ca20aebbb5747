"""Filesystem helpers: the one atomic-write helper, temp names, fs checks.

Everything that publishes a file in adstore goes through :func:`atomic_write`
or :func:`publish_temp`, so the order "unique temp, write, fsync, rename,
unlink temp on failure" lives in exactly one place (docs/architecture.md, "Conventions").
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from .errors import ReadOnlyStore, StoreFull, UnsafeRoot, UnsupportedFilesystem

__all__ = [
    "atomic_write",
    "discarding_on_error",
    "publish_temp",
    "unique_temp",
    "fsync_dir",
    "write_chunks",
    "start_writeback",
    "is_disk_full",
    "filesystem_type",
    "NETWORK_FILESYSTEMS",
    "check_local_filesystem",
    "check_root_permissions",
    "read_only_filesystem",
    "refuse_read_only",
]

log = logging.getLogger(__name__)

#: Filesystem types on which LMDB's locking (fcntl + shared memory map) is unsafe.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb",
        "smb2",
        "smb3",
        "smbfs",
        "ncpfs",
        "afs",
        "fuse.sshfs",
        "sshfs",
        "9p",
        "ceph",
        "fuse.ceph",
        "glusterfs",
        "fuse.glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.rclone",
        "davfs",
        "fuse.davfs2",
        "ocfs2",
        "gfs2",
        "panfs",
        "pvfs2",
        "orangefs",
        "fuse.juicefs",
    }
)

_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def is_disk_full(exc: BaseException) -> bool:
    """True when ``exc`` is an OS error saying the disk (or quota) is full."""
    return isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS


def unique_temp(tmp_dir: Path, suffix: str = ".tmp") -> Path:
    """A temp path no other writer (process or thread) can pick: pid + random."""
    return tmp_dir / f"{os.getpid()}-{uuid.uuid4().hex}{suffix}"


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None  # resolved on first use: libc's sync_file_range, or False where there is none


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` to disk now, without waiting.

    A large blob that will be fsynced is written back while the rest of it
    is still arriving, so the final fsync waits only for the tail (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which the ``os`` module does
    not wrap; elsewhere a no-op, and the fsync does all the work).
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes
            import ctypes.util

            fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError):
            log.debug("sync_file_range is not available: blobs are written back at fsync")
    if _sync_file_range:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a failure only means no head start


def write_chunks(fd: int, chunks: Iterable[bytes | bytearray | memoryview]) -> int:
    """Write every chunk fully to ``fd``; returns the byte count."""
    total = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]
            total += n
    return total


def publish_temp(tmp: Path, dest: Path, *, mode: int | None = None, sync_dir: bool = True) -> None:
    """Rename a fully written, fsynced temp file into place (atomic on POSIX)."""
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, dest)
    if sync_dir:
        fsync_dir(dest.parent)


@contextmanager
def discarding_on_error(tmp: Path, *, name: str | None = None) -> Iterator[Path]:
    """Unlink the temp file ``tmp`` if the block fails; a full disk becomes StoreFull.

    Every writer of a temp file (``atomic_write``, blob puts) uses this, so a
    failed or interrupted write never leaves a temp behind.
    """
    try:
        yield tmp
    except BaseException as exc:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and is_disk_full(exc):
            raise StoreFull(name or str(tmp), os.strerror(exc.errno or 0)) from exc
        raise


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | Iterable[bytes],
    *,
    tmp_dir: str | os.PathLike[str] | None = None,
    mode: int = 0o644,
) -> Path:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one.

    Unique temp (in ``tmp_dir`` or beside ``path``; same filesystem), write,
    fsync, chmod, rename, fsync the directory; the temp is unlinked on any
    failure.  A full disk raises :class:`StoreFull` and leaves nothing behind.
    """
    dest = Path(path)
    tmp = unique_temp(Path(tmp_dir) if tmp_dir is not None else dest.parent)
    chunks: Iterable[bytes | bytearray | memoryview] = (
        (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data
    )
    with discarding_on_error(tmp, name=str(dest)):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            write_chunks(fd, chunks)
            os.fsync(fd)
        finally:
            os.close(fd)
        publish_temp(tmp, dest, mode=mode)
    return dest


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem holding ``path`` (longest mount-point match)."""
    real = os.path.realpath(path)
    best, fstype = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
            best, fstype = mp, part.fstype
    return fstype


def check_local_filesystem(root: Path) -> str:
    """Refuse network filesystems; returns the filesystem type."""
    fstype = filesystem_type(root)
    if fstype.lower() in NETWORK_FILESYSTEMS:
        raise UnsupportedFilesystem(str(root), fstype)
    return fstype


def read_only_filesystem(path: str | os.PathLike[str]) -> bool:
    """Is ``path`` on a filesystem mounted read-only (``ST_RDONLY``: a read-only mount or bind mount, an image's
    ``readOnlyRootFilesystem``)?  Nobody can write there, so no writer of the store can exist: what makes a
    lock-free LMDB reader safe (``index.env``).  False when ``path`` cannot be examined."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def refuse_read_only(exc: OSError, root: Path) -> None:
    """No store can be created on a read-only filesystem: :class:`ReadOnlyStore` for EROFS (the caller
    re-raises any other OSError)."""
    if exc.errno == errno.EROFS:
        raise ReadOnlyStore(str(root), "creating a store") from exc


def check_root_permissions(root: Path) -> list[str]:
    """Refuse a world-writable root; return warnings for a foreign-owned one.

    A store may be shared by a group (setgid, group-writable), but a root any
    user can write to lets anyone plant a poisoned entry, so it is refused.
    """
    st = root.stat()
    warnings: list[str] = []
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafeRoot(str(root), "it is world-writable (chmod o-w, or share it through a group)")
    euid = os.geteuid()
    if st.st_uid != euid and euid != 0:
        if st.st_gid in os.getgroups() and st.st_mode & stat.S_IWGRP:
            return warnings
        warnings.append(
            f"store root {root} is owned by uid {st.st_uid}, not by you (uid {euid}), "
            "and is not shared with one of your groups"
        )
    return warnings
