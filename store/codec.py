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
the seek table (``seektable``).  Any zstd decoder reads it as one stream
(``zstd -dc FILE | sha256sum`` names the blob).  A streamed read
(:func:`decode_file`) decodes the next frames in a helper thread while the
caller hashes or writes this one, and both release the GIL; a whole read
(:func:`decode_whole`) has zstd decode every frame into the one buffer it
returns, so it holds the content once.  Small frames keep the helper ahead
of the caller from the start, larger ones keep the per-frame cost of big
blobs low, and the ratio lost to frame boundaries is small (snapshot-like
bytes: 9.3x in one frame, 8.5x in 128 KiB frames).

A read is bounded by the recorded size: a table that is not the writer's
layout (``seektable``), a frame that fails to decode or its checksum, one
followed by anything but the next frame (as ``zstd -t`` says), or one whose
header declares other than its table entry (a decompression bomb: refused
before zstd allocates) is :class:`Damaged`.  Helper threads are daemon
threads whose waits time out: a reader dropped half way never keeps a
process alive.  ``zstandard`` is the binding (the reference zstd, the one
bazel-remote and ccache use).
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import threading
from collections.abc import Callable, Generator
from typing import IO, Protocol, cast

import zstandard

from .seektable import FIRST_FRAME, MAX_FRAME, Damaged, Frame, ReadAt, frame_target, frames, pack_table

__all__ = [
    "Encoding",
    "LEVEL",
    "MIN_RATIO",
    "SAMPLE_BYTES",
    "FIRST_FRAME",
    "MAX_FRAME",
    "Damaged",
    "Frame",
    "FrameWriter",
    "choose",
    "decode_file",
    "decode_whole",
    "frame_target",
    "frames",
]

log = logging.getLogger(__name__)

#: zstd's default level: about 500 MiB/s to compress snapshot-like data here, and the ratio of
#: level 19 within a few percent for the store's blobs.
LEVEL = 3
#: A blob is compressed when a sample of it shrinks at least this many times (else it stays raw).
MIN_RATIO = 1.5
#: How much of a blob's start decides (the whole blob, when it is smaller): enough to tell a
#: snapshot or an engine from weights, little enough that a download does not wait on it.
SAMPLE_BYTES = 64 << 10


class Encoding(enum.StrEnum):
    """How a blob's file (or a remote object) holds its bytes."""

    RAW = "raw"
    ZSTD = "zstd"


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
        table = pack_table(self._entries)
        self._out.write(table)
        self.written += len(table)


_LOCAL = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (making one allocates its context: a tenth of a 1 MiB read)."""
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return dctx


def _zstd_failed(exc: zstandard.ZstdError, what: str) -> Exception:
    """What a zstd error means: damage, unless zstd ran out of memory (no proof against the bytes)."""
    if "memory" in str(exc).lower():
        return MemoryError(f"zstd could not allocate while decoding {what} ({exc})")
    return Damaged(f"{what} that does not decode ({exc})")


def _check_header(head: bytes | memoryview, frame: Frame) -> None:
    """Refuse a frame whose header declares other content than its entry (zstd would allocate what it says)."""
    try:
        declared = zstandard.frame_content_size(head)
    except zstandard.ZstdError:
        raise Damaged("a frame without a valid header") from None
    if declared != frame.size:
        raise Damaged(f"a frame whose header declares {declared} bytes, its table entry {frame.size}")


def _decode_frame(data: bytes | memoryview, frame: Frame) -> bytes:
    """The content of one frame, which must be exactly ``frame.size`` bytes and nothing after: else :class:`Damaged`."""
    if len(data) != frame.stored:
        raise Damaged(f"a frame cut short ({len(data)} of {frame.stored} bytes)")
    _check_header(data[:_HEADER_MAX], frame)
    try:
        out = _decompressor().decompress(data, max_output_size=frame.size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise _zstd_failed(exc, "a frame") from None
    if len(out) != frame.size:
        raise Damaged(f"a frame decoding to {len(out)} bytes, {frame.size} recorded")
    return out


_HEADER_MAX = 18  # the longest zstd frame header


class _Helpers:
    """Daemon threads that decode ahead: one never keeps a process alive, and a forked child makes its own.

    A task is a callable; the threads start on demand, up to ``limit``, and
    wait for work with a timeout, so an idle process holds none for long.
    """

    IDLE = 30.0  # seconds a thread waits for work before it ends

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)
        with self._lock:
            if self._idle > 0 or self._threads >= self._limit:
                return
            self._threads += 1
        threading.Thread(target=self._work, name="adstore-decode", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                task = self._tasks.get(timeout=self.IDLE)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._tasks.empty():
                        self._threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
            try:
                task()
            except BaseException:  # a task reports its own errors; the thread serves the next one
                log.exception("decode helper task failed")


class _Pool(Protocol):
    def submit(self, fn: Callable[[], None], /) -> object: ...


_POOL: _Helpers | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> _Pool:
    """The helper threads that decode ahead (a reader never waits for one to start: see :class:`_Ahead`)."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = _Helpers(os.cpu_count() or 1)
    return _POOL


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()  # a forked child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_pool)

#: Frames a helper may decode ahead of the reader (memory: at most this many frames of content).
AHEAD = 4
#: Longest a helper waits for the reader to take a frame, and a closing reader for the helper's
#: frame (seconds): a reader that stopped reading costs a thread this long at most.
WAIT = 10.0


class _Ahead:
    """The frames of one read, in order, decoded by the reader and by one helper, whichever is free.

    The helper thread decodes the next frames while the caller uses this one
    (hashing it, writing it): with both releasing the GIL, a read costs
    about the larger of the two instead of their sum.  Each frame is claimed
    once.  The helper claims the next unclaimed frame while it is at most
    :data:`AHEAD` frames ahead of the reader; the reader decodes a frame
    nobody claimed itself, so it only ever waits for a frame the helper is
    decoding: a helper that never starts (every thread busy) costs the
    pipelining, never progress.  A helper left waiting by a reader that
    stopped (an iterator dropped unclosed) gives up after :data:`WAIT`.
    """

    def __init__(self, read_at: ReadAt, table: list[Frame]) -> None:
        self._read_at = read_at
        self._table = table
        self._cond = threading.Condition()
        self._next = 0  # the first frame nobody has claimed
        self._taken = 0  # frames the reader has taken
        self._ready: dict[int, bytes | BaseException] = {}
        self._busy = False  # the helper is reading or decoding a frame
        self._stop = False

    def _decode(self, frame: Frame) -> bytes:
        return _decode_frame(self._read_at(frame.offset, frame.stored), frame)

    def chunks(self) -> Generator[bytes, None, None]:
        """Each frame's content in order; :class:`Damaged` at the first bad one.

        When the iterator ends or is closed, the helper no longer reads the file.
        """
        n = len(self._table)
        if n < 2:  # nothing to overlap
            for i in range(n):
                yield self.take(i)
            return
        _pool().submit(self._help)
        try:
            for i in range(n):
                yield self.take(i)
        finally:
            self._close()

    def _close(self) -> None:
        """Stop the helper and wait out (boundedly) the frame it may be reading: the caller closes the file next."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            if self._busy and not self._cond.wait_for(lambda: not self._busy, timeout=WAIT):
                log.warning("a decode helper still reads a frame %gs after its reader stopped", WAIT)

    def _help(self) -> None:
        """The helper's loop (in a pool thread)."""
        while True:
            with self._cond:
                ahead = self._cond.wait_for(lambda: self._stop or self._next - self._taken <= AHEAD, timeout=WAIT)
                if not ahead or self._stop or self._next >= len(self._table):
                    return  # stopped, done, or a reader that no longer reads: it decodes on its own
                i = self._next
                self._next += 1
                self._busy = True
            item: bytes | BaseException
            try:
                item = self._decode(self._table[i])
            except BaseException as exc:  # the reader raises it when it reaches frame i
                item = exc
            with self._cond:
                self._ready[i] = item
                self._busy = False
                self._cond.notify_all()

    def take(self, i: int) -> bytes:
        """Frame ``i``'s content (frames are taken in order)."""
        with self._cond:
            mine = i >= self._next
            if mine:
                self._next = i + 1
            else:
                self._cond.wait_for(lambda: i in self._ready)  # claimed: the helper is decoding it now
                item = self._ready.pop(i)
            self._taken = i + 1
            self._cond.notify_all()
        if mine:
            item = self._decode(self._table[i])
        if isinstance(item, BaseException):
            raise item
        return item


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


class _Region:
    """The frames of a file as a stream zstd reads (``read``), ending where the seek table begins."""

    def __init__(self, read_at: ReadAt, end: int) -> None:
        self._read_at = read_at
        self.pos = 0
        self._end = end

    def read(self, n: int = -1) -> bytes | memoryview:
        n = self._end - self.pos if n < 0 else min(n, self._end - self.pos)
        out = self._read_at(self.pos, n)
        self.pos += len(out)
        return out


def decode_whole(fd: int, size: int) -> bytes:
    """The whole content of the compressed file open at ``fd``: one ``bytes`` of ``size``, nothing more held.

    zstd decodes every frame into that one buffer (a streaming decoder,
    each frame's header first checked against its entry); the frames must
    end exactly where the table begins.  :class:`Damaged` as for
    :func:`frames` and :func:`decode_file`.
    """
    read_at, file_size = _reader(fd)
    table = frames(read_at, file_size, size)
    for frame in table:
        _check_header(read_at(frame.offset, min(frame.stored, _HEADER_MAX)), frame)
    end = table[-1].offset + table[-1].stored if table else 0
    region = _Region(read_at, end)
    try:
        stream = _decompressor().stream_reader(
            cast(IO[bytes], region), read_size=FIRST_FRAME, read_across_frames=True
        )  # zstd only calls read()
        out = stream.read(size) if size else b""
        if len(out) != size or stream.read(1) or region.pos != end:
            raise Damaged(f"frames that decode to more or less than their {size} bytes")
    except zstandard.ZstdError as exc:
        raise _zstd_failed(exc, "frames") from None
    return out


def decode_file(fd: int, size: int | None) -> Generator[bytes, None, None]:
    """The content of the compressed file open at ``fd``, one chunk per frame, decoded ahead (``_Ahead``).

    ``size`` as for :func:`frames`.  The iterator closes its helper when it
    ends or is closed; left unclosed, the helper gives up on its own.
    """
    read_at, file_size = _reader(fd)
    return _Ahead(read_at, frames(read_at, file_size, size)).chunks()
