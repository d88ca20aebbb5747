"""The store's contract, blobs: write, read, dedup, digests, and damaged blobs as misses."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest
from store_helpers import check_hit, payload, save

from adstore.store import BlobMissing, BlobRef, ChecksumMismatch, InvalidDigest, StoreError


@pytest.mark.parametrize("size", [0, 1, 1000, 65_535, 65_536, 300_000])
def test_put_get_bytes_roundtrip(store, size):
    data = os.urandom(size)
    ref = store.put_bytes(data)
    assert ref == BlobRef(hashlib.sha256(data).hexdigest(), size)
    assert store.get_bytes(ref) == data
    assert store.has_blob(ref.digest)
    path = store.blob_path(ref)
    if size >= store.inline_threshold:
        assert path is not None and path.parent.name == ref.digest[:2]
        assert stat.S_IMODE(path.stat().st_mode) == 0o444
    else:
        assert path is None


def test_put_file_and_stream(store, tmp_path):
    data = os.urandom(3 << 20)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    ref1 = store.put_file(src)
    ref2 = store.put_stream(data[i : i + 100_000] for i in range(0, len(data), 100_000))
    assert ref1 == ref2
    dest = tmp_path / "copy.bin"
    store.copy_blob_to(ref1, dest)
    assert dest.read_bytes() == data
    assert not list((store.root / "tmp").iterdir())


def test_dedup_costs_no_write(store):
    data = os.urandom(100_000)
    store.put_bytes(data)
    before = store.stats().counters
    for _ in range(3):
        store.put_bytes(data)
    after = store.stats().counters
    assert after["bytes_written"] == before["bytes_written"]
    assert after["bytes_deduplicated"] == before.get("bytes_deduplicated", 0) + 300_000
    assert store.size() == 100_000


@pytest.mark.parametrize("bad", ["", "abc", "../" * 21 + "etc", "G" * 64, "A" * 64, None, 123])
def test_bad_digests_are_refused_before_any_path_join(store, bad):
    with pytest.raises(InvalidDigest):
        store.get_bytes(bad)
    with pytest.raises(InvalidDigest):
        store.blob_path(bad)


def test_corrupt_blob_is_quarantined_and_repaired(store):
    save(store, "k")
    m = store.lookup("k").manifest
    big = m.artifacts["a1"]
    path = store.blob_path(big)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumMismatch) as exc:
        store.read_artifact(m, "a1")
    assert exc.value.expected == big.digest and exc.value.got != big.digest
    assert list((store.root / "quarantine").iterdir())
    assert store.lookup("k").reason == "blob_missing"
    # The next writer of the same content repairs the blob.
    store.put_bytes(payload("k", m.generation, 0, "a1", 70_000))
    assert check_hit(store, "k")


def test_truncated_blob_is_a_miss(store):
    save(store, "k")
    m = store.lookup("k").manifest
    path = store.blob_path(m.artifacts["a1"])
    os.chmod(path, 0o644)
    os.truncate(path, 10)
    assert store.lookup("k").reason == "blob_missing"  # size check, no read needed
    with pytest.raises(ChecksumMismatch):
        store.get_bytes(m.artifacts["a1"])


def test_missing_blob_file_is_a_miss(store):
    save(store, "k")
    m = store.lookup("k").manifest
    os.unlink(store.blob_path(m.artifacts["a1"]))
    assert store.lookup("k").reason == "blob_missing"
    with pytest.raises(BlobMissing):
        store.read_artifact(m, "a1")


def test_corrupt_inline_blob_is_a_checksum_mismatch(store):
    save(store, "k")
    ref = store.lookup("k").manifest.artifacts["a0"]  # 100 bytes: inline in LMDB
    key = bytes.fromhex(ref.digest)
    with store.index.env.begin(write=True) as txn:
        data = bytearray(txn.get(key, db=store.index.db["blobdata"]))
        data[50] ^= 0x40
        txn.put(key, bytes(data), db=store.index.db["blobdata"])
    with pytest.raises(ChecksumMismatch):
        store.get_bytes(ref)
    assert store.lookup("k").reason == "blob_missing"
    assert any(p.name.startswith(ref.digest) for p in (store.root / "quarantine").iterdir())
    # The on-disk record carries the inline bytes: verify --fix restores the entry whole (invariant 9).
    assert store.verify(fix=True).ok and store.lookup("k").hit
    assert hashlib.sha256(store.get_bytes(ref)).hexdigest() == ref.digest


def test_a_temp_swept_before_its_rename_is_written_again_or_a_clear_error(store, monkeypatch):
    """With a zero grace period, a concurrent sweep may take a temp file still being written.

    Simulated at the real rename: the temp is unlinked just before it.
    """
    import adstore.store.blobs as blobs_mod

    real = blobs_mod.publish_temp
    swept: list[str] = []

    def sweep_first(tmp, dest, **kw):
        if not swept:
            swept.append(tmp.name)
            tmp.unlink()
        return real(tmp, dest, **kw)

    monkeypatch.setattr(blobs_mod, "publish_temp", sweep_first)
    data = os.urandom(100_000)
    ref = store.put_bytes(data)  # a file blob: written again
    assert swept and store.get_bytes(ref) == data
    swept.clear()
    with pytest.raises(StoreError, match="swept while being stored"):
        store.put_stream([os.urandom(100_000)])  # a stream cannot be replayed
    assert list((store.root / "tmp").iterdir()) == []
    assert store.verify().ok
