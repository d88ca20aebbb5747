"""The LMDB index: one environment, named databases, and its hygiene.

LMDB is fast and crash-safe (copy-on-write B+tree, durable commits), but it
asks its users for care that this module concentrates in one place:

* an environment must not be opened twice in one process: stores on the same
  root share one :class:`Index` (``Index.acquire``/``release``);
* an environment must not be used across ``fork``.  A child closes the
  inherited handle and opens its own.  Closing aborts every transaction
  object the handle knows, and aborting a *read* transaction copied from the
  parent would free the parent's slot in the shared reader table (its
  snapshot would no longer be protected), so ``fork`` is gated: it waits
  (briefly) until this process has no transaction open and none can start.
  A child that inherits an open transaction anyway (a caller held one across
  ``fork``) leaves the inherited handle alone and refuses to use the index;
  the cache above fails open;
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
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from ..errors import AccessDenied, CorruptRow, IncompatibleStore, ReadOnlyStore, StoreError, StoreFull
from .ballast import Ballast, may_spend
from .file import FRESH_INDEX_BYTES, check_data_file, needs_creating
from .migrations import migrate
from .readonly import open_read_only
from .schema import DATABASES, SCHEMA_VERSION

__all__ = ["Index", "index_error"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_READER_CHECK_INTERVAL = 30.0
_MAX_RETRIES = 16
_FORK_WAIT = 2.0

_SHARED: dict[tuple[int, str], list[Any]] = {}  # (pid, index path) -> [Index, users]
_INHERITED: list[lmdb.Environment] = []  # kept alive, never closed (see module doc)
_SHARED_LOCK = threading.Lock()
_PID = os.getpid()  # kept current by the fork hook: os.getpid() is a syscall on the hot path


def _upgraded(env: lmdb.Environment, txn: lmdb.Transaction, db: dict[str, object], schema: bytes) -> bool:
    """Upgrade an index of an older schema in ``txn`` when a migration leads here (``migrations``)."""
    try:
        found = int(schema.decode())
    except (UnicodeDecodeError, ValueError):
        return False
    return found != SCHEMA_VERSION and migrate(env, txn, db, found, SCHEMA_VERSION)


class _ForkGate:
    """Counts this process's open transactions; ``fork`` waits for none.

    While ``fork`` (or a map resize) waits, no transaction can start, so the
    child inherits none (see the module docstring).  Lock-free on the hot
    path: ``list.append``/``pop`` are atomic under the GIL, and a thread
    announces itself *before* checking the flag, so a fork that saw no open
    transaction cannot race with one starting.
    """

    def __init__(self) -> None:
        self._open: list[None] = []  # one item per open transaction
        self._blocking = False
        self._resume = threading.Event()
        self._resume.set()
        self._mutex = threading.Lock()  # one fork or resize at a time
        self._at_fork = 0
        #: Transactions that were open when this process was forked from its parent.
        self.inherited = 0

    def enter(self) -> None:
        while True:
            self._open.append(None)
            if not self._blocking:
                return
            self._open.pop()
            self._resume.wait()

    def exit(self) -> None:
        self._open.pop()

    def _block_and_wait(self, what: str) -> None:
        self._resume.clear()
        self._blocking = True
        deadline = time.monotonic() + _FORK_WAIT
        while self._open and time.monotonic() < deadline:
            time.sleep(0.0005)
        if self._open:
            log.warning("%s while %d LMDB transaction(s) stay open in this process", what, len(self._open))

    def _unblock(self) -> None:
        self._blocking = False
        self._resume.set()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Run with no transaction open in this process and none starting.

        LMDB's ``mdb_env_set_mapsize`` is only allowed then (it remaps).
        """
        with self._mutex:
            self._block_and_wait("resizing the LMDB map")
            try:
                yield
            finally:
                self._unblock()

    def before_fork(self) -> None:
        self._mutex.acquire()
        self._block_and_wait("fork")
        self._at_fork = len(self._open)

    def after_fork_in_parent(self) -> None:
        self._unblock()
        self._mutex.release()

    def after_fork_in_child(self) -> None:
        global _PID
        _PID = os.getpid()
        inherited = self._at_fork
        self.__init__()  # type: ignore[misc]  # fresh state: this process has no transaction open
        self.inherited = inherited


_GATE = _ForkGate()
os.register_at_fork(
    before=_GATE.before_fork, after_in_parent=_GATE.after_fork_in_parent, after_in_child=_GATE.after_fork_in_child
)


def _is_disk_full(exc: lmdb.Error, path: Path) -> bool:
    text = str(exc)
    if "No space left" in text or "Disk quota" in text:
        return True
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "Input/output error" in text or code == errno.EIO:
        # LMDB reports a short pwrite (ENOSPC after a partial write) as EIO.
        try:
            return shutil.disk_usage(path).free < (1 << 20)
        except OSError:
            return False
    return False


def index_error(exc: lmdb.Error, path: Path, what: str = "cannot use the LMDB index") -> StoreError:
    """The adstore error for any LMDB error (docs/operations.md, "Damage and repair").

    A full disk is :class:`StoreFull`, a refused open :class:`AccessDenied`;
    everything else LMDB raises (``CorruptedError``, ``PageNotFoundError``,
    ``BadValsizeError``, ``BadTxnError``, ``InvalidError``...) means the index
    is damaged: :class:`CorruptRow`, reason ``corrupt_index``; a read-only
    filesystem is :class:`ReadOnlyStore`.  No raw ``lmdb`` exception leaves the store.
    """
    if _is_disk_full(exc, path):
        return StoreFull(str(path), str(exc))
    if "Permission denied" in str(exc) or getattr(exc, "errno", None) in (errno.EACCES, errno.EPERM):
        return AccessDenied(str(path), what)
    if "Read-only file system" in str(exc) or getattr(exc, "errno", None) == errno.EROFS:
        return ReadOnlyStore(str(path.parent), what)  # not damage: a read-only mount the store did not expect
    return CorruptRow("index", str(path), f"{what}: {exc}")


def _open_error(exc: lmdb.Error, path: Path) -> StoreError:
    return index_error(exc, path, "cannot open the LMDB index")


class _Read:
    """``with index.read() as txn``: a read-only transaction as a context manager."""

    __slots__ = ("_index", "_txn")

    def __init__(self, index: Index) -> None:
        self._index = index
        self._txn: lmdb.Transaction | None = None

    def __enter__(self) -> lmdb.Transaction:
        self._txn = self._index.begin_read()
        return self._txn

    def __exit__(self, *exc: object) -> None:
        if self._txn is not None:
            self._index.end_read(self._txn)
        if isinstance(exc[1], lmdb.Error):
            raise index_error(exc[1], self._index.path) from exc[1]


class Index:
    """An LMDB environment with the store's named databases."""

    def __init__(
        self,
        path: Path,
        *,
        map_size: int = 1 << 30,
        max_readers: int = 1024,
        group_shared: bool = False,
        read_only: bool = False,
    ) -> None:
        self.path = path
        #: Opened for reading only (``read_only``): every write raises :class:`ReadOnlyStore`.
        self.read_only = read_only
        #: Opened without LMDB's lock file: the filesystem is mounted read-only (set at open).
        self.lockless = False
        self._group_shared = group_shared
        self._initial_map_size = map_size
        self._max_readers = max_readers
        self._lock = threading.Lock()
        self._pid = -1
        self._env: lmdb.Environment | None = None
        self.db: dict[str, Any] = {}  # lmdb's database handles, by name
        self._last_reader_check = 0.0
        self._unusable = ""
        #: The store's disk reserve, released by eviction's commits at 0 bytes free (set by the store).
        self.ballast: Ballast | None = None
        self._open()

    # -- lifecycle -------------------------------------------------------
    @classmethod
    def acquire(
        cls, path: Path, *, map_size: int = 1 << 30, group_shared: bool = False, read_only: bool = False
    ) -> Index:
        """The process's one Index for ``path`` (LMDB forbids opening it twice); a writer never gets a read-only one."""
        key = (os.getpid(), os.path.realpath(path))
        with _SHARED_LOCK:
            slot = _SHARED.get(key)
            if slot is not None and slot[0]._env is not None and slot[0].read_only and not read_only:
                raise ReadOnlyStore(str(path.parent), "opening it for writing while it is open read-only")
            if slot is None or slot[0]._env is None:
                opened = cls(path, map_size=map_size, group_shared=group_shared, read_only=read_only)
                slot = _SHARED[key] = [opened, 0]
            slot[1] += 1
            index: Index = slot[0]
            return index

    @staticmethod
    def users(path: Path) -> int:
        """How many stores of this process hold the index at ``path`` open."""
        with _SHARED_LOCK:
            slot = _SHARED.get((os.getpid(), os.path.realpath(path)))
            return slot[1] if slot is not None and slot[0]._env is not None else 0

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
        if self.read_only:  # nothing is created or written (``index.readonly``)
            try:
                opened = open_read_only(self.path, map_size=self._initial_map_size, max_readers=self._max_readers)
            except lmdb.Error as exc:
                raise _open_error(exc, self.path) from exc
            self._env, self.db, self.lockless = opened
            self._pid = os.getpid()
            self.reader_check()
            return
        self.path.mkdir(parents=True, exist_ok=True)
        check_data_file(self.path)  # a short file would SIGBUS at the first read
        if needs_creating(self.path) and shutil.disk_usage(self.path).free < FRESH_INDEX_BYTES:
            raise StoreFull(str(self.path), "no room to create the LMDB index")  # lmdb.open would SIGBUS
        try:
            env = lmdb.open(
                str(self.path),
                map_size=self._initial_map_size,
                max_dbs=len(DATABASES) + 4,
                max_readers=self._max_readers,
                subdir=True,
                lock=True,
                sync=True,
                # One fsync per commit instead of two: LMDB keeps its integrity
                # and a power loss can only undo the last commit, which for a
                # cache is a miss, never a wrong answer.
                metasync=False,
                mode=0o664,
                readahead=False,
            )
        except lmdb.Error as exc:
            raise _open_error(exc, self.path) from exc
        try:
            # Another process may already have grown the map beyond our initial size.
            if env.info()["map_size"] < self._initial_map_size:
                env.set_mapsize(self._initial_map_size)
            schema: bytes | None = None
            for _ in range(_MAX_RETRIES):
                try:
                    self.db = {name: env.open_db(name.encode()) for name in DATABASES}
                    with env.begin(write=True) as txn:
                        schema = txn.get(b"schema", db=self.db["meta"])
                        if schema is None or _upgraded(env, txn, self.db, schema):
                            schema = str(SCHEMA_VERSION).encode()
                            txn.put(b"schema", schema, db=self.db["meta"])
                    break
                except lmdb.MapResizedError:
                    env.set_mapsize(0)
            else:
                raise StoreError(f"index {self.path}: the map kept being resized while opening")
        except lmdb.Error as exc:
            env.close()
            raise _open_error(exc, self.path) from exc
        if schema is not None and schema != str(SCHEMA_VERSION).encode():
            # Rows of another layout would read as corruption (and be "repaired"): refuse.
            env.close()
            raise IncompatibleStore(str(self.path.parent), schema.decode(errors="replace"), SCHEMA_VERSION)
        if self._group_shared:  # a member's umask must not lock the group out of the index
            for name in ("data.mdb", "lock.mdb"):
                try:
                    f = self.path / name
                    if f.stat().st_uid == os.geteuid():
                        os.chmod(f, f.stat().st_mode | 0o060)
                except OSError:
                    pass
        self._env = env
        self._pid = os.getpid()
        self.reader_check()

    @property
    def env(self) -> lmdb.Environment:
        """The environment of *this* process (reopened after fork)."""
        if self._pid != _PID:
            with self._lock:
                if self._pid != os.getpid():
                    if self._env is not None and _GATE.inherited:
                        _INHERITED.append(self._env)
                        self._env = None
                        self._pid = os.getpid()
                        self._unusable = (
                            "this process was forked while an index transaction was open; "
                            "open the store after fork instead"
                        )
                    elif self._env is not None:
                        # Fork is gated, so no transaction of the parent's was copied
                        # here; closing leaves the parent's locks and reader slots alone.
                        self._env.close()
                        self._env = None
                    if not self._unusable:
                        self._open()
        if self._unusable:
            raise StoreError(f"index {self.path}: {self._unusable}")
        if self._env is None:
            raise StoreError(f"index {self.path} is closed")
        return self._env

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            self._env.close()
        self._env = None

    def reader_check(self) -> int:
        """Free reader slots of dead processes; returns how many were stale.

        Also re-checks the file against its meta page (a truncation while
        this process has the index open would SIGBUS a later read).
        """
        self._last_reader_check = time.monotonic()
        check_data_file(self.path)
        try:
            stale = self.env.reader_check() if self._env is not None else 0
        except lmdb.Error as exc:
            raise index_error(exc, self.path) from exc
        if stale:
            log.info("cleared %d stale LMDB reader slot(s) in %s", stale, self.path)
        return stale

    # -- transactions ----------------------------------------------------
    def read(self) -> _Read:
        """``with index.read() as txn:`` a short read-only transaction."""
        return _Read(self)

    def begin_read(self) -> lmdb.Transaction:
        """Start a read-only transaction; the caller must pass it to :meth:`end_read`.

        The hot paths (lookup, small-blob reads) use this pair directly.
        """
        env = self._env
        if self._pid != _PID or env is None:
            env = self.env
        if time.monotonic() - self._last_reader_check > _READER_CHECK_INTERVAL:
            self.reader_check()
        for _ in range(_MAX_RETRIES):
            _GATE.enter()
            try:
                return env.begin()  # read-only, copying values (buffers=False is the default)
            except lmdb.MapResizedError:
                _GATE.exit()
                self.resize_map(0)  # another process grew the map: adopt its size
            except lmdb.Error as exc:
                _GATE.exit()
                raise index_error(exc, self.path) from exc
            except BaseException:
                _GATE.exit()
                raise
        raise StoreError(f"index {self.path}: the map kept being resized")

    @staticmethod
    def end_read(txn: lmdb.Transaction) -> None:
        try:
            txn.abort()
        finally:
            _GATE.exit()

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in one write transaction and commit it.

        ``fn`` may run more than once (after the map grew), so it must only
        touch the transaction; any file work belongs before or after (or must
        be idempotent, like unlinking).  A commit that fails for lack of space
        inside ``ballast.spending_allowed`` releases the ballast and runs again.
        A read-only index raises :class:`ReadOnlyStore` before anything starts.
        """
        if self.read_only:
            raise ReadOnlyStore(str(self.path.parent), "a write to its index")
        env = self.env
        for _ in range(_MAX_RETRIES):
            resize: int | None = None
            _GATE.enter()
            try:
                try:
                    txn = env.begin(write=True)
                except lmdb.MapResizedError:
                    resize = 0
                except lmdb.Error as exc:
                    raise index_error(exc, self.path) from exc
                else:
                    try:
                        result = fn(txn)
                        txn.commit()
                        return result
                    except lmdb.MapFullError:
                        txn.abort()
                        resize = env.info()["map_size"] * 2
                    except lmdb.MapResizedError:
                        txn.abort()
                        resize = 0
                    except lmdb.Error as exc:
                        txn.abort()
                        error = index_error(exc, self.path, "index write failed")
                        if not (isinstance(error, StoreFull) and self._spend_ballast()):
                            raise error from exc
                    except BaseException:
                        txn.abort()
                        raise
            finally:
                _GATE.exit()
            if resize is not None:
                self.resize_map(resize)
        raise StoreError(f"index {self.path}: could not complete a write after growing the map")

    def _spend_ballast(self) -> bool:
        """A commit failed for lack of space: release the ballast if this write may (``ballast``)."""
        return may_spend() and self.ballast is not None and self.ballast.release()

    def resize_map(self, size: int) -> None:
        """Grow the map to ``size`` bytes, or adopt another process's size with 0."""
        env = self.env
        if size:
            log.info("growing LMDB map of %s to %d bytes", self.path, size)
        try:
            with _GATE.exclusive():
                env.set_mapsize(size)
        except lmdb.Error as exc:
            raise index_error(exc, self.path, "cannot resize the LMDB map") from exc

    def map_size(self) -> int:
        try:
            return int(self.env.info()["map_size"])
        except lmdb.Error as exc:
            raise index_error(exc, self.path) from exc
