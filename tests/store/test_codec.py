"""The compressed file layout (``codec``): frames of growing size and a seek table, read back pipelined.

Any zstd decoder reads what the writer wrote; the reader takes the table
apart and refuses, by name, everything that does not add up, before zstd
allocates what a frame claims.
"""

from __future__ import annotations

import io
import os
import random
import signal
import struct
import threading

import pytest
import zstandard

from adstore.store.codec import (
    FIRST_FRAME,
    MAX_FRAME,
    Damaged,
    FrameWriter,
    decode_file,
    decode_whole,
    frame_target,
    frames,
)


def content(size: int, seed: int = 0) -> bytes:
    rnd = random.Random(seed)
    words = [b"node_%d" % i for i in range(300)]
    out = b" ".join(rnd.choices(words, k=size // 6 + 1))
    return out[:size]


def framed(data: bytes, step: int | None = None) -> bytes:
    out = io.BytesIO()
    w = FrameWriter(out)
    step = step or max(1, len(data))
    for i in range(0, len(data), step):
        w.write(data[i : i + step])
    w.finish()
    assert w.written == len(out.getvalue())
    return out.getvalue()


def decoded(blob: bytes, size: int | None, tmp_path) -> bytes:
    path = tmp_path / "blob"
    path.write_bytes(blob)
    fd = os.open(path, os.O_RDONLY)
    try:
        streamed = b"".join(decode_file(fd, size))
        if size is not None:  # the whole-content read agrees
            assert decode_whole(fd, size) == streamed
        return streamed
    finally:
        os.close(fd)


SIZES = [0, 1, FIRST_FRAME - 1, FIRST_FRAME, FIRST_FRAME + 1, 3 * FIRST_FRAME + 7, (3 << 20) + 5, (22 << 20) + 1]


@pytest.mark.parametrize("size", SIZES)
def test_what_is_written_reads_back_and_any_zstd_decoder_reads_it(size, tmp_path):
    data = content(size)
    for step in (None, 100_003):
        blob = framed(data, step)
        assert decoded(blob, size, tmp_path) == data
        assert decoded(blob, None, tmp_path) == data  # a file found without a row: the table's total
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True)
        assert reader.read() == data  # frames and a skippable frame: one stream to zstd itself
        table = frames(lambda o, n, b=blob: b[o : o + n], len(blob), size)
        assert [f.size for f in table] == [
            min(frame_target(i), size - sum(frame_target(j) for j in range(i))) for i in range(len(table))
        ]
        assert all(f.size <= MAX_FRAME for f in table)


def verified(blob: bytes, size: int, tmp_path) -> bytes:
    path = tmp_path / "blob"
    path.write_bytes(blob)
    fd = os.open(path, os.O_RDONLY)
    try:
        return decode_whole(fd, size)
    finally:
        os.close(fd)


def _table_of(blob: bytes) -> tuple[int, list[tuple[int, int]]]:
    n = struct.unpack_from("<I", blob, len(blob) - 9)[0]
    start = len(blob) - 9 - 8 * n - 8
    return start, [struct.unpack_from("<II", blob, start + 8 + 8 * i) for i in range(n)]


def _with_entries(blob: bytes, entries: list[tuple[int, int]]) -> bytes:
    start, _ = _table_of(blob)
    return blob[: start + 8] + b"".join(struct.pack("<II", *e) for e in entries) + blob[-9:]


def test_a_table_that_does_not_add_up_is_damage_named(tmp_path):
    data = content(3 * FIRST_FRAME)
    blob = framed(data)
    _, entries = _table_of(blob)
    (c0, d0), rest = entries[0], entries[1:]
    cases = {
        "frames hold": _with_entries(blob, [(c0, d0 - 1), *rest]),  # total one byte short
        "frames take": _with_entries(blob, [(c0 + 1, d0), *rest]),
        "holding": _with_entries(blob, [(c0, MAX_FRAME + 1), *rest]),
        "no seek table": zstandard.ZstdCompressor().compress(data),  # one frame, no table
        "more than a file": blob[:-9] + struct.pack("<IBI", 1 << 30, 0, 0x8F92EAB1),
        "frame header": blob[: -9 - 8 * len(entries) - 8] + b"\0" * 8 + blob[-9 - 8 * len(entries) :],
    }
    for words, bad in cases.items():
        with pytest.raises(Damaged, match=words):
            decoded(bad, len(data), tmp_path)
        with pytest.raises(Damaged, match=words):
            verified(bad, len(data), tmp_path)


def test_a_frame_declaring_more_than_its_entry_is_refused_before_zstd_allocates(tmp_path):
    size = FIRST_FRAME
    bomb = zstandard.ZstdCompressor(level=3).compress(b"\0" * (1 << 30))  # 1 GiB in about 40 KiB
    table = struct.pack("<II", 0x184D2A5E, 8 + 9) + struct.pack("<II", len(bomb), size)
    blob = bomb + table + struct.pack("<IBI", 1, 0, 0x8F92EAB1)
    with pytest.raises(Damaged, match=f"header declares 1073741824 bytes, its table entry {size}"):
        decoded(blob, size, tmp_path)
    hidden = zstandard.ZstdCompressor(level=3, write_content_size=False)
    quiet = hidden.compress(b"\0" * (size * 4))
    blob = quiet + struct.pack("<II", 0x184D2A5E, 17) + struct.pack("<II", len(quiet), size)
    blob += struct.pack("<IBI", 1, 0, 0x8F92EAB1)
    with pytest.raises(Damaged, match="header declares"):
        decoded(blob, size, tmp_path)


def test_a_flipped_byte_in_any_frame_is_damage(tmp_path):
    data = content(5 * FIRST_FRAME, 3)
    blob = framed(data)
    start, entries = _table_of(blob)
    offset = 0
    for stored, _ in entries:
        at = offset + stored // 2
        bad = blob[:at] + bytes([blob[at] ^ 0x10]) + blob[at + 1 :]
        for read in (decoded, verified):
            try:
                got = read(bad, len(data), tmp_path)
            except Damaged:
                pass
            else:
                raise AssertionError(f"a flip at {at} decoded to {'the same' if got == data else 'other'} bytes")
        offset += stored
    assert offset == start


def test_concurrent_readers_each_get_their_bytes(tmp_path):
    blobs = {i: content((2 << 20) + i, i) for i in range(6)}
    paths = {}
    for i, data in blobs.items():
        paths[i] = tmp_path / f"b{i}"
        paths[i].write_bytes(framed(data))
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            for _ in range(5):
                fd = os.open(paths[i], os.O_RDONLY)
                try:
                    assert b"".join(decode_file(fd, len(blobs[i]))) == blobs[i]
                    assert decode_whole(fd, len(blobs[i])) == blobs[i]
                finally:
                    os.close(fd)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(i,)) for i in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_forked_child_reads_with_helper_threads_of_its_own(tmp_path):
    data = content(2 << 20, 9)
    path = tmp_path / "b"
    path.write_bytes(framed(data))
    assert decoded(path.read_bytes(), len(data), tmp_path) == data  # the parent's helper threads exist now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(60)  # a child waiting on the parent's threads would hang: it dies instead
        try:
            fd = os.open(path, os.O_RDONLY)
            ok = b"".join(decode_file(fd, len(data))) == data
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_read_completes_when_no_helper_thread_is_free(tmp_path, monkeypatch):
    """Every pool thread busy: the reader decodes every frame itself; the helper, once it starts, finds none left."""
    from concurrent.futures import ThreadPoolExecutor

    from adstore.store import codec

    data = content(3 << 20, 4)
    busy = ThreadPoolExecutor(max_workers=1)
    release = threading.Event()
    busy.submit(release.wait)
    monkeypatch.setattr(codec, "_pool", lambda: busy)
    try:
        assert decoded(framed(data), len(data), tmp_path) == data
    finally:
        release.set()
        busy.shutdown()
