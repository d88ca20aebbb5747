"""Eviction in batches: exact refcounts after every batch, the write count, and the upgrade from owed references.

An eviction pass removes victims batch by batch; each batch releases the
references its manifests held in its own transaction, so refcounts equal the
manifests after every batch (``verify`` between batches).  A batch takes its
victims as planned only while the index's write count says nobody else
wrote; after a foreign write, it and every later batch read their victims
again.  An index written when eviction owed references (schema 3) is
upgraded when opened: the owed references are released and the table goes.
"""

from __future__ import annotations

import os
import struct

import lmdb
from store_helpers import save

from adstore.store import Store
from adstore.store.index.rows import BLOB_ROW
from adstore.store.index.schema import SCHEMA_VERSION, WRITES

SHARED = [os.urandom(5000) for _ in range(3)]
#: A blob row of schema 4 and earlier (size, refcount, last put, flags).
OLD_ROW = struct.Struct("<QqdB")


def _refs(store: Store, digest: str) -> int | None:
    with store._tables.read() as t:
        row = t.blob_row(digest)
        return None if row is None else row.refs


def _writes(store: Store) -> int:
    with store._tables.read() as t:
        return t.writes()


def _fill(store: Store, n: int) -> None:
    """Entries ``e00``.. over three shared blobs: an entry's references are rarely a blob's last."""
    for i in range(n):
        save(store, f"e{i:02d}", sizes=(), shared=SHARED[i % 3])


def test_every_batch_releases_its_references_and_leaves_a_sound_store(store, clock):
    _fill(store, 12)
    shared = [store.put_bytes(b).digest for b in SHARED]
    assert [_refs(store, d) for d in shared] == [4, 4, 4]
    clock.advance(1)
    plan = store.plan_eviction(max_size=1)
    seen: list[tuple[bool, list[int | None]]] = []
    plan.execute(
        batch_size=2, on_batch=lambda batch: seen.append((store.verify().ok, [_refs(store, d) for d in shared]))
    )
    assert store.stats().entries == 0 and store.stats().blobs == 0
    # e00, e01 hold blobs 0 and 1, e02, e03 blobs 2 and 0, ...: each batch takes one reference from two blobs.
    assert [refs for _, refs in seen] == [[3, 3, 4], [2, 3, 3], [2, 2, 2], [1, 1, 2], [None, 1, 1], [None, None, None]]
    assert all(ok for ok, _ in seen)


def test_a_pass_nobody_interrupts_counts_one_write_per_batch(store, clock):
    """Unlinking files after a batch holds the write lock but writes no row: it is not counted."""
    for i in range(6):
        save(store, f"k{i}", sizes=(70_000,))
    clock.advance(1)
    plan = store.plan_eviction(max_size=1)
    before = _writes(store)
    plan.execute(batch_size=2)
    assert store.stats().entries == 0
    assert _writes(store) - before == 3


def test_a_foreign_write_between_batches_makes_every_later_batch_recheck(store_root, clock):
    with (
        Store.open(store_root, grace_period=0.0, clock=clock) as store,
        Store.open(store_root, grace_period=0.0, clock=clock, flush_interval=3600) as other,
    ):
        for i in range(6):
            save(store, f"k{i}", sizes=(300,))
        clock.advance(1)
        plan = store.plan_eviction(max_size=1)
        assert [e.key for e in plan.victims] == [f"k{i}" for i in range(6)]
        done: list[tuple[str, ...]] = []

        def between(batch) -> None:
            done.append(batch.keys)
            if len(done) == 1:  # after the first batch: k5 is used, its access row written by another store
                clock.advance(1)
                assert other.lookup("k5").hit
                other.flush()

        plan.execute(batch_size=2, on_batch=between)
        assert done == [("k0", "k1"), ("k2", "k3"), ("k4",)]
        assert store.lookup("k5").hit and store.verify().ok


def _as_schema(txn, store: Store, version: int, extra: dict[str, int] | None = None) -> None:
    """Rewrite an index as an adstore of schema ``version`` (3 or 4) left it: blob rows without their
    stored size (every blob raw), ``extra`` references added to some."""
    blobs = store.index.db["blobs"]
    for k, v in list(txn.cursor(db=blobs)):
        size, refs, touched, flags, _stored = BLOB_ROW.unpack(v)
        refs += (extra or {}).get(bytes(k).hex(), 0)
        txn.put(bytes(k), OLD_ROW.pack(size, refs, touched, flags), db=blobs)
    txn.put(b"schema", str(version).encode(), db=store.index.db["meta"])


def test_a_schema_4_index_is_upgraded_and_its_raw_blobs_read_as_they_are(store_root, clock):
    with Store.open(store_root, grace_period=0.0, clock=clock) as store:
        _fill(store, 3)
        before = store.stats()
        with store.index.env.begin(write=True) as txn:
            _as_schema(txn, store, 4)
    with Store.open(store_root, grace_period=0.0, clock=clock) as store:
        assert store.verify().ok
        assert all(store.lookup(f"e{i:02d}").hit for i in range(3))
        after = store.stats()
        assert (after.physical_bytes, after.logical_bytes) == (before.physical_bytes, before.logical_bytes)


def test_an_index_that_owed_references_is_upgraded_when_opened(store_root, clock):
    """Schema 3: refcounts include references an eviction pass dropped and still owed in ``releases``."""
    with Store.open(store_root, grace_period=0.0, clock=clock) as store:
        _fill(store, 3)
        shared = [store.put_bytes(b).digest for b in SHARED]
        env = store.index.env
        with env.begin(write=True) as txn:  # as schema 3 left it: rows of its layout, two extra references, owed
            releases = env.open_db(b"releases", txn=txn)
            txn.put(os.urandom(16), bytes.fromhex(shared[0]) * 2 + bytes.fromhex(shared[1])[:7], db=releases)
            _as_schema(txn, store, 3, extra={shared[0]: 2})
    index = lmdb.open(str(store_root / "index"), max_dbs=16, readonly=True, lock=False)
    with index.begin() as txn:
        assert txn.get(b"schema", db=index.open_db(b"meta", txn=txn)) == b"3"
    index.close()
    with Store.open(store_root, grace_period=0.0, clock=clock) as store:
        assert [_refs(store, d) for d in shared] == [1, 1, 1]  # the torn tail of the owed row counts nothing
        assert store.verify().ok
        env = store.index.env
        with env.begin() as txn:
            assert txn.get(b"schema", db=store.index.db["meta"]) == str(SCHEMA_VERSION).encode()
            assert txn.get(b"releases") is None  # the table is gone
            assert txn.get(WRITES, db=store.index.db["meta"]) is not None
        assert all(store.lookup(f"e{i:02d}").hit for i in range(3))
