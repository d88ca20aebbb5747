"""Compressed blobs on the remote: frames travel as they are stored on S3, raw on the Bazel HTTP protocol.

A blob the writer's store keeps as a zstd frame goes up as that frame
(``zcas/<sha256>``) where the remote takes frames (S3, the memory backend),
and its record says so (``stored``, format 2); over the Bazel HTTP protocol
every blob travels raw under ``cas/``, as Bazel clients expect.  A reader
gets the same bytes either way; one that cannot read format 2 misses
without asking for a blob; a damaged frame is a miss that commits nothing.
"""

from __future__ import annotations

import hashlib
import os
import random
import uuid

import pytest
import zstandard

from adstore.store import Store
from adstore.store.records import format as record_format
from adstore.store.remote import Kind, open_remote, record_address
from adstore.store.tiered import remote_restore, remote_save


def compressible(size: int, seed: int = 0) -> bytes:
    rnd = random.Random(seed)
    lines = [
        b'{"op": "call", "target": "aten.op_%d", "args": ["x%d"]}\n' % (rnd.randint(0, 50), i) for i in range(3000)
    ]
    return b"".join(rnd.choices(lines, k=size // 40 + 1))[:size]


BLOBS = {"module.pt": compressible(1 << 20), "weights.bin": os.urandom(300_000), "hooks.json": b'{"hooks": []}'}


@pytest.fixture(params=["s3", "http", "memory"])
def url(request):
    return request.getfixturevalue(f"{request.param}_url"), request.param


def _push(tmp_path, url: str, signer, key: str) -> Store:
    store = Store(tmp_path / "writer")
    refs = {name: store.put_bytes(data) for name, data in BLOBS.items()}
    gen = store.new_generation()
    store.publish(key, generation=gen, artifacts=refs)
    store.commit(key, generation=gen)
    assert remote_save(store, open_remote(url, mode="read-write", signer=signer), key).ok
    return store


def test_frames_travel_as_stored_where_the_remote_takes_them(url, signer, trusted, tmp_path):
    url, kind = url
    key = f"k-{uuid.uuid4().hex[:8]}"
    writer = _push(tmp_path, url, signer, key)
    reader = open_remote(url, trusted=trusted)
    record = reader.fetch_record(key, 0)
    frames = kind != "http"
    big = hashlib.sha256(BLOBS["module.pt"]).hexdigest()
    assert record.value.payload["format"] == (2 if frames else 1)
    assert ("stored" in record.value.payload) == frames
    assert (reader.head(Kind.ZCAS, big).value is not None) == frames  # zcas/ only where frames travel
    assert (reader.head(Kind.CAS, big).value == len(BLOBS["module.pt"])) == (not frames)  # cas/: raw, always
    with Store(tmp_path / "reader") as store:
        out = remote_restore(store, reader, key, 0, 1)
        assert out.ok, out
        for name, data in BLOBS.items():
            assert store.read_artifact(out.value, name) == data
        logical = sum(len(d) for d in BLOBS.values())
        if frames:
            assert out.nbytes < logical - len(BLOBS["module.pt"]) * 0.8  # the big blob moved compressed
        else:
            assert out.nbytes >= logical
        assert store.stored_blob(big).encoding == "zstd"  # compressed locally, whatever the transfer
        assert store.verify().ok
    writer.close()


def test_a_reader_of_format_1_misses_a_record_of_frames_without_asking_for_blobs(
    s3_url, signer, trusted, tmp_path, monkeypatch
):
    key = f"k-{uuid.uuid4().hex[:8]}"
    _push(tmp_path, s3_url, signer, key).close()
    monkeypatch.setattr(record_format, "RECORD_FORMAT", 1)  # an adstore from before compressed blobs
    reader = open_remote(s3_url, trusted=trusted)
    with Store(tmp_path / "reader") as store:
        out = remote_restore(store, reader, key, 0, 1)
        assert out.reason == "remote_unsupported"
        assert reader.counters.get("calls.get", 0) == 1  # the record, and no blob
        assert store.manifests(key) == []


@pytest.mark.parametrize("damage", ["flip", "bomb", "other"])
def test_a_damaged_frame_on_the_remote_is_a_miss_that_commits_nothing(damage, memory_url, signer, trusted, tmp_path):
    key = f"k-{uuid.uuid4().hex[:8]}"
    _push(tmp_path, memory_url, signer, key).close()
    reader = open_remote(memory_url, trusted=trusted)
    big = hashlib.sha256(BLOBS["module.pt"]).hexdigest()
    name = f"zcas/{big}"
    frame = reader.backend.objects[name]
    if damage == "flip":
        frame = frame[:100] + bytes([frame[100] ^ 1]) + frame[101:]
    elif damage == "bomb":  # decodes far past the recorded size, within the recorded frame size
        frame = zstandard.ZstdCompressor(level=19).compress(b"\0" * (200 << 20))[: len(frame)]
    else:
        frame = zstandard.ZstdCompressor(level=3).compress(compressible(1 << 20, 7))[: len(frame)]
    reader.backend.objects[name] = frame
    with Store(tmp_path / "reader") as store:
        out = remote_restore(store, reader, key, 0, 1)
        assert out.reason == "remote_checksum", out
        assert store.manifests(key) == [] and not store.has_blob(big)
        assert list((store.root / "tmp").iterdir()) == []


def test_the_record_names_the_frame_sizes_it_admits(memory_url, signer, trusted, tmp_path):
    """Admission counts what will be downloaded: the frame for a compressed blob."""
    key = f"k-{uuid.uuid4().hex[:8]}"
    _push(tmp_path, memory_url, signer, key).close()
    reader = open_remote(memory_url, trusted=trusted)
    payload = reader.fetch_record(key, 0).value.payload
    big = hashlib.sha256(BLOBS["module.pt"]).hexdigest()
    encoding, size = payload["stored"][big]
    assert encoding == "zstd" and size == len(reader.backend.objects[f"zcas/{big}"]) < len(BLOBS["module.pt"]) / 4
    assert record_address(key, 0) and payload["artifacts"]["module.pt"] == [big, len(BLOBS["module.pt"])]
