"""The on-disk records of invariant 9: what a lost index is rebuilt from (README, "Damage and repair").

Layout under ``<root>/records/``::

    pending/<key>.<rank>.<generation>   published, not committed (never restored)
    ab/<key>.<rank>.<generation>        committed (``ab``: first two hex digits of SHA-256 of the key)
    ab/<key>.pin                        the entry is pinned (an empty marker)
    obsolete/<ns>.<pid>.<n>.list        names records dropped with their manifests (gc deletes them)

A record is immutable: its name says which save it belongs to (a generation
is drawn once per save), its content is written once, checksummed and
versioned (:mod:`.format`, the format the remote tier ships too).  The
protocol keeps the commit's guarantees and its one-fsync budget:

* ``publish`` writes the record into ``pending/`` right after the index
  transaction that published the manifest: unique temp (``O_EXCL`` and
  ``O_NOFOLLOW``), write, fsync, rename.  It is the save's step that already
  writes and fsyncs blob files, so this costs one more fsync there, none in
  the commit.
* ``commit`` renames it from ``pending/`` to its shard after the index
  transaction committed, so nothing is restorable from the records before the
  index says so, and a crash at any step leaves the rank's old committed
  record, its new one, or both (a rebuild takes the newer).  The rename is
  not fsynced: a power loss can undo the last renames as LMDB (``metasync``
  off) can undo its last commit, which after a rebuild is a miss, never a
  wrong answer; a record that a power loss tore fails its checksum.
* Whatever drops a manifest row (a newer generation, removal, eviction, the
  sweep, ``abort``, ``verify --fix``) obsoletes its records after the
  transaction committed (:mod:`.obsolete`): one *obsolete
  list* per batch, ``obsolete/<ns>.<pid>.<n>.list``, names the record files
  (``ab/<name>``, ``pending/<name>``), written under the write lock.  A
  listed record is dead: scans (a rebuild, ``verify``) skip it unless it was
  written again after its list (a restore that published the same
  generation anew), and the next gc unlinks it, then the list.  One small
  file per batch, not a syscall per record: unlinking a small fsynced file
  costs ~60 µs on the VM, a rename ~10 µs, and an eviction pass drops
  thousands of entries at once while gc has time.  Leftovers of a killed
  process are orphans that gc sweeps and ``verify`` reports.

Inline blobs (below the inline threshold, kept in the index's ``blobdata``)
are carried inside the record, base64: writing them as files as well would
bring back the file, fsync and inode per small blob that inline storage
exists to avoid, while the record is written and fsynced once per rank
anyway; they are small by definition, and their bytes are checked against
their digest before a rebuild registers them.

Pins are mutable and records are not, so a pin is a marker file beside the
entry's records, created or removed after the index transaction that
changed it (``verify --fix`` settles a marker a crash left behind).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import logging
import os
import stat
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UnsafeRoot
from ..fsutil import discarding_on_error, publish_temp, unique_temp, write_chunks
from ..index.rows import MANIFEST_SUFFIX
from ..layout import Layout
from ..names import is_key, validate_key
from .format import MAX_RECORD_BYTES, BadRecord, Record, decode_record, encode_record

__all__ = [
    "RecordFiles",
    "RecordState",
    "Found",
    "mtime_of",
    "obsolete_names",
    "shard_of",
    "PENDING",
    "OBSOLETE",
    "PIN_SUFFIX",
    "RECORD_MODE",
    "LIST_SUFFIX",
]

log = logging.getLogger(__name__)

PENDING = "pending"
OBSOLETE = "obsolete"
PIN_SUFFIX = ".pin"
LIST_SUFFIX = ".list"
RECORD_MODE = 0o444
_MAX_LIST_BYTES = 64 << 20  # a list names at most a batch of records; anything bigger is not ours
_LISTS = itertools.count()
#: An obsolete list: this line, then per record (which files, key length) and the manifest key.
_LIST_MAGIC = b"adstore obsolete list 1\n"
_LIST_ITEM = struct.Struct("<BH")
_HEX = frozenset("0123456789abcdef")
_SHARDS = tuple(f"{i:02x}" for i in range(256))  # a shard is the first byte of SHA-256 of the key


class RecordState(enum.Enum):
    """What a file under ``records/`` is, by where it lives and how it is named."""

    COMMITTED = "committed"
    PENDING = "pending"
    PIN = "pin"
    UNKNOWN = "unknown"  # not named like anything the store writes, or not a regular file


@dataclass(frozen=True, slots=True)
class Found:
    """One file under ``records/``: its path, state, and the (key, rank, generation) its name says."""

    path: Path
    state: RecordState
    key: str = ""
    rank: int = -1
    generation: int = -1
    mtime: float = 0.0  # 0.0: not read yet (see mtime_of)


def shard_of(key: str) -> str:
    return _SHARDS[hashlib.sha256(key.encode()).digest()[0]]


def _list_items(data: bytes) -> Iterator[tuple[bytes, int]]:
    """The (manifest key, which record files) of an obsolete list; nothing if it is not one, up to a torn end."""
    if not data.startswith(_LIST_MAGIC):
        return
    at, end, size, unpack = len(_LIST_MAGIC), len(data), _LIST_ITEM.size, _LIST_ITEM.unpack_from
    while at + size <= end:
        which, n = unpack(data, at)
        at += size
        if at + n > end:
            return
        yield data[at : at + n], which
        at += n


def obsolete_names(dropped: Iterable[tuple[bytes, int]]) -> list[str]:
    """The names (relative to ``records/``) of the record files of dropped manifests, for an obsolete list.

    ``dropped``: (manifest key, which record files: bit 1 committed, bit 2
    pending).  A key that does not parse or validate (a damaged row, a
    tampered list) names nothing, so no name is a file outside ``records/``.
    """
    names: list[str] = []
    add, match, sha256, unpack, shards = names.append, is_key, hashlib.sha256, MANIFEST_SUFFIX.unpack, _SHARDS
    for mk, which in dropped:
        raw, sep, tail = mk.partition(b"\x00")
        try:
            key = raw.decode()
        except UnicodeDecodeError:
            continue
        if not sep or len(tail) != MANIFEST_SUFFIX.size or not match(key):
            continue
        rank, generation = unpack(tail)
        name = f"{key}.{rank}.{generation}"
        if which & 1:
            add(f"{shards[sha256(raw).digest()[0]]}/{name}")
        if which & 2:
            add(f"{PENDING}/{name}")
    return names


def _parse_name(name: str) -> tuple[str, int, int] | None:
    """(key, rank, generation) of ``<key>.<rank>.<generation>``; None for anything else."""
    head, sep, gen = name.rpartition(".")
    key, sep2, rank = head.rpartition(".")
    if not (sep and sep2 and rank.isascii() and rank.isdigit() and gen.isascii() and gen.isdigit()):
        return None
    if len(rank) > 10 or len(gen) > 19 or not is_key(key):
        return None
    return key, int(rank), int(gen)


class RecordFiles:
    """The ``records/`` directory of one store root."""

    __slots__ = ("layout", "root", "pending", "obsolete", "_root_s")

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.root = layout.records
        self.pending = self.root / PENDING
        self.obsolete = self.root / OBSOLETE
        self._root_s = str(self.root)  # drop() joins strings: pathlib costs more than the rename

    # -- paths -------------------------------------------------------------------
    # A key is validated before it is joined into a path (as a digest is, invariant 2):
    # keys read back from a damaged or tampered index must not name a file outside records/.
    def committed_path(self, key: str, rank: int, generation: int) -> Path:
        return self.root / shard_of(validate_key(key)) / f"{key}.{int(rank)}.{int(generation)}"

    def pending_path(self, key: str, rank: int, generation: int) -> Path:
        return self.pending / f"{validate_key(key)}.{int(rank)}.{int(generation)}"

    def pin_path(self, key: str) -> Path:
        return self.root / shard_of(validate_key(key)) / f"{key}{PIN_SUFFIX}"

    def _dir(self, path: Path) -> None:
        """Create ``path`` (and ``records/``) as real directories of the store; a symlink is refused."""
        self.layout.mkdir(path)
        if path.is_symlink():
            raise UnsafeRoot(str(self.layout.root), f"{path} is a symlink; records are written only inside the root")

    # -- writing -----------------------------------------------------------------
    def write_pending(self, payload: Mapping[str, Any]) -> Path:
        """Write a published rank's record into ``pending/`` (fsynced; the commit renames it)."""
        return self._write(self.pending_path(payload["key"], payload["rank"], payload["generation"]), payload)

    def write_committed(self, payload: Mapping[str, Any]) -> Path:
        """Write a committed rank's record in place (no pending one: ``verify --fix``, an older store)."""
        return self._write(self.committed_path(payload["key"], payload["rank"], payload["generation"]), payload)

    def _write(self, dest: Path, payload: Mapping[str, Any]) -> Path:
        data = encode_record(payload)
        tmp = unique_temp(self.layout.tmp, ".record")
        with discarding_on_error(tmp, name=str(dest)):
            fd = self.layout.open_temp(tmp)  # O_EXCL | O_NOFOLLOW
            try:
                write_chunks(fd, (data,))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                publish_temp(tmp, dest, mode=RECORD_MODE, sync_dir=False)
            except FileNotFoundError:  # first record of its shard, or records/ was removed
                self._dir(self.root)
                self._dir(dest.parent)
                publish_temp(tmp, dest, mode=RECORD_MODE, sync_dir=False)
        return dest

    def commit(self, key: str, rank: int, generation: int) -> bool:
        """Move a pending record to its committed place; False if there was none."""
        src, dest = self.pending_path(key, rank, generation), self.committed_path(key, rank, generation)
        try:
            os.rename(src, dest)
        except FileNotFoundError:
            if not os.path.lexists(src):
                return False
            self._dir(dest.parent)
            os.rename(src, dest)
        return True

    def drop(self, key: str, rank: int, generation: int, *, committed: bool = True, pending: bool = True) -> None:
        """Obsolete a manifest's records: move them into ``obsolete/`` (a name that is not there is fine)."""
        name, root = f"{validate_key(key)}.{int(rank)}.{int(generation)}", self._root_s
        dest = f"{root}/{OBSOLETE}/{name}"
        paths = ([f"{root}/{shard_of(key)}/{name}"] if committed else []) + (
            [f"{root}/{PENDING}/{name}"] if pending else []
        )
        for path in paths:
            try:
                os.rename(path, dest)
            except FileNotFoundError:
                if not os.path.lexists(path):
                    continue
                self._dir(self.obsolete)  # removed under a running store
                os.rename(path, dest)

    def write_obsolete_list(self, dropped: Sequence[tuple[bytes, int]]) -> None:
        """Write one obsolete list naming the records of ``dropped`` manifests (see :func:`obsolete_names`).

        Call it holding the write lock, after the drop committed.  The list
        holds the manifest keys as the index has them, length-prefixed: no
        per-record work while the lock is held (an eviction batch lists a
        thousand), and no key, however damaged, can inject a line; readers
        validate each key (:meth:`obsoleted`).  Not fsynced, like the renames
        of the commit: a power loss can bring the records back, which a
        rebuild then restores if their blobs are still there (an entry that
        was dropped comes back; never a wrong one).
        """
        if not dropped:
            return
        pack = _LIST_ITEM.pack
        data = b"".join([_LIST_MAGIC, *(pack(which, len(mk)) + mk for mk, which in dropped)])
        path = f"{self._root_s}/{OBSOLETE}/{time.time_ns()}.{os.getpid()}.{next(_LISTS)}{LIST_SUFFIX}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o444)
        except FileNotFoundError:
            self._dir(self.obsolete)  # first list, or records/ was removed under a running store
            fd = os.open(path, flags, 0o444)
        try:
            write_chunks(fd, (data,))
        finally:
            os.close(fd)

    def obsolete_files(self) -> list[Path]:
        """The files in ``obsolete/``: lists, and records an older adstore moved there (gc deletes them)."""
        if not self.obsolete.is_dir() or self.obsolete.is_symlink():
            return []
        return sorted(self.obsolete.iterdir())

    def obsoleted(self) -> dict[str, float]:
        """Every record name the obsolete lists name, with the newest list's mtime that names it.

        Names are made from the listed manifest keys by :func:`obsolete_names`,
        which skips any key that is not valid: a tampered list can hide no path
        outside ``records/`` and names nothing but records.
        """
        out: dict[str, float] = {}
        for path in self.obsolete_files():
            if not path.name.endswith(LIST_SUFFIX):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_LIST_BYTES:
                    continue
                data = os.read(fd, st.st_size + 1)
            except OSError:
                continue
            finally:
                os.close(fd)
            for name in obsolete_names(_list_items(data)):
                if out.get(name, 0.0) < st.st_mtime:
                    out[name] = st.st_mtime
        return out

    def live(self, found: list[Found], obsoleted: Mapping[str, float] | None = None) -> list[Found]:
        """``found`` without the records an obsolete list names (unless written again after that list)."""
        dead = self.obsoleted() if obsoleted is None else obsoleted
        if not dead:
            return found
        out = []
        for f in found:
            when = dead.get(f"{f.path.parent.name}/{f.path.name}") if f.state is not RecordState.UNKNOWN else None
            if when is None or mtime_of(f) > when:
                out.append(f)
        return out

    @staticmethod
    def listed_identity(name: str) -> tuple[str, int, int] | None:
        """(key, rank, generation) of an obsolete list's line (as :meth:`obsoleted` returns it)."""
        return _parse_name(name.partition("/")[2])

    def unlink_listed(self, name: str, listed_at: float) -> bool:
        """Delete the record an obsolete list names, unless it was written after that list."""
        path = f"{self._root_s}/{name}"
        try:
            if os.lstat(path).st_mtime > listed_at:
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def set_pinned(self, key: str, pinned: bool) -> None:
        """Create or remove the entry's pin marker (never following a symlink)."""
        path = self.pin_path(key)
        if not pinned:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(2):
            try:
                os.close(os.open(path, flags, 0o444))
                return
            except FileExistsError:
                return
            except FileNotFoundError:
                self._dir(self.root)
                self._dir(path.parent)

    # -- reading -----------------------------------------------------------------
    def is_committed(self, key: str, rank: int, generation: int) -> bool:
        return os.path.lexists(self.committed_path(key, rank, generation))

    def read(self, path: Path) -> Record:
        """The validated record in ``path`` (opened without following a symlink); :class:`BadRecord` else."""
        where = str(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise BadRecord(where, f"cannot be opened ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadRecord(where, "not a regular file")
            if st.st_size > MAX_RECORD_BYTES:
                raise BadRecord(where, f"{st.st_size} bytes, more than any record ({MAX_RECORD_BYTES})")
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        except OSError as exc:
            raise BadRecord(where, f"cannot be read ({exc.strerror})") from None
        finally:
            os.close(fd)
        return decode_record(b"".join(chunks), where)

    def read_found(self, found: Found) -> Record:
        """:meth:`read`, and the record must be the one its name and shard say (no record takes another's place)."""
        record = self.read(found.path)
        if (record.key, record.rank, record.generation) != (found.key, found.rank, found.generation):
            raise BadRecord(
                str(found.path),
                f"holds {record.key} rank {record.rank} generation {record.generation}, not what its name says",
            )
        if found.state is RecordState.COMMITTED and found.path.parent.name != shard_of(record.key):
            raise BadRecord(str(found.path), "is in another key's shard")
        return record

    def scan_key(self, key: str) -> list[Found]:
        """The live files of one key: its committed records and its pin marker (pending ones are not restored)."""
        shard = self.root / shard_of(key)
        prefix = f"{key}."
        return self.live([f for f in _scan_dir(shard, pending=False) if f.path.name.startswith(prefix)])

    def scan(self) -> list[Found]:
        """Every live file under ``records/`` but ``obsolete/`` (sorted; symlinks and strangers as UNKNOWN).

        Names and types come from the directory entries (no stat per file,
        but one per record an obsolete list names); a :class:`Found`'s
        ``mtime`` is read when asked (:func:`mtime_of`).
        """
        if not self.root.is_dir() or self.root.is_symlink():
            return []
        found: list[Found] = []
        for sub in sorted(self.root.iterdir()):
            if sub.name == OBSOLETE and sub.is_dir() and not sub.is_symlink():
                continue
            is_pending = sub.name == PENDING
            if (
                sub.is_symlink()
                or not sub.is_dir()
                or not (is_pending or (len(sub.name) == 2 and set(sub.name) <= _HEX))
            ):
                found.append(Found(sub, RecordState.UNKNOWN))
                continue
            found += _scan_dir(sub, pending=is_pending)
        return self.live(found)


def mtime_of(found: Found) -> float:
    """When ``found`` was last modified (0.0 if it is gone): gc's grace period is counted from it."""
    if found.mtime:
        return found.mtime
    try:
        return found.path.lstat().st_mtime
    except OSError:
        return 0.0


def _scan_dir(directory: Path, *, pending: bool) -> list[Found]:
    try:
        if directory.is_symlink():
            return []
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return []
    return [_classify(directory / e.name, e.is_file(follow_symlinks=False), pending=pending) for e in entries]


def _classify(path: Path, regular: bool, *, pending: bool) -> Found:
    if not regular:
        return Found(path, RecordState.UNKNOWN)
    name = path.name
    if not pending and name.endswith(PIN_SUFFIX):
        key = name[: -len(PIN_SUFFIX)]
        try:
            validate_key(key)
        except ValueError:
            return Found(path, RecordState.UNKNOWN)
        if shard_of(key) != path.parent.name:
            return Found(path, RecordState.UNKNOWN)
        return Found(path, RecordState.PIN, key)
    parsed = _parse_name(name)
    if parsed is None:
        return Found(path, RecordState.UNKNOWN)
    state = RecordState.PENDING if pending else RecordState.COMMITTED
    return Found(path, state, *parsed)
