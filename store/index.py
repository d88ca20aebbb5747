"""The LMDB index: one environment, named databases, and its hygiene.

LMDB is fast and crash-safe (copy-on-write B+tree, durable commits), but it
asks its users for care that this module concentrates in one place:

* an environment must not be used across ``fork``: every access checks the
  pid, and a child closes the inherited handle (its POSIX locks belong to the
  parent, so the parent keeps them) before opening its own;
* an environment must not be opened twice in one process: stores on the same
  root share one :class:`Index` (``Index.acquire``/``release``);
* the map size is a hard limit: start large (the file is sparse) and double
  it on ``MapFullError``; another process that grew it shows up as
  ``MapResizedError``, answered by adopting the new size;
* a killed reader leaves a stale slot in the reader table that pins old pages:
  ``reader_check()`` runs at open and periodically;
* one write transaction at a time, read transactions kept short.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb

from .errors import StoreError, StoreFull

__all__ = ["Index", "DATABASES", "SCHEMA_VERSION"]

log = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMA_VERSION = 1
DATABASES = ("blobs", "blobdata", "entries", "components", "manifests", "leases", "stats", "meta")
_READER_CHECK_INTERVAL = 30.0
_MAX_GROWTHS = 16

_SHARED: dict[tuple[int, str], list] = {}  # (pid, index path) -> [Index, users]
_SHARED_LOCK = threading.Lock()


def _is_disk_full(exc: lmdb.Error) -> bool:
    text = str(exc)
    return "No space left" in text or "Disk quota" in text or getattr(exc, "errno", None) in (
        errno.ENOSPC,
        errno.EDQUOT,
    )


class Index:
    """An LMDB environment with the store's named databases."""

    def __init__(self, path: Path, *, map_size: int = 1 << 30, max_readers: int = 1024) -> None:
        self.path = path
        self._initial_map_size = map_size
        self._max_readers = max_readers
        self._lock = threading.Lock()
        self._pid = -1
        self._env: lmdb.Environment | None = None
        self.db: dict[str, object] = {}
        self._last_reader_check = 0.0
        self._open()

    # -- lifecycle -------------------------------------------------------
    @classmethod
    def acquire(cls, path: Path, *, map_size: int = 1 << 30) -> Index:
        """The process's one Index for ``path`` (LMDB forbids opening it twice)."""
        key = (os.getpid(), os.path.realpath(path))
        with _SHARED_LOCK:
            slot = _SHARED.get(key)
            if slot is None or slot[0]._env is None:
                slot = _SHARED[key] = [cls(path, map_size=map_size), 0]
            slot[1] += 1
            return slot[0]

    def release(self) -> None:
        """Drop one user; the environment closes with its last user."""
        key = (os.getpid(), os.path.realpath(self.path))
        with _SHARED_LOCK:
            slot = _SHARED.get(key)
            if slot is None or slot[0] is not self:
                self.close()
                return
            slot[1] -= 1
            if slot[1] <= 0:
                del _SHARED[key]
                self.close()

    def _open(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        env = lmdb.open(
            str(self.path),
            map_size=self._initial_map_size,
            max_dbs=len(DATABASES) + 4,
            max_readers=self._max_readers,
            subdir=True,
            lock=True,
            sync=True,
            # One fsync per commit instead of two: LMDB keeps its integrity and
            # a power loss can only undo the last commit, which for a cache is
            # a miss, never a wrong answer.
            metasync=False,
            mode=0o664,
            readahead=False,
        )
        # Another process may already have grown the map beyond our initial size.
        info = env.info()
        if info["map_size"] < self._initial_map_size:
            env.set_mapsize(self._initial_map_size)
        self.db = {name: env.open_db(name.encode()) for name in DATABASES}
        self._env = env
        self._pid = os.getpid()
        self.reader_check()
        with env.begin(write=True) as txn:
            if txn.get(b"schema", db=self.db["meta"]) is None:
                txn.put(b"schema", str(SCHEMA_VERSION).encode(), db=self.db["meta"])

    @property
    def env(self) -> lmdb.Environment:
        """The environment of *this* process (reopened after fork)."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    if self._env is not None:
                        self._env.close()  # the parent's handle; its locks stay the parent's
                    self._env = None
                    self._open()
        if self._env is None:
            raise StoreError(f"index {self.path} is closed")
        return self._env

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            self._env.close()
        self._env = None

    def reader_check(self) -> int:
        """Free reader slots of dead processes; returns how many were stale."""
        self._last_reader_check = time.monotonic()
        stale = self.env.reader_check() if self._env is not None else 0
        if stale:
            log.info("cleared %d stale LMDB reader slot(s) in %s", stale, self.path)
        return stale

    # -- transactions ----------------------------------------------------
    def begin_read(self) -> lmdb.Transaction:
        """Start a read-only transaction; the caller aborts it (hot paths use this)."""
        env = self.env
        if time.monotonic() - self._last_reader_check > _READER_CHECK_INTERVAL:
            self.reader_check()
        try:
            return env.begin(buffers=False)
        except lmdb.MapResizedError:
            env.set_mapsize(0)  # another process grew the map: adopt its size
            return env.begin(buffers=False)

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """A short read-only transaction (adopts a map grown by another process)."""
        txn = self.begin_read()
        try:
            yield txn
        finally:
            txn.abort()

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in one write transaction and commit it.

        ``fn`` may run more than once (after the map grew), so it must only
        touch the transaction; any file work belongs before or after.
        """
        env = self.env
        for _ in range(_MAX_GROWTHS):
            try:
                txn = env.begin(write=True)
            except lmdb.MapResizedError:
                env.set_mapsize(0)
                continue
            try:
                result = fn(txn)
                txn.commit()
                return result
            except lmdb.MapFullError:
                txn.abort()
                self._grow(env)
            except lmdb.MapResizedError:
                txn.abort()
                env.set_mapsize(0)
            except lmdb.Error as exc:
                txn.abort()
                if _is_disk_full(exc):
                    raise StoreFull(str(self.path), str(exc)) from exc
                raise StoreError(f"index write failed in {self.path}: {exc}") from exc
            except BaseException:
                txn.abort()
                raise
        raise StoreError(f"index {self.path}: could not complete a write after growing the map")

    def _grow(self, env: lmdb.Environment) -> None:
        new_size = env.info()["map_size"] * 2
        log.info("growing LMDB map of %s to %d bytes", self.path, new_size)
        try:
            env.set_mapsize(new_size)
        except lmdb.Error as exc:
            if _is_disk_full(exc):
                raise StoreFull(str(self.path), str(exc)) from exc
            raise

    def map_size(self) -> int:
        return int(self.env.info()["map_size"])
