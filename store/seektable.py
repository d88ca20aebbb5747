"""The seek table of a compressed blob file, and the layout a reader holds it to.

A compressed file (``codec``) is zstd's seekable format: independent
frames, then a skippable frame holding one entry per frame (stored bytes,
content bytes) and a footer (the count, a descriptor, a magic number).
The writer's layout is fixed: frame ``i`` holds :func:`frame_target` bytes
(eight of 128 KiB, eight of 256 KiB, ..., at most :data:`MAX_FRAME`), the
last what is left, so the count follows from the content size.

The table is the one thing a reader must believe before decoding, so it
is believed only where it is that layout, checked in an order that makes
a lie cheap: the footer's count against the recorded size before an entry
is read, every stored size between :data:`MIN_STORED` and zstd's worst case
for its content (:func:`compress_bound`), the frames ending where the table
begins.  Anything else is :class:`Damaged`, proof that the file is not what
the writer wrote.  (A table that claimed one frame per content byte used to
build an entry per claim: seconds and hundreds of MB before the refusal.)
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = [
    "FIRST_FRAME",
    "MAX_FRAME",
    "MIN_STORED",
    "Damaged",
    "Frame",
    "ReadAt",
    "compress_bound",
    "frame_count",
    "frame_target",
    "frames",
    "pack_table",
]

#: Content bytes of the first eight frames; every eighth frame doubles it, up to :data:`MAX_FRAME`.
FIRST_FRAME = 128 << 10
#: Most content bytes of one frame (also what a reader allows a table entry to claim).
MAX_FRAME = 4 << 20

_SKIPPABLE_MAGIC = 0x184D2A5E  # the skippable frame zstd's seekable format puts the table in
_SEEKABLE_MAGIC = 0x8F92EAB1
_SKIP_HEADER = struct.Struct("<II")  # magic, bytes that follow
_ENTRY = struct.Struct("<II")  # stored bytes, content bytes (no per-frame checksum: frames carry theirs)
_FOOTER = struct.Struct("<IBI")  # frames, descriptor, magic


class Damaged(Exception):
    """Compressed bytes that do not decode to the recorded content (table, frame, checksum or size): damage."""


def frame_target(index: int) -> int:
    """Content bytes of frame ``index`` of a file (the last one holds what is left)."""
    return min(MAX_FRAME, FIRST_FRAME << (index // 8))


def pack_table(entries: list[tuple[int, int]]) -> bytes:
    """The seek table (skippable frame and footer) of frames ``(stored, content)``, as the writer ends a file."""
    body = b"".join(_ENTRY.pack(*e) for e in entries)
    return (
        _SKIP_HEADER.pack(_SKIPPABLE_MAGIC, len(body) + _FOOTER.size)
        + body
        + _FOOTER.pack(len(entries), 0, _SEEKABLE_MAGIC)
    )


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a compressed file: where it starts, its stored bytes, its content bytes."""

    offset: int
    stored: int
    size: int


#: ``read_at(offset, n)``: ``n`` bytes of a file from ``offset`` (fewer only at its end).
ReadAt = Callable[[int, int], bytes | memoryview]

#: The fewest bytes a frame of the writer's holding content can take: magic (4), frame header descriptor
#: (1), content size (at least 1), one block header (3) and its byte (an RLE block), checksum (4).
MIN_STORED = 14


def compress_bound(n: int) -> int:
    """zstd's worst case for ``n`` content bytes in one frame, header and checksum included (``ZSTD_compressBound``)."""
    return n + (n >> 8) + ((FIRST_FRAME - n) >> 11 if n < FIRST_FRAME else 0)


def frame_count(size: int) -> int:
    """How many frames the writer makes of ``size`` content bytes (O(1): a few size classes, then whole
    :data:`MAX_FRAME` frames)."""
    n, left, k = 0, size, 0
    while left > 0:
        target = min(MAX_FRAME, FIRST_FRAME << k)
        if target == MAX_FRAME:
            return n + -(-left // MAX_FRAME)
        take = min(8, -(-left // target))
        n, left, k = n + take, left - take * target, k + 1
    return n


def _layout(n: int, size: int) -> Iterator[int]:
    """The content bytes of each of the ``n`` frames the writer makes of ``size`` bytes."""
    left = size
    for i in range(n):
        yield min(frame_target(i), left)
        left -= frame_target(i)


def frames(read_at: ReadAt, file_size: int, size: int | None) -> list[Frame]:
    """The frames of a compressed file of ``file_size`` bytes, from its seek table.

    ``size``: the content size recorded for the blob (None: whatever the
    table adds up to, for a file found without a row).  The table is
    believed only where it is the writer's layout: its count follows from
    ``size`` (checked from the footer, before an entry is read), every
    frame but the last holds :func:`frame_target` bytes, and each takes
    between :data:`MIN_STORED` and :func:`compress_bound` of its content.
    So a lying table costs the footer (or, without a size, the entries up
    to its first lie): :class:`Damaged`.
    """
    if file_size < _SKIP_HEADER.size + _FOOTER.size:
        raise Damaged(f"a file of {file_size} bytes has no seek table")
    n, descriptor, magic = _FOOTER.unpack(read_at(file_size - _FOOTER.size, _FOOTER.size))
    if magic != _SEEKABLE_MAGIC or descriptor != 0:  # the writer's tables carry no per-frame checksums
        raise Damaged("no seek table at its end")
    table_size = _SKIP_HEADER.size + n * _ENTRY.size + _FOOTER.size
    if table_size > file_size:
        raise Damaged(f"its seek table lists {n} frames, more than a file of {file_size} bytes holds")
    start = file_size - table_size
    if size is not None:
        if n != frame_count(size):
            raise Damaged(f"its seek table lists {n} frames, the writer makes {frame_count(size)} of {size} bytes")
        if not n * MIN_STORED <= start <= sum(compress_bound(c) for c in _layout(n, size)):
            raise Damaged(f"its frames take {start} bytes, outside zstd's worst case for {size} bytes in {n} frames")
    elif start < n * MIN_STORED:
        raise Damaged(f"its {n} frames cannot fit in the {start} bytes before its table")
    table = read_at(start, table_size - _FOOTER.size)
    if _SKIP_HEADER.unpack_from(table) != (_SKIPPABLE_MAGIC, n * _ENTRY.size + _FOOTER.size):
        raise Damaged("its seek table's frame header does not match the table")
    out: list[Frame] = []
    offset = total = 0
    for i, (stored, content) in enumerate(_ENTRY.iter_unpack(memoryview(table)[_SKIP_HEADER.size :])):
        target = frame_target(i)
        if content != target and not (i == n - 1 and 0 < content < target):
            raise Damaged(f"its frames hold other sizes than the writer's: frame {i} holding {content}, not {target}")
        if not MIN_STORED <= stored <= compress_bound(content):
            raise Damaged(f"its frame {i} takes {stored} bytes, outside zstd's worst case for {content} bytes")
        out.append(Frame(offset, stored, content))
        offset += stored
        total += content
    if offset != start:
        raise Damaged(f"its frames take {offset} bytes, the file has {start} before the table")
    if size is not None and total != size:
        raise Damaged(f"its frames hold {total} bytes, {size} recorded")
    return out
