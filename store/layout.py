"""Where things live under a store root (docs/architecture.md, "On disk").

``index/`` is the LMDB environment, ``blobs/ab/<sha256>`` the read-only blob
files, ``records/`` the on-disk records the index is rebuilt from
(``records.files``), ``tmp/`` the writers' unique temp files, ``quarantine/``
the blobs that failed verification, and ``CACHEDIR.TAG`` tells backup tools
to skip it all.  ``FROZEN``, made where the store is built (``Store.freeze``),
says nothing writes it any more: it opens read-only everywhere, and a reader
that cannot take LMDB's lock may read it lock-free (``index.readonly``).
A digest is validated before it is joined into a path (invariant 2,
docs/architecture.md, "Invariants").
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import NoStore, UnsafeRoot
from .fsutil import atomic_write, check_local_filesystem, check_root_permissions, read_only_filesystem, refuse_read_only
from .names import validate_digest

_log = logging.getLogger("adstore.store.store")  # the store's own warnings, wherever they are checked

__all__ = ["FROZEN", "Layout", "default_root"]

#: The marker of a frozen store, in its root (``Layout.frozen``).
FROZEN = "FROZEN"

_CACHEDIR_TAG = (
    b"Signature: 8a477f597d28d172789f06886806bc55\n"
    b"# This file is a cache directory tag created by adstore.\n"
    b"# For information about cache directory tags see https://bford.info/cachedir/\n"
)


@dataclass(frozen=True, slots=True)
class Layout:
    """Paths of a store root."""

    root: Path

    @property
    def index(self) -> Path:
        return self.root / "index"

    @property
    def blobs(self) -> Path:
        return self.root / "blobs"

    @property
    def records(self) -> Path:
        return self.root / "records"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def blob_path(self, digest: str) -> Path:
        validate_digest(digest)
        return self.root / "blobs" / digest[:2] / digest

    def has_file(self, digest: str, size: int) -> bool:
        """Is the blob file of ``digest`` on disk with ``size`` bytes?

        On the lookup path, so the path is joined without ``blob_path``'s
        validation: callers pass a digest that is already validated (a
        BlobRef, or a manifest row whose decoder checked every digest).
        """
        try:  # lstat: a symlink is never a blob (invariant 10)
            st = os.lstat(f"{self.root}/blobs/{digest[:2]}/{digest}")
        except (FileNotFoundError, NotADirectoryError):
            return False
        return st.st_size == size and stat.S_ISREG(st.st_mode)

    def open_temp(self, tmp: Path, *, readable: bool = False) -> int:
        """Create the new temp file ``tmp`` (``O_EXCL``, no symlink followed); recreates a removed ``tmp/``.

        ``readable``: its writer reads it back through the same descriptor (never by path, which a sweep may take).
        """
        flags = (os.O_RDWR if readable else os.O_WRONLY) | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            self.mkdir(tmp.parent)
            return os.open(tmp, flags, 0o600)

    def file_size(self, path: Path) -> int:
        """Size of ``path``, 0 if it is gone."""
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0

    @property
    def frozen(self) -> bool:
        """Was the store frozen where it was built (a regular file ``FROZEN`` in its root)?  Nothing writes a
        frozen store, adstore included: it opens read-only (:meth:`prepare`)."""
        try:
            return stat.S_ISREG(os.lstat(self.root / FROZEN).st_mode)
        except OSError:
            return False

    def freeze(self) -> None:
        """Mark the store frozen (:attr:`frozen`); whoever writes it next must remove the marker first."""
        text = b"adstore: this store is frozen; nothing writes it, and readers may read it without a lock.\n"
        atomic_write(self.root / FROZEN, text, mode=0o444)

    def exists(self) -> bool:
        """Is there a store here (its ``CACHEDIR.TAG`` or its LMDB file)?  Creates nothing."""
        return (self.root / "CACHEDIR.TAG").is_file() or (self.index / "data.mdb").is_file()

    @property
    def group_shared(self) -> bool:
        """A setgid root is shared by its group (docs/configuration.md, "A store shared by several users")."""
        try:
            return bool(self.root.stat().st_mode & stat.S_ISGID)
        except FileNotFoundError:
            return False

    def mkdir(self, path: Path) -> None:
        """Create a directory of the store; group-writable in a group-shared store.

        Explicit, so a member's restrictive umask cannot lock the group out.
        """
        try:
            path.mkdir()
        except FileExistsError:
            return
        except FileNotFoundError:  # its parent was removed under a running store: recreate it
            if path.parent == self.root or self.root not in path.parents:
                raise
            self.mkdir(path.parent)
            self.mkdir(path)
            return
        if self.group_shared:
            try:
                os.chmod(path, 0o2775)
            except PermissionError:
                pass

    def check_no_symlinks(self) -> None:
        """Refuse a root whose ``index/``, ``blobs/``, ``records/``, ``tmp/`` or ``quarantine/`` is a symlink.

        Wherever it points, blobs, LMDB files, records or quarantined files
        would be written through it (invariant 10): :class:`UnsafeRoot`
        (reason ``unsafe_root``).
        """
        for d in (self.index, self.blobs, self.records, self.tmp, self.quarantine):
            if d.is_symlink():
                raise UnsafeRoot(
                    str(self.root),
                    f"{d.name}/ is a symlink (to {os.readlink(d)!r}); "
                    "a store's directories must be real directories inside its root",
                )

    def prepare(self, *, read_only: bool, create: bool, check_permissions: bool) -> bool:
        """Check the root (and make it unless the store is read-only); whether the store is read-only.

        Read-only: asked for, the root is on a read-only mount, or the store is :attr:`frozen`.  A read-only
        store or ``create=False`` never makes a root (:class:`NoStore`), and a
        write that meets a read-only filesystem raises ``ReadOnlyStore``.
        """
        exists = self.exists()
        read_only = bool(read_only) or (exists and (read_only_filesystem(self.root) or self.frozen))
        if (not create or read_only) and not exists:  # read-only callers must not leave an empty store
            raise NoStore(str(self.root))
        if not read_only:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                refuse_read_only(exc, self.root)
                raise
        check_local_filesystem(self.root)
        if check_permissions:  # before anything is created inside the root
            for warning in check_root_permissions(self.root):
                if not read_only:  # a read-only store belongs to whoever baked it (root, usually)
                    _log.warning("%s", warning)
        self.check_no_symlinks()  # invariant 10: nothing of the store may lead outside it
        if not read_only:
            try:
                self.create()
            except OSError as exc:
                refuse_read_only(exc, self.root)
                raise
        return read_only

    def create(self) -> None:
        """Create the layout (call after the root passed its permission checks)."""
        for d in (
            self.index,
            self.blobs,
            self.records,
            self.records / "pending",
            self.records / "obsolete",
            self.tmp,
            self.quarantine,
        ):
            self.mkdir(d)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            atomic_write(tag, _CACHEDIR_TAG, tmp_dir=self.tmp, mode=0o444)


def default_root(environ: Mapping[str, str] | None = None) -> Path:
    """``$ADSTORE_ROOT``, else ``${XDG_CACHE_HOME:-~/.cache}/adstore``."""
    env = os.environ if environ is None else environ
    if env.get("ADSTORE_ROOT"):
        return Path(env["ADSTORE_ROOT"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adstore"
