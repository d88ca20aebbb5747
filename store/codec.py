"""How a blob file is stored: its bytes as they are, or one zstd frame when that pays.

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
* level :data:`LEVEL` (3, zstd's default), a checksum in the frame, and the
  content size in its header (a decoder knows how much to expect).

A read decompresses and hashes in one streaming pass; a frame that fails to
decode, carries a bad checksum, or would decode to more than the recorded
size is damage (cut at the recorded size: a decompression bomb never
allocates past it).  ``zstandard`` is the binding (the reference zstd, the
one bazel-remote and ccache use).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import zstandard

__all__ = [
    "Encoding",
    "LEVEL",
    "MIN_RATIO",
    "SAMPLE_BYTES",
    "ZSTD_MAGIC",
    "choose",
    "compress",
    "FrameWriter",
    "Damaged",
    "decode_chunks",
    "encode_chunks",
    "frame_content_size",
]

#: zstd's default level: about 500 MiB/s to compress snapshot-like data here, and the ratio of
#: level 19 within a few percent for the store's blobs.
LEVEL = 3
#: A blob is compressed when a sample of it shrinks at least this many times (else it stays raw).
MIN_RATIO = 1.5
#: How much of a blob's start decides (the whole blob, when it is smaller): enough to tell a
#: snapshot or an engine from weights, little enough that a download does not wait on it.
SAMPLE_BYTES = 64 << 10
#: The first bytes of every zstd frame.
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_READ = 1 << 20


class Encoding(enum.StrEnum):
    """How a blob's file (or a remote object) holds its bytes."""

    RAW = "raw"
    ZSTD = "zstd"


class Damaged(Exception):
    """A frame that does not decode to the recorded bytes (bad frame, checksum, or too long): damage."""


def _compressor(size: int | None = None) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=LEVEL, write_checksum=True, write_content_size=size is not None)


def choose(sample: bytes | bytearray | memoryview) -> Encoding:
    """The encoding for a blob whose start is ``sample`` (at most :data:`SAMPLE_BYTES` are looked at)."""
    view = memoryview(sample)[:SAMPLE_BYTES]
    if not view.nbytes:
        return Encoding.RAW
    return Encoding.ZSTD if len(_compressor().compress(view)) * MIN_RATIO <= view.nbytes else Encoding.RAW


def compress(data: bytes | bytearray | memoryview) -> bytes:
    """One frame of ``data`` (content size in the header)."""
    view = memoryview(data)
    return _compressor(view.nbytes).compress(view)


class FrameWriter:
    """Compress what is written into one frame, passing the frame's bytes to ``out(chunk)``.

    ``size``, when known, goes into the frame header.  :meth:`finish`
    flushes the frame's end; :attr:`written` counts the frame bytes.
    """

    def __init__(self, out: BinaryIO, size: int | None = None) -> None:
        self._cobj = _compressor(size).compressobj(size=size if size is not None else -1)
        self._out = out
        self.written = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        chunk = self._cobj.compress(data)
        if chunk:
            self._out.write(chunk)
            self.written += len(chunk)
        return memoryview(data).nbytes

    def finish(self) -> None:
        chunk = self._cobj.flush()
        if chunk:
            self._out.write(chunk)
            self.written += len(chunk)


def decode_chunks(src: BinaryIO, limit: int) -> Iterator[bytes]:
    """The content of the one frame read from ``src``, in chunks of at most 1 MiB.

    :class:`Damaged` for a frame that does not decode (a flipped byte, a bad
    checksum, bytes after it) or that would decode to more than ``limit``
    bytes: it is cut there, so a decompression bomb never allocates past
    the recorded size.  A frame cut short decodes to fewer bytes without an
    error: the caller checks the size and the digest, as for any blob.
    """
    reader = zstandard.ZstdDecompressor().stream_reader(src, read_size=_READ)
    total = 0
    try:
        while chunk := reader.read(_READ):
            total += len(chunk)
            if total > limit:
                raise Damaged(f"decodes to more than the {limit} bytes recorded")
            yield chunk
    except zstandard.ZstdError as exc:
        raise Damaged(f"not a valid zstd frame ({exc})") from None


def frame_content_size(head: bytes) -> int:
    """The content size a frame's header records (``head``: its first 18 bytes); -1 when it records none."""
    try:
        size = zstandard.frame_content_size(head)
    except zstandard.ZstdError:
        return -1
    return size if size >= 0 else -1


def encode_chunks(chunks: Iterable[bytes | memoryview], size: int | None = None) -> Iterator[bytes]:
    """One frame of the content ``chunks``, in chunks (for an upload that must send raw content compressed)."""
    cobj = _compressor(size).compressobj(size=size if size is not None else -1)
    for chunk in chunks:
        out = cobj.compress(chunk)
        if out:
            yield out
    yield cobj.flush()
