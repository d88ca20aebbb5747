"""Opening an index for reading only: a store on a read-only mount, a seed store (docs/operations.md,
"A read-only store").

Nothing is created or written: LMDB opens the environment ``readonly``.  Its
lock file's reader table is what keeps a writer from reusing the pages a
reader's snapshot still uses, so the lock is taken whenever the lock file
can be opened for writing, even though the data is read-only.  Where it
cannot (a read-only mount), a read-only mount is not proof that nobody
writes: the same filesystem may be written elsewhere (a read-only bind mount
of a volume a builder writes, a Kubernetes ``readOnly`` volume), and a
lock-free reader would then read pages a writer reuses.  So the index is
read lock-free only when the store is frozen (``Layout.frozen``: marked where
it was built, by ``Store.freeze``, as nothing writes it any more); an
unfrozen store that cannot be locked is refused (:class:`UnsafeRoot`).  LMDB
itself would silently drop the lock on a read-only filesystem, so the
decision is made here, before it opens.  The schema is checked but never
written or migrated (a writer migrates).  The damage checks of
``index.file`` run first, as for any index.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lmdb

from ..errors import IncompatibleStore, ReadOnlyStore, UnsafeRoot
from ..fsutil import read_only_filesystem
from ..layout import Layout
from .file import check_data_file, needs_creating
from .schema import DATABASES, SCHEMA_VERSION

__all__ = ["open_read_only"]


def open_read_only(path: Path, *, map_size: int, max_readers: int) -> tuple[lmdb.Environment, dict[str, Any], bool]:
    """(environment, databases by name, lockless) of the existing index at ``path``.

    :class:`ReadOnlyStore` when there is no index to open, :class:`IncompatibleStore` for another schema;
    an ``lmdb.Error`` is the caller's to name (``env.index_error``).
    """
    check_data_file(path)  # a short file would SIGBUS at the first read, read-only or not
    if needs_creating(path) and not (path / "data.mdb").is_file():
        raise ReadOnlyStore(str(path.parent), "creating its index")
    lockless = not _lock_usable(path)
    if lockless and read_only_filesystem(path) and not Layout(path.parent).frozen:
        raise UnsafeRoot(
            str(path.parent),
            "its index is on a read-only mount, where LMDB cannot lock it, and the store is not frozen: "
            "a writer elsewhere could reuse pages under a lock-free read. Freeze it where it is built "
            "(adstore freeze), or mount it writable",
        )
    if lockless and not Layout(path.parent).frozen:
        lockless = False  # a writable filesystem: LMDB's own error (permission_denied) says why it cannot lock
    env = lmdb.open(
        str(path),
        map_size=map_size,
        max_dbs=len(DATABASES) + 4,
        max_readers=max_readers,
        subdir=True,
        readonly=True,
        lock=not lockless,  # lock-free only where no lock can be taken and nothing writes the store
        readahead=False,
    )
    try:
        try:
            meta = env.open_db(b"meta", create=False)
        except lmdb.NotFoundError:
            meta = None
        with env.begin() as txn:
            schema = None if meta is None else txn.get(b"schema", db=meta)
        if schema != str(SCHEMA_VERSION).encode():
            found = "none" if schema is None else schema.decode(errors="replace")
            raise IncompatibleStore(str(path.parent), found, SCHEMA_VERSION)
        return env, {name: env.open_db(name.encode(), create=False) for name in DATABASES}, lockless
    except BaseException:
        env.close()
        raise


def _lock_usable(path: Path) -> bool:
    """Can this process take LMDB's lock: open ``lock.mdb`` for writing, or create it?  Nothing is changed."""
    try:
        fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return os.access(path, os.W_OK | os.X_OK) and not read_only_filesystem(path)
    except OSError:
        return False
    os.close(fd)
    return True
