"""Where things live under a store root (README, "Using the store").

``index/`` is the LMDB environment, ``blobs/ab/<sha256>`` the read-only blob
files, ``tmp/`` the writers' unique temp files, ``quarantine/`` the blobs that
failed verification, and ``CACHEDIR.TAG`` tells backup tools to skip it all.
A digest is validated before it is joined into a path (invariant 2 in the
README's list of guarantees).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .fsutil import atomic_write
from .records import validate_digest

__all__ = ["Layout"]

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
        try:
            return os.stat(f"{self.root}/blobs/{digest[:2]}/{digest}").st_size == size
        except (FileNotFoundError, NotADirectoryError):
            return False

    def file_size(self, path: Path) -> int:
        """Size of ``path``, 0 if it is gone."""
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0

    def exists(self) -> bool:
        """Is there a store here (its ``CACHEDIR.TAG`` or its LMDB file)?  Creates nothing."""
        return (self.root / "CACHEDIR.TAG").is_file() or (self.index / "data.mdb").is_file()

    @property
    def group_shared(self) -> bool:
        """A setgid root is shared by its group (README, "A store shared by several users")."""
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
        if self.group_shared:
            try:
                os.chmod(path, 0o2775)
            except PermissionError:
                pass

    def create(self) -> None:
        """Create the layout (call after the root passed its permission checks)."""
        for d in (self.index, self.blobs, self.tmp, self.quarantine):
            self.mkdir(d)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            atomic_write(tag, _CACHEDIR_TAG, tmp_dir=self.tmp, mode=0o444)
