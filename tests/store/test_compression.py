"""Compressed blobs: a blob file holds its content raw or as zstd frames with a seek table, decided per blob.

Round trips of compressible, incompressible, empty and boundary-size blobs
through every way in and out; damage to a compressed file (a flipped byte, a
cut, frames of other bytes, a decompression bomb, a damaged or missing seek
table) is a named miss, ``verify``
finds it and ``--fix`` repairs; a store written before compression (raw
files, an older schema) keeps working beside compressed blobs through
``verify --fix``, a rebuild from the records and eviction; budgets count
the bytes on disk.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import shutil
import stat
import struct

import pytest
import zstandard
from store_helpers import save

from adstore.store import ChecksumMismatch, Store
from adstore.store.codec import SAMPLE_BYTES, FrameWriter
from adstore.store.index.rows import BLOB_ROW

INLINE = 64 << 10


def compressible(size: int, seed: int = 0) -> bytes:
    """Text-like bytes (a graph dump compresses about like this): lines drawn from a few thousand."""
    rnd = random.Random(seed)
    words = [bytes(rnd.choice(b"abcdefghijklmnop") for _ in range(rnd.randint(3, 9))) for _ in range(200)]
    lines = [
        b'{"op": "%s", "target": "%s", "args": [%d]}\n' % (rnd.choice(words), rnd.choice(words), i) for i in range(4000)
    ]
    out = b"".join(rnd.choices(lines, k=size // 30 + 1))
    while len(out) < size:
        out += out
    return out[:size]


def row_of(store: Store, digest: str):
    with store._tables.read() as t:
        return t.blob_row(digest)


def file_of(store: Store, digest: str):
    return store.root / "blobs" / digest[:2] / digest


CASES = {
    "empty": b"",
    "inline, compressible": compressible(INLINE - 1),
    "at the inline threshold, compressible": compressible(INLINE),
    "at the sample size, compressible": compressible(SAMPLE_BYTES + 1, 1),
    "compressible, several chunks": compressible(9 << 20, 2),
    "incompressible": os.urandom(300_000),
    "compressible head, random tail": compressible(SAMPLE_BYTES, 3) + os.urandom(200_000),
}


@pytest.mark.parametrize("how", ["bytes", "file", "stream"])
@pytest.mark.parametrize("name", list(CASES))
def test_round_trips_return_the_original_bytes(name, how, store, tmp_path):
    data = CASES[name]
    if how == "bytes":
        ref = store.put_bytes(data)
    elif how == "file":
        (tmp_path / "src").write_bytes(data)
        ref = store.put_file(tmp_path / "src")
    else:
        ref = store.put_stream(data[i : i + 100_000] for i in range(0, len(data), 100_000))
    assert ref.digest == hashlib.sha256(data).hexdigest() and ref.size == len(data)
    assert store.get_bytes(ref) == data
    store.copy_blob_to(ref, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == data
    row = row_of(store, ref.digest)
    if len(data) < INLINE:
        assert row.inline and not row.compressed  # small blobs stay raw in the index
    else:
        assert row.compressed == (name != "incompressible")
        assert row.stored == file_of(store, ref.digest).stat().st_size
        if row.compressed:
            assert row.stored * 5 < row.size or name == "compressible head, random tail"
    assert store.put_bytes(data) == ref  # deduplicated whatever the encoding
    assert store.verify().ok


def framed(content: bytes) -> bytes:
    """A valid compressed blob file of ``content`` (frames and seek table)."""
    out = io.BytesIO()
    w = FrameWriter(out)
    w.write(content)
    w.finish()
    return out.getvalue()


def _damage(path, how: str, size: int) -> None:
    os.chmod(path, 0o644)
    frame = path.read_bytes()
    if how == "flip":
        frame = frame[: len(frame) // 2] + bytes([frame[len(frame) // 2] ^ 0x40]) + frame[len(frame) // 2 + 1 :]
    elif how == "cut":
        frame = frame[: len(frame) // 2]
    elif how == "other":  # valid frames of other bytes, as long as the recorded content
        frame = framed(compressible(size, 99))
    elif how == "bomb":  # a table entry of the recorded size whose frame decodes to far more
        bomb = zstandard.ZstdCompressor(level=3).compress(b"\0" * (size + (64 << 20)))
        frame = bomb + framed(b"x" * size)[-(8 + 8 + 9) :]  # one entry, sizes patched below
        frame = frame[: len(bomb) + 8] + struct.pack("<II", len(bomb), size) + frame[-9:]
    elif how == "table":  # the seek table's last entry claims one byte more
        at = len(frame) - 9 - 4
        frame = frame[:at] + struct.pack("<I", struct.unpack_from("<I", frame, at)[0] + 1) + frame[at + 4 :]
    elif how == "one frame":  # one zstd frame without a seek table
        frame = zstandard.ZstdCompressor(level=3).compress(compressible(size, 5))
    path.write_bytes(frame)


@pytest.mark.parametrize("how", ["flip", "cut", "other", "bomb", "table", "one frame"])
def test_a_damaged_frame_is_a_named_miss_found_by_verify_and_repaired(how, store):
    data = compressible(2 << 20, 5)
    ref = store.put_bytes(data)
    gen = store.new_generation()
    store.publish("k", generation=gen, artifacts={"a": ref})
    store.commit("k", generation=gen)
    assert row_of(store, ref.digest).compressed
    _damage(file_of(store, ref.digest), how, len(data))
    stored = file_of(store, ref.digest).stat().st_size
    row = row_of(store, ref.digest)
    if stored != row.stored:  # a damaged length is a miss at lookup already
        assert store.lookup("k").reason == "blob_missing"
    else:
        res = store.lookup("k")
        assert res.hit
        with pytest.raises(ChecksumMismatch):
            store.read_artifact(res.manifest, "a")  # never the wrong bytes, never the bomb's
    report = store.verify()
    assert not report.ok
    assert {f.kind for f in report.findings} & {"checksum", "blob_missing", "quarantined"}
    assert store.verify(fix=True).ok and store.verify().ok
    assert store.lookup("k").reason in ("absent", "blob_missing")
    assert store.put_bytes(data) == ref and store.get_bytes(ref) == data  # the next writer repairs it


def test_inline_blobs_stay_raw_and_a_small_get_reads_one_row(store):
    data = compressible(32 << 10)
    ref = store.put_bytes(data)
    row = row_of(store, ref.digest)
    assert row.inline and not row.compressed and row.stored == len(data)
    assert store.get_bytes(ref) == data


def _as_schema_4(store: Store) -> None:
    """Rewrite the index as schema 4 left it: blob rows without their stored size (every blob raw)."""
    old = struct.Struct("<QqdB")
    with store.index.env.begin(write=True) as txn:
        blobs = store.index.db["blobs"]
        for k, v in list(txn.cursor(db=blobs)):
            size, refs, touched, flags, _stored = BLOB_ROW.unpack(v)
            assert not flags & 4, "a schema 4 store has no compressed blob"
            txn.put(bytes(k), old.pack(size, refs, touched, flags), db=blobs)
        txn.put(b"schema", b"4", db=store.index.db["meta"])


def test_a_store_written_before_compression_keeps_working_beside_new_blobs(store_root, clock, monkeypatch):
    from adstore.store import blobwriter, codec

    old_data = {f"old{i}": compressible(300_000, 10 + i) for i in range(3)}
    with monkeypatch.context() as m:  # an adstore that stored every blob raw
        m.setattr(blobwriter, "choose", lambda sample: codec.Encoding.RAW)
        with Store.open(store_root, grace_period=0.0, clock=clock) as store:
            for key, data in old_data.items():
                gen = store.new_generation()
                store.publish(key, generation=gen, artifacts={"a": store.put_bytes(data)})
                store.commit(key, generation=gen)
            _as_schema_4(store)
    with Store.open(store_root, grace_period=0.0, clock=clock) as store:  # upgraded in place
        new_data = {f"new{i}": compressible(300_000, 20 + i) for i in range(3)}
        for key, data in new_data.items():
            gen = store.new_generation()
            store.publish(key, generation=gen, artifacts={"a": store.put_bytes(data)})
            store.commit(key, generation=gen)
        rows = {k: row_of(store, store.lookup(k).manifest.artifacts["a"].digest) for k in [*old_data, *new_data]}
        assert [rows[k].compressed for k in old_data] == [False] * 3 and all(rows[k].compressed for k in new_data)
        assert store.verify(fix=True).ok
        for key, data in {**old_data, **new_data}.items():
            assert store.read_artifact(store.lookup(key).manifest, "a") == data
        st = store.stats()
        assert st.content_bytes == 6 * 300_000 and st.physical_bytes < 4 * 300_000
    shutil.rmtree(store_root / "index")  # a lost index: rebuilt from the blob files and the records
    (store_root / "index").mkdir()
    (store_root / "index" / "data.mdb").write_bytes(b"not an index")
    assert Store.repair_index(store_root) is not None
    with Store.open(store_root, grace_period=0.0, clock=clock) as store:
        for key, data in {**old_data, **new_data}.items():
            assert store.read_artifact(store.lookup(key).manifest, "a") == data
        assert store.verify().ok
        clock.advance(10)
        plan = store.plan_eviction(max_size=0)
        assert plan.bytes_to_free == store.size() and plan.execute() == plan.bytes_to_free
        assert store.size() == 0 and store.stats().content_bytes == 0 and store.verify().ok


def test_budgets_count_bytes_on_disk(store_root, clock):
    """Twice the budget in content fits when it compresses; the same in raw bytes is evicted down to it."""
    from adstore.daemon import DaemonConfig
    from adstore.daemon.enforce import Enforcer

    budget = 2 << 20
    with Store.open(store_root, grace_period=0.0, clock=clock) as store:
        for i in range(8):
            save_blob(store, f"z{i}", compressible(512 << 10, 30 + i))  # 4 MiB of content
        clock.advance(10)
        assert store.stats().content_bytes >= 2 * budget > budget > store.size()
        cfg = DaemonConfig.from_mapping(
            {"max_size": budget, "high_watermark": 0.9, "low_watermark": 0.7, "grace_period": 0}
        )
        assert Enforcer(store, cfg).run_pass().evicted_entries == 0
        for i in range(8):
            save_blob(store, f"r{i}", os.urandom(512 << 10))
        clock.advance(10)
        result = Enforcer(store, cfg).run_pass()
        assert result.evicted_entries > 0 and store.size() <= 0.7 * budget
        assert store.verify().ok


def save_blob(store: Store, key: str, data: bytes) -> None:
    gen = store.new_generation()
    store.publish(key, generation=gen, artifacts={"a": store.put_bytes(data)})
    store.commit(key, generation=gen)


def test_blob_files_stay_read_only(store):
    ref = store.put_bytes(compressible(1 << 20))
    assert stat.S_IMODE(file_of(store, ref.digest).stat().st_mode) == 0o444
    assert save(store, "k") > 0
