"""Hostile seek tables cost a reader bounded work, and a partly read file never keeps a process alive.

A table is believed only where it matches the layout the writer produces
(every frame but the last holds :func:`frame_target` bytes, so the count
follows from the size): a table that claims one frame per content byte, or
millions of entries, is refused from its footer, before its entries are
read or anything is allocated for them.  A frame's stored size is bounded
by zstd's worst case for its content, and a frame followed by junk is
refused as ``zstd -t`` refuses it.  Work is measured in bytes read and
traced allocations, never in seconds.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
import zstandard

from adstore.store.codec import FIRST_FRAME, Damaged, FrameWriter, decode_file, frames

_SKIPPABLE = 0x184D2A5E
_SEEKABLE = 0x8F92EAB1


def content(size: int, seed: int = 0) -> bytes:
    rnd = random.Random(seed)
    words = [b"node_%d" % i for i in range(300)]
    return b" ".join(rnd.choices(words, k=size // 6 + 1))[:size]


def framed(data: bytes) -> bytes:
    out = io.BytesIO()
    w = FrameWriter(out)
    w.write(data)
    w.finish()
    return out.getvalue()


def table(body: bytes, n: int) -> bytes:
    return struct.pack("<II", _SKIPPABLE, len(body) + 9) + body + struct.pack("<IBI", n, 0, _SEEKABLE)


def per_byte(n: int) -> bytes:
    """A file of ``n`` bytes of frames and a table of ``n`` entries, each one byte holding one byte."""
    return random.Random(n).randbytes(n) + table(struct.pack("<II", 1, 1) * n, n)


class Counted:
    """``read_at`` over bytes, counting what is asked for."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.read = 0

    def __call__(self, offset: int, n: int) -> bytes:
        self.read += n
        return self.blob[offset : offset + n]


def refused(blob: bytes, size: int | None, match: str | None = None) -> tuple[int, int]:
    """Bytes read and traced peak allocation while ``frames`` refuses ``blob``."""
    read_at = Counted(blob)
    tracemalloc.start()
    try:
        with pytest.raises(Damaged, match=match):
            frames(read_at, len(blob), size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return read_at.read, peak


@pytest.mark.parametrize("n", [1 << 20, 2 << 20])  # 2 Mi entries: a huge count that fits the file
def test_a_table_claiming_one_frame_per_byte_is_refused_from_its_footer(n):
    blob = per_byte(n)
    read, peak = refused(blob, n, "frames")
    assert read <= 64  # the footer (and at most the table's frame header): never the entries
    assert peak < 64 << 10


@pytest.mark.parametrize("n", [1 << 20, 2 << 20])
def test_without_a_recorded_size_a_lying_table_is_refused_at_its_first_lie(n):
    """A rebuild knows no size: the table is read (that much is the reading), nothing is built from it."""
    blob = per_byte(n)
    read, peak = refused(blob, None)
    assert read <= 8 * n + 64
    assert peak < 8 * n + (256 << 10)  # the table's bytes, and not a frame object per entry


def test_a_table_of_other_frame_sizes_is_refused():
    """Sizes that add up, split otherwise than the writer splits (one frame where it writes three)."""
    data = content(3 * FIRST_FRAME, 1)
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True).compress(data)
    blob = frame + table(struct.pack("<II", len(frame), len(data)), 1)
    for size in (len(data), None):
        refused(blob, size)


def _junk_after_frame(junk: int) -> tuple[bytes, int]:
    data = content(FIRST_FRAME, 2)
    frame = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True).compress(data)
    region = frame + random.Random(junk).randbytes(junk)
    return region + table(struct.pack("<II", len(region), len(data)), 1), len(data)


def test_a_frame_stored_larger_than_zstds_worst_case_is_refused_unread():
    blob, size = _junk_after_frame(1 << 20)
    for given in (size, None):
        read, _ = refused(blob, given, "worst case")
        assert read <= 64


@pytest.mark.parametrize("junk", [1, 16, 4096])
def test_a_frame_followed_by_junk_is_damage_as_zstd_t_says(junk, tmp_path):
    blob, size = _junk_after_frame(junk)
    path = tmp_path / "blob.zst"
    path.write_bytes(blob)
    if shutil.which("zstd"):  # the reference tool refuses the same file
        assert subprocess.run(["zstd", "-q", "-t", str(path)], capture_output=True).returncode != 0
    for given in (size, None):
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(Damaged):
                for _ in decode_file(fd, given):
                    pass
        finally:
            os.close(fd)


HOLDER = textwrap.dedent(
    """
    import os, sys
    from adstore.store.codec import decode_file

    fd = os.open(sys.argv[1], os.O_RDONLY)

    def read_a_little():
        chunks = decode_file(fd, int(sys.argv[2]))
        next(chunks)  # the helper decodes ahead until it is AHEAD frames in front, then waits
        raise RuntimeError("a failure while reading")

    try:
        read_a_little()
    except RuntimeError as exc:
        KEPT = exc  # its traceback holds the partly read iterator until the interpreter ends
    print("exiting", flush=True)
    """
)


def test_a_partly_read_file_held_by_a_traceback_does_not_keep_the_process_alive(tmp_path: Path):
    data = content(16 * FIRST_FRAME, 5)  # 16 frames: more than the helper may decode ahead
    path = tmp_path / "b"
    path.write_bytes(framed(data))
    res = subprocess.run(
        [sys.executable, "-c", HOLDER, str(path), str(len(data))], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "exiting"
