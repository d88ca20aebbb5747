"""The one read path (``reading``) as its callers see it: memory held by a get, a download's commit.

A verified get of a compressed blob holds its content once (zstd decodes
into the buffer returned), not the frames and a joined copy.  The commit of
a download that arrived compressed reads the temp file through the
writer's own descriptor: a sweep that takes the file meanwhile is the
store's ``Swept``, never a raw ``FileNotFoundError``.
"""

from __future__ import annotations

import hashlib
import io
import random
import tracemalloc

import pytest

from adstore.store import Store
from adstore.store.blobs import Swept
from adstore.store.codec import Encoding, FrameWriter
from adstore.store.index.rows import BlobRef


def compressible(size: int, seed: int = 0) -> bytes:
    rnd = random.Random(seed)
    words = [b"node_%d(" % i for i in range(2000)]
    return b" ".join(rnd.choices(words, k=size // 8 + 1))[:size]


def framed(data: bytes) -> bytes:
    out = io.BytesIO()
    w = FrameWriter(out)
    w.write(data)
    w.finish()
    return out.getvalue()


def test_a_verified_get_of_a_compressed_blob_holds_its_content_once(tmp_path):
    size = 16 << 20
    with Store.open(tmp_path / "s") as store:
        ref = store.put_bytes(compressible(size))
        stored = store.stored_blob(ref)
        assert stored is not None and stored.encoding is Encoding.ZSTD
        tracemalloc.start()
        try:
            data = store.get_bytes(ref)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert hashlib.sha256(data).hexdigest() == ref.digest
        del data
        assert peak < size * 1.25, f"peak {peak / size:.2f}x the content"


def test_a_compressed_download_whose_temp_file_is_swept_before_its_commit_is_swept(tmp_path):
    data = compressible(600_000, 1)
    frames = framed(data)
    with Store.open(tmp_path / "s", grace_period=0.0) as store:
        ref = BlobRef(hashlib.sha256(data).hexdigest(), len(data))
        with store.blob_writer(ref, source=Encoding.ZSTD, frame_size=len(frames)) as w:
            w.write(frames)
            for temp in (tmp_path / "s" / "tmp").iterdir():  # what a sweep with no grace period does
                temp.unlink()
            with pytest.raises(Swept):
                w.commit()
        assert not store.has_blob(ref)
        ref2 = store.put_bytes(data)  # written again, it is stored
        assert ref2 == ref and store.get_bytes(ref) == data
