"""A structural check of every table page of ``data.mdb``, made with ``pread`` (what LMDB's writes trust).

The probe's child (``index.file.probe_index``) reads every row through LMDB,
which finds damage a read meets.  A write meets more: deleting or moving a
row copies whole nodes by the sizes their headers claim, and rebalancing a
tree reads sibling pages through their branch pointers.  A scribbled node
size that runs past its page is invisible to a read that copies a value
from the next page, yet a repair's write then copies past the page, and
near the end of the file that is a SIGBUS (a dead ``verify --fix``).  So
every page reachable from the main tree is checked here the way
``mdb_chk`` would: its header names its own number and one page type, its
node pointers and every node lie inside it, branch pointers and overflow
runs stay within the file's pages, and no page is reached twice.
"""

from __future__ import annotations

import os
import struct

__all__ = ["table_page_damage"]

_PAGE_HEADER = 16  # mp_pgno u64, mp_pad u16, mp_flags u16, mp_lower u16, mp_upper u16 (64-bit LMDB)
_NODE = struct.Struct("<HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_DB_RECORD = 48  # an MDB_db: a sub-database's record in the main tree
_DB_ROOT = 40  # md_root inside it
_NO_PAGE = (1 << 64) - 1
_MAX_KEY = 511  # LMDB's compiled-in maximum key size


def table_page_damage(fd: int, page_size: int, last_page: int, main_root: int, seen: set[int]) -> str | None:
    """Why a page of the tables reachable from ``main_root`` is malformed; None when every one is sound.

    ``fd`` is ``data.mdb`` opened for reading; the caller repeats the check
    when a writer committed meanwhile (pages are recycled under a walk).
    ``seen`` (empty) is filled with the pages the tables use, overflow runs
    included: the free-page list must name none of them.
    """
    if main_root == _NO_PAGE:
        return None
    # A reachable page lies inside the file (only never-written loose pages may lie past it), and bounding by
    # the file keeps a damaged meta page's last page number from sizing the walk.
    last_page = min(last_page, os.fstat(fd).st_size // page_size - 1)
    todo = [main_root]
    while todo:
        pgno = todo.pop()
        if not 2 <= pgno <= last_page:
            return f"a table refers to page {pgno}, outside pages 2..{last_page}"
        if pgno in seen:
            return f"page {pgno} is reached twice"
        seen.add(pgno)
        page = os.pread(fd, page_size, pgno * page_size)
        why = _page_damage(page, pgno, page_size)
        if why is not None:
            return f"page {pgno}: {why}"
        branch = struct.unpack_from("<H", page, 10)[0] & _P_BRANCH
        for off in _node_offsets(page):
            lo, hi, nflags, ksize = _NODE.unpack_from(page, off)
            data = off + _NODE.size + ksize
            if branch:
                todo.append(lo | hi << 16 | nflags << 32)
            elif nflags & _F_BIGDATA:
                start = struct.unpack_from("<Q", page, data)[0]
                why = _overflow_damage(fd, start, lo | hi << 16, page_size, last_page, seen)
                if why is not None:
                    return f"page {pgno}: {why}"
            elif nflags & _F_SUBDATA:
                root = struct.unpack_from("<Q", page, data + _DB_ROOT)[0]
                if root != _NO_PAGE:
                    todo.append(root)
    return None


def _node_offsets(page: bytes) -> list[int]:
    lower = struct.unpack_from("<H", page, 12)[0]
    return [struct.unpack_from("<H", page, _PAGE_HEADER + 2 * i)[0] for i in range((lower - _PAGE_HEADER) // 2)]


def _page_damage(page: bytes, pgno: int, psize: int) -> str | None:
    """What is wrong with one branch or leaf page on its own (header, node pointers, node extents)."""
    if len(page) < psize:
        return "lies past the end of the file"
    if struct.unpack_from("<Q", page, 0)[0] != pgno:
        return "does not carry its own number"
    flags, lower, upper = struct.unpack_from("<HHH", page, 10)
    kind = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW)
    if kind not in (_P_BRANCH, _P_LEAF):
        return f"is not a branch or leaf page (flags {flags:#x})"
    if not _PAGE_HEADER <= lower <= upper <= psize or (lower - _PAGE_HEADER) % 2:
        return f"free space bounds {lower}..{upper} make no sense"
    offsets = _node_offsets(page)
    if kind == _P_BRANCH and not offsets:
        return "is a branch without children"
    ends: list[tuple[int, int]] = []
    for off in offsets:
        if not upper <= off <= psize - _NODE.size:
            return f"a node pointer ({off}) lies outside the node area {upper}..{psize}"
        lo, hi, nflags, ksize = _NODE.unpack_from(page, off)
        if ksize > _MAX_KEY:
            return f"a key of {ksize} bytes"
        end = off + _NODE.size + ksize
        if kind == _P_LEAF:
            if nflags & _F_DUPDATA:
                return "a node with duplicates (no table of the store has them)"
            if nflags & _F_BIGDATA:
                end += 8
            elif nflags & _F_SUBDATA:
                if lo | hi << 16 != _DB_RECORD:
                    return "a sub-database record of the wrong size"
                end += _DB_RECORD
            else:
                end += lo | hi << 16
        if end > psize:
            return f"a node at {off} runs {end - psize} bytes past the page"
        ends.append((off, end + (end - off) % 2))  # LMDB lays nodes out at even sizes
    # LMDB packs the nodes from ``upper`` to the end of the page (a delete moves the rest up):
    # nodes that overlap or leave gaps claim sizes they do not have.
    ends.sort()
    at = upper
    for start, end in ends:
        if start != at:
            return "its nodes overlap or leave gaps: a node claims a size it does not have"
        at = end
    if at != psize:
        return "its nodes overlap or leave gaps: a node claims a size it does not have"
    return None


def _overflow_damage(fd: int, start: int, size: int, psize: int, last: int, seen: set[int]) -> str | None:
    """What is wrong with the overflow run at ``start`` that should hold a ``size``-byte value."""
    needed = (_PAGE_HEADER - 1 + size) // psize + 1
    if not 2 <= start <= last - needed + 1:
        return f"a value of {size} bytes on pages {start}.. outside pages 2..{last}"
    header = os.pread(fd, _PAGE_HEADER, start * psize)
    if len(header) < _PAGE_HEADER or struct.unpack_from("<Q", header, 0)[0] != start:
        return f"overflow page {start} does not carry its own number"
    flags, pages = struct.unpack_from("<H", header, 10)[0], struct.unpack_from("<I", header, 12)[0]
    if not flags & _P_OVERFLOW or not needed <= pages <= last - start + 1:
        return f"overflow page {start} is no run of {needed} page(s) (flags {flags:#x}, {pages} pages)"
    run = set(range(start, start + pages))
    if run & seen:
        return f"overflow page {start} is reached twice"
    seen.update(run)
    return None
