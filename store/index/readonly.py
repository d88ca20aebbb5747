"""Opening an index for reading only: a store on a read-only mount, a seed store (docs/operations.md,
"A read-only store").

Nothing is created or written: LMDB opens the environment ``readonly``, and
without its lock file when the filesystem is mounted read-only.  That is
safe there and only there: nobody can write a read-only mount, so no writer
exists whose page reuse a reader's snapshot would need protecting from (the
lock file's reader table is what protects it).  The schema is checked but
never written or migrated (a writer migrates).  The damage checks of
``index.file`` run first, as for any index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb

from ..errors import IncompatibleStore, ReadOnlyStore
from ..fsutil import read_only_filesystem
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
    lockless = read_only_filesystem(path)
    env = lmdb.open(
        str(path),
        map_size=map_size,
        max_dbs=len(DATABASES) + 4,
        max_readers=max_readers,
        subdir=True,
        readonly=True,
        lock=not lockless,  # lock-free only where no writer can exist
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
