"""How a blob file is stored: its bytes as they are, or zstd frames with a seek table when that pays.

The identity of a blob is always the SHA-256 of its uncompressed bytes; how
its file holds them is the row's business (``FLAG_ZSTD``) and the record's
(``stored``).  The choice is made per blob, from a sample of its start:

* blobs below the inline threshold live in the index and stay raw: a small
  get decompressing would cost more than it saves (measured: a 16 KiB get
  goes from about 4 µs to 12 µs, for bytes the index holds anyway);
* a blob is compressed only when the sample shrinks to at most
  :data:`MIN_RATIO`'s share: snapshots and compiled engines do (about 12x
  and 3x), weights and random bytes do not (about 1.1x, and a compressed
  read would then cost more than the disk it saves);
* level :data:`LEVEL` (3, zstd's default), a checksum and the content size
  in every frame.

A compressed file is zstd's *seekable format*: independent frames of
growing content size (:func:`frame_target`: eight of 128 KiB, eight of
256 KiB, ..., at most :data:`MAX_FRAME`), then a skippable frame holding
the seek table (each frame's stored and content size).  Any zstd decoder
reads it as one stream (``zstd -dc FILE | sha256sum`` names the blob).
Frames make a verified read fast: the next frames are decoded in a helper
thread while the caller hashes this one, and both release the GIL.
Measured on the 2-core VM, decoding one frame and then hashing read a
1 MiB snapshot-like blob at 0.65x the speed of the same blob stored raw,
frames at about 0.8x (0.95x for 256 MiB).  Small frames keep the helper
ahead of the hash from the start (it wakes about 70 µs after it is asked,
and a larger next frame had the reader waiting for it), larger ones keep
the per-frame cost of big blobs low, and the ratio lost to frame
boundaries is small (snapshot-like bytes: 9.3x in one frame, 8.5x in
128 KiB frames).

A read is bounded by the recorded size: a table that does not add up to
the file and to the recorded size, a frame that fails to decode or its
checksum, or one whose header declares more than its table entry (a
decompression bomb: refused before zstd allocates) is :class:`Damaged`.
``zstandard`` is the binding (the reference zstd, the one bazel-remote and
ccache use).
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import zstandard

__all__ = [
    "Encoding",
    "LEVEL",
    "MIN_RATIO",
    "SAMPLE_BYTES",
    "MAX_FRAME",
    "Damaged",
    "Frame",
    "FrameWriter",
    "choose",
    "decode_file",
    "decode_verified",
    "frame_target",
    "frames",
]

#: zstd's default level: about 500 MiB/s to compress snapshot-like data here, and the ratio of
#: level 19 within a few percent for the store's blobs.
LEVEL = 3
#: A blob is compressed when a sample of it shrinks at least this many times (else it stays raw).
MIN_RATIO = 1.5
#: How much of a blob's start decides (the whole blob, when it is smaller): enough to tell a
#: snapshot or an engine from weights, little enough that a download does not wait on it.
SAMPLE_BYTES = 64 << 10
#: Content bytes of the first eight frames; every eighth frame doubles it, up to :data:`MAX_FRAME`.
FIRST_FRAME = 128 << 10
#: Most content bytes of one frame (also what a reader allows a table entry to claim).
MAX_FRAME = 4 << 20

_SKIPPABLE_MAGIC = 0x184D2A5E  # the skippable frame zstd's seekable format puts the table in
_SEEKABLE_MAGIC = 0x8F92EAB1
_SKIP_HEADER = struct.Struct("<II")  # magic, bytes that follow
_ENTRY = struct.Struct("<II")  # stored bytes, content bytes (no per-frame checksum: frames carry theirs)
_FOOTER = struct.Struct("<IBI")  # frames, descriptor, magic
_CHECKSUM_FLAG = 0x80
_RESERVED_BITS = 0x7C


class Encoding(enum.StrEnum):
    """How a blob's file (or a remote object) holds its bytes."""

    RAW = "raw"
    ZSTD = "zstd"


class Damaged(Exception):
    """Compressed bytes that do not decode to the recorded content (table, frame, checksum or size): damage."""


class _Sink(Protocol):
    def write(self, data: bytes | bytearray | memoryview, /) -> int: ...


def _compressor() -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=LEVEL, write_checksum=True, write_content_size=True)


def choose(sample: bytes | bytearray | memoryview) -> Encoding:
    """The encoding for a blob whose start is ``sample`` (at most :data:`SAMPLE_BYTES` are looked at)."""
    view = memoryview(sample)[:SAMPLE_BYTES]
    if not view.nbytes:
        return Encoding.RAW
    return Encoding.ZSTD if len(_compressor().compress(view)) * MIN_RATIO <= view.nbytes else Encoding.RAW


def frame_target(index: int) -> int:
    """Content bytes of frame ``index`` of a file (the last one holds what is left)."""
    return min(MAX_FRAME, FIRST_FRAME << (index // 8))


class FrameWriter:
    """Compress what is written into frames, then the seek table, passing the bytes to ``out.write``.

    Each frame is compressed in one call (which releases the GIL) once its
    content is complete; :meth:`finish` writes the last frame and the table.
    :attr:`written` counts the bytes passed on.
    """

    def __init__(self, out: _Sink) -> None:
        self._out = out
        self._cctx = _compressor()
        self._buf = bytearray()
        self._entries: list[tuple[int, int]] = []
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        while view.nbytes:
            target = frame_target(len(self._entries))
            if not self._buf and view.nbytes >= target:  # a whole frame from the caller's buffer, no copy
                self._emit(view[:target])
                view = view[target:]
                continue
            take = min(target - len(self._buf), view.nbytes)
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == target:
                self._emit(self._buf)
                self._buf = bytearray()
        return n

    def _emit(self, content: bytes | bytearray | memoryview) -> None:
        frame = self._cctx.compress(content)
        self._out.write(frame)
        self.written += len(frame)
        self._entries.append((len(frame), memoryview(content).nbytes))

    def finish(self) -> None:
        if self._buf:
            self._emit(self._buf)
            self._buf = bytearray()
        entries = b"".join(_ENTRY.pack(*e) for e in self._entries)
        table = (
            _SKIP_HEADER.pack(_SKIPPABLE_MAGIC, len(entries) + _FOOTER.size)
            + entries
            + _FOOTER.pack(len(self._entries), 0, _SEEKABLE_MAGIC)
        )
        self._out.write(table)
        self.written += len(table)


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame of a compressed file: where it starts, its stored bytes, its content bytes."""

    offset: int
    stored: int
    size: int


#: ``read_at(offset, n)``: ``n`` bytes of a file from ``offset`` (fewer only at its end).
ReadAt = Callable[[int, int], bytes | memoryview]


def frames(read_at: ReadAt, file_size: int, size: int | None) -> list[Frame]:
    """The frames of a compressed file of ``file_size`` bytes, from its seek table.

    ``size``: the content size recorded for the blob (None: whatever the
    table adds up to, for a file found without a row).  :class:`Damaged`
    when there is no table, or it does not add up to the file or to
    ``size``, or an entry claims more than :data:`MAX_FRAME`.
    """
    if file_size < _SKIP_HEADER.size + _FOOTER.size:
        raise Damaged(f"a file of {file_size} bytes has no seek table")
    n, descriptor, magic = _FOOTER.unpack(bytes(read_at(file_size - _FOOTER.size, _FOOTER.size)))
    if magic != _SEEKABLE_MAGIC or descriptor & _RESERVED_BITS:
        raise Damaged("no seek table at its end")
    width = _ENTRY.size + (4 if descriptor & _CHECKSUM_FLAG else 0)
    table_size = _SKIP_HEADER.size + n * width + _FOOTER.size
    if table_size > file_size:
        raise Damaged(f"its seek table lists {n} frames, more than a file of {file_size} bytes holds")
    start = file_size - table_size
    table = bytes(read_at(start, table_size - _FOOTER.size))
    if _SKIP_HEADER.unpack_from(table) != (_SKIPPABLE_MAGIC, n * width + _FOOTER.size):
        raise Damaged("its seek table's frame header does not match the table")
    out: list[Frame] = []
    offset = total = 0
    for i in range(n):
        stored, content = _ENTRY.unpack_from(table, _SKIP_HEADER.size + i * width)
        if not 0 < content <= MAX_FRAME or stored == 0:
            raise Damaged(f"its seek table lists a frame of {stored} bytes holding {content}")
        out.append(Frame(offset, stored, content))
        offset += stored
        total += content
    if offset != start:
        raise Damaged(f"its frames take {offset} bytes, the file has {start} before the table")
    if size is not None and total != size:
        raise Damaged(f"its frames hold {total} bytes, {size} recorded")
    return out


_LOCAL = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (making one allocates its context: a tenth of a 1 MiB read)."""
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return dctx


def _decode_frame(data: bytes | memoryview, frame: Frame) -> bytes:
    """The content of one frame, which must be exactly ``frame.size`` bytes: :class:`Damaged` otherwise."""
    if len(data) != frame.stored:
        raise Damaged(f"a frame cut short ({len(data)} of {frame.stored} bytes)")
    try:
        declared = zstandard.frame_content_size(data[:18])
    except zstandard.ZstdError:
        raise Damaged("a frame without a valid header") from None
    if declared != frame.size:  # zstd would allocate what the header says, whatever the table says
        raise Damaged(f"a frame whose header declares {declared} bytes, its table entry {frame.size}")
    try:
        out = _decompressor().decompress(data, max_output_size=frame.size)
    except zstandard.ZstdError as exc:
        raise Damaged(f"a frame that does not decode ({exc})") from None
    if len(out) != frame.size:
        raise Damaged(f"a frame decoding to {len(out)} bytes, {frame.size} recorded")
    return out


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The helper threads that decode ahead (a reader never waits for one to start: see :class:`_Ahead`)."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="adstore-decode")
    return _POOL


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool)

#: Frames a helper may decode ahead of the reader (memory: at most this many frames of content).
AHEAD = 4


class _Ahead:
    """The frames of one read, in order, decoded by the reader and by one helper, whichever is free.

    The helper thread decodes the next frames while the caller uses this one
    (hashing it, writing it): with both releasing the GIL, a verified read
    costs about the larger of the two instead of their sum.  Each frame is
    claimed once.  The helper claims the next unclaimed frame while it is at
    most :data:`AHEAD` frames ahead of the reader; the reader decodes a frame
    nobody claimed itself, so it only ever waits for a frame the helper is
    decoding: a helper that never starts (every pool thread busy) costs the
    pipelining, never progress.  ``join``: the frames are kept, and the
    helper that decodes the last one joins them all into one ``bytes``
    (:meth:`whole`) while the reader is still hashing.
    """

    def __init__(self, read_at: ReadAt, table: list[Frame], *, join: bool = False) -> None:
        self._read_at = read_at
        self._table = table
        self._join = join
        self._cond = threading.Condition()
        self._next = 0  # the first frame nobody has claimed
        self._taken = 0  # frames the reader has taken
        self._ready: dict[int, bytes | BaseException] = {}
        self._whole: bytes | None = None
        self._joining = False
        self._stop = False

    def _decode(self, frame: Frame) -> bytes:
        return _decode_frame(self._read_at(frame.offset, frame.stored), frame)

    def chunks(self) -> Iterator[bytes]:
        """Each frame's content in order; :class:`Damaged` at the first bad one.

        When the iterator ends or is closed, the helper no longer reads the file.
        """
        n = len(self._table)
        if n < 2:  # nothing to overlap
            for i in range(n):
                yield self.take(i)
            return
        helper = _pool().submit(self._help)
        taken = 0
        try:
            for i in range(n):
                chunk = self.take(i)
                taken += 1
                yield chunk
        finally:
            if taken < n:  # stopped early: wait out the frame the helper may be reading
                with self._cond:
                    self._stop = True
                    self._cond.notify_all()
                if not helper.cancel():
                    helper.result()

    def _help(self) -> None:
        """The helper's loop (in a pool thread)."""
        while True:
            with self._cond:
                while not self._stop and self._next - self._taken > AHEAD:
                    self._cond.wait()
                if self._stop or self._next >= len(self._table):
                    return
                i = self._next
                self._next += 1
            item: bytes | BaseException
            try:
                item = self._decode(self._table[i])
            except BaseException as exc:  # the reader raises it when it reaches frame i
                item = exc
            self._keep(i, item, helper=True)

    def _keep(self, i: int, item: bytes | BaseException, *, helper: bool) -> None:
        with self._cond:
            self._ready[i] = item
            join = self._join and helper and len(self._ready) == len(self._table)
            join = join and not any(isinstance(v, BaseException) for v in self._ready.values())
            self._joining = self._joining or join
            self._cond.notify_all()
        if join:  # every frame is in: nothing writes ``_ready`` any more
            whole = b"".join(self._ready[k] for k in range(len(self._table)))  # type: ignore[misc]
            with self._cond:
                self._whole, self._joining = whole, False
                self._cond.notify_all()

    def take(self, i: int) -> bytes:
        """Frame ``i``'s content (frames are taken in order)."""
        with self._cond:
            mine = i >= self._next
            if mine:
                self._next = i + 1
            else:
                while i not in self._ready:
                    self._cond.wait()
                item = self._ready[i] if self._join else self._ready.pop(i)
            self._taken = i + 1
            self._cond.notify_all()
        if mine:
            item = self._decode(self._table[i])
            if self._join:
                self._keep(i, item, helper=False)
        if isinstance(item, BaseException):
            raise item
        return item

    def whole(self) -> bytes:
        """Every frame's content in one ``bytes`` (``join``, once all are taken): the helper's, or joined here."""
        with self._cond:
            while self._joining:
                self._cond.wait()
            if self._whole is not None:
                return self._whole
            parts = [self._ready[k] for k in range(len(self._table))]
        return b"".join(parts)  # type: ignore[arg-type]  # one frame: that frame's bytes, not a copy


def _reader(fd: int) -> tuple[ReadAt, int]:
    """How to read the file open at ``fd``, and its size.

    A file of at most :data:`MAX_FRAME` bytes is read in one call (table and
    frames: a third of a small get was system calls); a larger one frame by
    frame with ``pread``, so the helper and the caller never share a position.
    """
    file_size = os.fstat(fd).st_size
    if file_size <= MAX_FRAME:
        whole = memoryview(os.pread(fd, file_size, 0))
        return (lambda offset, n: whole[offset : offset + n]), file_size
    return (lambda offset, n: os.pread(fd, n, offset)), file_size


def decode_verified(fd: int, size: int) -> tuple[bytes, str]:
    """The whole content of the compressed file open at ``fd`` and its SHA-256 (hex), in one pass.

    Each frame is hashed as soon as it is decoded, while the helper decodes
    the next ones and, having decoded the last, joins them into the one
    ``bytes`` returned: the caller's hashing is all that is left on the
    critical path.  :class:`Damaged` as for :func:`frames` and
    :func:`decode_file`.
    """
    read_at, file_size = _reader(fd)
    ahead = _Ahead(read_at, frames(read_at, file_size, size), join=True)
    sha = hashlib.sha256()
    for chunk in ahead.chunks():
        sha.update(chunk)
    return ahead.whole(), sha.hexdigest()


def decode_file(fd: int, size: int | None) -> Iterator[bytes]:
    """The content of the compressed file open at ``fd``, one chunk per frame, decoded ahead (``_Ahead``).

    ``size`` as for :func:`frames`.
    """
    read_at, file_size = _reader(fd)
    return _Ahead(read_at, frames(read_at, file_size, size)).chunks()
