"""Damage checks of the LMDB file itself, made with plain file reads (docs/operations.md, "Damage and repair").

LMDB maps ``data.mdb`` into memory and trusts it: a read of a page past the
end of the file is a SIGBUS, which kills the process (no exception can be
raised).  So before LMDB reads anything, :func:`check_data_file` reads both
meta pages with ``pread`` and compares the newest one's last used page with
the file size.  A file may legitimately end before that page: LMDB never
writes a page that a transaction allocated and freed again (a "loose" page),
yet counts it in the last page number.  So a short file is walked, with
``pread``, from the roots of every B-tree the meta page names; it is damaged
only when a page LMDB can reach lies past its end.  A damaged file, or one
without a valid meta page, is :class:`CorruptRow` (reason
``corrupt_index``), never a dead process.

Damage *inside* pages (random bytes over a B-tree page) can still fault
LMDB's own C code on some reads.  :func:`probe_index` therefore reads every
row of every table in a child process first (``python -c`` with
lmdb only), checking that the keys are in order and that a search finds
each: ``verify`` runs it before it scans the index in-process, so a damaged
index is reported (and ``--fix`` rebuilds it) instead of killing ``verify``.
No read looks at LMDB's list of free pages, but every write takes pages
from it, and moves nodes by the sizes their headers claim:
:func:`check_pages` walks the list and every table page with ``pread``
(an in-place repair would overwrite pages in use, move nodes past their
page, or abort).
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptRow, Unreadable
from .pages import table_page_damage
from .schema import DATABASES

__all__ = [
    "MetaPage",
    "read_meta",
    "check_data_file",
    "check_pages",
    "probe_index",
    "ProbeResult",
    "FRESH_INDEX_BYTES",
    "needs_creating",
]

log = logging.getLogger(__name__)

_MAGIC = 0xBEEFC0DE
_PAGE_HEADER = 16  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper (64-bit LMDB)
# MDB_meta after the page header: magic u32, version u32, address ptr, mapsize size_t,
# two MDB_db (48 bytes each; the first one's md_pad holds the page size), last_pg, txnid.
_META = struct.Struct("<IIQQ")
_PSIZE_OFFSET = _PAGE_HEADER + _META.size  # md_pad of the free-page DB
_LAST_PG = struct.Struct("<QQ")
_LAST_PG_OFFSET = _PAGE_HEADER + _META.size + 2 * 48
_META_BYTES = _LAST_PG_OFFSET + _LAST_PG.size
_DB_ROOT = 40  # md_root inside an MDB_db (after md_pad, md_flags, md_depth and four size_t counters)
_META_ROOTS = (_PSIZE_OFFSET + _DB_ROOT, _PSIZE_OFFSET + 48 + _DB_ROOT)
_NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty tree
# Page header flags and node flags (lmdb's mdb.c)
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_RETRIES = 3  # a writer may recycle pages during a walk: re-read the meta page and walk again
_PROBE_TIMEOUT = 300.0


#: Free bytes LMDB needs to create an environment.  It maps ``lock.mdb`` and
#: ``data.mdb`` and writes through the map: on a full filesystem (tmpfs) that
#: write is a SIGBUS inside ``lmdb.open``, so the store refuses with
#: ``StoreFull`` first (and a rebuild releases the ballast to make room).
FRESH_INDEX_BYTES = 1 << 20


def needs_creating(index_dir: Path) -> bool:
    """Will opening ``index_dir`` create LMDB's files (none there yet, or an empty ``data.mdb``)?"""
    try:
        return (index_dir / "data.mdb").stat().st_size == 0 or not (index_dir / "lock.mdb").exists()
    except FileNotFoundError:
        return True


@dataclass(frozen=True, slots=True)
class MetaPage:
    """What one valid LMDB meta page says."""

    page_size: int
    last_page: int
    txnid: int
    roots: tuple[int, int] = (_NO_PAGE, _NO_PAGE)  # the free-page and main B-trees' root pages

    @property
    def min_file_size(self) -> int:
        """Bytes the file must hold: every page up to and including the last used one."""
        return (self.last_page + 1) * self.page_size


def _parse(raw: bytes, page_size: int | None) -> MetaPage | None:
    if len(raw) < _META_BYTES:
        return None
    magic, _version, _addr, _mapsize = _META.unpack_from(raw, _PAGE_HEADER)
    if magic != _MAGIC:
        return None
    psize = struct.unpack_from("<I", raw, _PSIZE_OFFSET)[0] if page_size is None else page_size
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
        return None
    last_pg, txnid = _LAST_PG.unpack_from(raw, _LAST_PG_OFFSET)
    roots = (struct.unpack_from("<Q", raw, _META_ROOTS[0])[0], struct.unpack_from("<Q", raw, _META_ROOTS[1])[0])
    return MetaPage(psize, last_pg, txnid, roots)


def read_meta(data_file: Path) -> MetaPage | None:
    """The meta page LMDB will use (the newest valid one), None for an empty file.

    Raises :class:`CorruptRow` when the file has content but no valid meta page.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(data_file, flags)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None  # LMDB initialises an empty file: a fresh index
        first = _parse(os.pread(fd, _META_BYTES, 0), None)
        metas = [first] if first is not None else []
        if first is not None:
            second = _parse(os.pread(fd, _META_BYTES, first.page_size), first.page_size)
            if second is not None:
                metas.append(second)
    finally:
        os.close(fd)
    if not metas:
        raise CorruptRow("index", str(data_file), "not an LMDB file (no valid meta page)")
    return max(metas, key=lambda m: m.txnid)


def check_data_file(index_dir: Path) -> MetaPage | None:
    """Refuse a ``data.mdb`` that LMDB could not read without faulting.

    A missing or empty file is fine (LMDB creates a fresh index).  A file
    shorter than two pages or than its newest meta page's last page is
    :class:`CorruptRow`; one the system would not read, :class:`Unreadable`.
    """
    data_file = index_dir / "data.mdb"
    try:
        meta = read_meta(data_file)
        size = data_file.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as exc:  # out of descriptors, an I/O error: no proof of damage
        raise Unreadable(str(data_file), exc.errno, f"cannot read the LMDB meta pages: {exc.strerror}") from None
    if meta is None:
        return None
    if size < 2 * meta.page_size:
        raise CorruptRow("index", str(data_file), f"truncated: {size} bytes, shorter than its two meta pages")
    for _ in range(_RETRIES):
        if size >= meta.min_file_size:
            return meta
        try:
            missing = _reachable_page_past_end(data_file, meta, size // meta.page_size)
            now = read_meta(data_file)
            size = data_file.stat().st_size
        except OSError as exc:
            raise Unreadable(str(data_file), exc.errno, f"cannot read the LMDB pages: {exc.strerror}") from None
        if missing is None:
            return meta  # only never-written free pages lie past the end: sound
        if now is None or now.txnid == meta.txnid:
            raise CorruptRow(
                "index",
                str(data_file),
                f"truncated: {size} bytes, but the index reaches page {missing} "
                f"(needs {(missing + 1) * meta.page_size} bytes)",
            )
        meta = now  # a writer committed during the walk: walk the new tree
    raise CorruptRow("index", str(data_file), "truncated, and the index kept changing while it was checked")


def _reachable_page_past_end(data_file: Path, meta: MetaPage, file_pages: int) -> int | None:
    """The first page reachable from ``meta``'s B-trees that lies at or past ``file_pages``, else None.

    Reads pages with ``pread`` only (never through a map).  A page that does
    not parse is left alone: bad bytes inside the file are the probe's
    business (:func:`probe_index`), only a missing page can fault a map read.
    """
    psize = meta.page_size
    fd = os.open(data_file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        todo = [root for root in meta.roots if root != _NO_PAGE]
        seen: set[int] = set()
        while todo:
            pgno = todo.pop()
            if pgno >= file_pages:
                return pgno
            if pgno in seen or pgno < 2 or len(seen) > meta.last_page:
                continue  # a cycle, a meta page or more pages than exist: damage, not truncation
            seen.add(pgno)
            page = os.pread(fd, psize, pgno * psize)
            todo.extend(_children(page, pgno, psize, file_pages))
    finally:
        os.close(fd)
    return None


def _children(page: bytes, pgno: int, psize: int, file_pages: int) -> list[int]:
    """Page numbers a branch or leaf page refers to (child pages, overflow runs, sub-database roots)."""
    if len(page) < psize or struct.unpack_from("<Q", page, 0)[0] != pgno:
        return []
    flags = struct.unpack_from("<H", page, 10)[0]
    if flags & _P_OVERFLOW:
        pages = struct.unpack_from("<I", page, 12)[0]
        return [pgno + pages - 1] if pages > 1 and pgno + pages > file_pages else []
    out: list[int] = []
    for _off, size, nflags, _ksize, data in _nodes(page, psize):
        if flags & _P_BRANCH:
            out.append(size | nflags << 32)
        elif nflags & _F_BIGDATA and data + 8 <= psize:
            out.append(struct.unpack_from("<Q", page, data)[0])
        elif nflags & _F_SUBDATA and data + 48 <= psize:
            root = struct.unpack_from("<Q", page, data + _DB_ROOT)[0]
            if root != _NO_PAGE:
                out.append(root)
    return out


def _nodes(page: bytes, psize: int) -> Iterator[tuple[int, int, int, int, int]]:
    """The nodes of a branch or leaf page: offset, data size (a branch's child page, low 32 bits),
    node flags (its high bits), key size and where the data starts; nodes past the page are left out."""
    flags, lower = struct.unpack_from("<HH", page, 10)
    if not flags & (_P_BRANCH | _P_LEAF) or lower < _PAGE_HEADER or lower > psize:
        return
    for i in range((lower - _PAGE_HEADER) // 2):
        off = struct.unpack_from("<H", page, _PAGE_HEADER + 2 * i)[0]
        if off + _NODE.size > psize:
            continue
        lo, hi, nflags, ksize = _NODE.unpack_from(page, off)
        yield off, lo | hi << 16, nflags, ksize, off + _NODE.size + ksize


def check_pages(data_file: Path) -> str | None:
    """Why ``data_file``'s pages are unsafe to write with; None when they are sound.

    Two things a write relies on and no read checks, walked with ``pread``:

    * every table page is well formed in the way a write relies on
      (:mod:`.pages`: the reads the probe's child makes pass over some of it);
    * LMDB's list of free pages.  No read ever looks at it, but every write
      transaction takes pages from it without checking them: a listed page
      that is still in use gets overwritten, one past the last page is
      ``MDB_PAGE_NOTFOUND``, and LMDB's own assertions abort the process.
      Every page it lists must lie in the file, be listed once, and be
      neither in use by a table nor part of the free-page tree itself.

    A commit during the walk may recycle pages the walk reads: the walk is
    repeated, and an index that keeps changing (LMDB's own writers) counts
    as sound.  An unreadable file or one without a meta page is
    :func:`check_data_file`'s business (None here).
    """
    for _ in range(_RETRIES):
        try:
            meta = read_meta(data_file)
            if meta is None:
                return None
            fd = os.open(data_file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
            try:
                used: set[int] = set()
                why = table_page_damage(fd, meta.page_size, meta.last_page, meta.roots[1], used)
                why = why or _free_list_damage(fd, meta, used)
            finally:
                os.close(fd)
            now = read_meta(data_file)
        except (OSError, CorruptRow):
            return None
        if now is not None and now.txnid == meta.txnid:
            return why
    return None


def _free_list_damage(fd: int, meta: MetaPage, used: set[int]) -> str | None:
    """The free-page list's damage, given the pages the tables use (``used``, from the table walk)."""
    psize, last = meta.page_size, meta.last_page

    def read(pgno: int) -> bytes:
        return os.pread(fd, psize, pgno * psize)

    def overflow_run(pgno: int) -> int | None:
        """How many pages the overflow run starting at ``pgno`` spans; None if it is no such run."""
        if not 2 <= pgno <= last:
            return None
        page = read(pgno)
        if (
            len(page) < _PAGE_HEADER
            or struct.unpack_from("<Q", page, 0)[0] != pgno
            or not struct.unpack_from("<H", page, 10)[0] & _P_OVERFLOW
        ):
            return None
        pages = struct.unpack_from("<I", page, 12)[0]
        return pages if 1 <= pages <= last - pgno + 1 else None

    tree: set[int] = set()
    listed: set[int] = set()
    todo = [meta.roots[0]] if meta.roots[0] != _NO_PAGE else []
    while todo:
        pgno = todo.pop()
        if not 2 <= pgno <= last or pgno in tree:
            return f"the free-page tree refers to page {pgno} (outside pages 2..{last}, or twice)"
        tree.add(pgno)
        page = read(pgno)
        if len(page) < psize or struct.unpack_from("<Q", page, 0)[0] != pgno:
            return f"free-page tree page {pgno} does not carry its own number"
        flags = struct.unpack_from("<H", page, 10)[0]
        if not flags & (_P_BRANCH | _P_LEAF):
            return f"free-page tree page {pgno} is not a tree page (flags {flags:#x})"
        for _off, size, nflags, ksize, data in _nodes(page, psize):
            if flags & _P_BRANCH:
                todo.append(size | nflags << 32)
                continue
            if nflags & _F_BIGDATA:
                start = struct.unpack_from("<Q", page, data)[0] if data + 8 <= psize else 0
                run = overflow_run(start)
                if run is None or start in tree or _PAGE_HEADER + size > run * psize:
                    return f"free-page record at page {pgno} points to a bad overflow page {start}"
                tree.update(range(start, start + run))
                ids = os.pread(fd, size, start * psize + _PAGE_HEADER)
            else:
                ids = page[data : data + size] if ksize == 8 and data + size <= psize else b""
            count = struct.unpack_from("<Q", ids, 0)[0] if len(ids) >= 8 else -1
            if count < 0 or 8 + 8 * count > len(ids):
                return f"free-page record at page {pgno} is malformed"
            for free in struct.unpack_from(f"<{count}Q", ids, 8):
                if not 2 <= free <= last:
                    return f"the free-page list names page {free}, outside pages 2..{last}"
                if free in listed:
                    return f"the free-page list names page {free} twice"
                listed.add(free)
    taken = listed & (used | tree)
    if taken:
        return f"the free-page list names page {min(taken)}, which is in use"
    return None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """How a child process fared reading every row of the index."""

    ok: bool
    detail: str


# The child imports nothing of adstore (importing the package costs ~0.1 s): only lmdb.
_PROBE = """
import errno, os, sys, lmdb
path, lock, names = sys.argv[1], sys.argv[2] == "lock", sys.argv[3:]
# What the system says when it cannot serve the probe: no proof of damage (out of descriptors or
# memory, an I/O error, no access), so inconclusive (exit 3), never a reason to quarantine the index.
TRANSIENT = [os.strerror(e) for e in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EIO, errno.EAGAIN)]
try:
    env = lmdb.open(path, readonly=True, lock=lock, max_dbs=len(names) + 4, subdir=True, readahead=False)
    with env.begin() as txn:
        for name in names:
            try:
                db = env.open_db(name.encode(), txn=txn, create=False)
            except lmdb.NotFoundError:
                continue
            prev = None
            for key, _value in txn.cursor(db=db):
                if prev is not None and key <= prev:
                    sys.exit(f"table {name}: key {key!r} out of order (after {prev!r})")
                if txn.get(key, db=db) is None:
                    sys.exit(f"table {name}: key {key!r} cannot be found by a search")
                prev = key
except lmdb.Error as exc:
    if "Permission denied" in str(exc) or "Read-only" in str(exc):
        sys.exit(3)  # cannot probe (no write access to lock.mdb): inconclusive, not damage
    if any(text in str(exc) for text in TRANSIENT):
        sys.exit(3)
    sys.exit(f"{type(exc).__name__}: {exc}")
except (OSError, MemoryError):
    sys.exit(3)
"""


def probe_index(root: Path, *, lock: bool = True) -> ProbeResult:
    """Read every row of every table of ``root``'s index in a child process.

    A signal death of the child (LMDB faulting on a damaged page) or any
    error is a damaged index; this process never touches the bad page.
    A file that fails :func:`check_data_file` or :func:`check_pages` is
    damaged without a child.
    A user who may not write ``lock.mdb`` or run the interpreter, or a
    child the system refuses descriptors, memory or I/O, cannot probe: that
    counts as sound (``verify`` then scans in-process as before), since it
    proves nothing about the index.  ``lock=False``: the index is on a
    read-only mount (no writer can exist), so the child opens it without
    LMDB's lock file, which it could not create there.
    """

    try:
        check_data_file(root / "index")
    except CorruptRow as exc:
        return ProbeResult(False, exc.detail)
    why = check_pages(root / "index" / "data.mdb")
    if why is not None:
        return ProbeResult(False, why)
    try:
        res = subprocess.run(
            [sys.executable, "-c", _PROBE, str(root / "index"), "lock" if lock else "nolock", *DATABASES],
            check=False,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"reading the index took more than {_PROBE_TIMEOUT:g}s")
    except OSError as exc:  # this user may not run the interpreter (another user's venv): cannot probe
        log.warning("cannot probe the index of %s in a child process: %s", root, exc)
        return ProbeResult(True, "")
    if res.returncode in (0, 3):
        return ProbeResult(True, "")
    if res.returncode < 0:
        try:
            name = signal.Signals(-res.returncode).name
        except ValueError:
            name = f"signal {-res.returncode}"
        return ProbeResult(False, f"reading the index faults ({name}): damaged pages")
    lines = res.stderr.strip().splitlines()
    return ProbeResult(False, lines[-1] if lines else f"reading the index failed (exit {res.returncode})")
