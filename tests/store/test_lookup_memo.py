"""Repeated lookups reuse the checks of an earlier hit only while the index proves them current.

``LookupMemo`` skips re-reading blob rows while the blob epoch is unchanged;
every way a blob can be taken away from a hit must therefore turn the next
lookup into a miss, in this process and in others.
"""

from __future__ import annotations

import multiprocessing as mp

from store_helpers import check_hit, damage_inline_and_read, save

from adstore.store import Store
from adstore.store.index.rows import BLOB_ROW, FLAG_QUARANTINED
from adstore.store.index.schema import BLOB_EPOCH


def _epoch(store: Store) -> bytes | None:
    with store.index.env.begin() as txn:
        return txn.get(BLOB_EPOCH, db=store.index.db["meta"])


def _small_digest(store: Store, key: str) -> str:
    return store.lookup(key, count=False).manifest.artifacts["a0"].digest  # 100 bytes: inline


def test_repeated_hit_is_the_same_checked_result(store):
    save(store, "k")
    first = store.lookup("k")
    assert first.hit
    assert store.lookup("k") is first  # served from the memo
    assert store.lookup("k", rank=0).hit  # memoized separately per rank argument
    assert check_hit(store, "k")


def test_memo_trusts_blob_rows_only_while_the_epoch_is_unchanged(store):
    """The trust boundary, both ways: a row changed behind the store's back is not
    re-read, and any store transaction that takes a row away makes it re-read."""
    save(store, "k")
    save(store, "other")
    assert store.lookup("k").hit
    row_key = bytes.fromhex(_small_digest(store, "k"))
    with store.index.env.begin(write=True) as txn:  # flag the row without the store
        db = store.index.db["blobs"]
        size, refs, touched, flags, stored = BLOB_ROW.unpack(txn.get(row_key, db=db))
        txn.put(row_key, BLOB_ROW.pack(size, refs, touched, flags | FLAG_QUARANTINED, stored), db=db)
    assert store.lookup("k").hit  # memoized: the row was not read again
    store.quarantine(_small_digest(store, "other"))  # any quarantine bumps the epoch
    res = store.lookup("k")
    assert not res.hit and res.reason == "blob_missing"


def test_quarantine_in_another_process_ends_a_memoized_hit(store):
    save(store, "k")
    assert store.lookup("k").hit
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        err = pool.apply(damage_inline_and_read, (str(store.root), _small_digest(store, "k")))
    assert err == "ChecksumMismatch"
    res = store.lookup("k")
    assert not res.hit and res.reason == "blob_missing"


def test_file_blob_removed_from_disk_ends_a_memoized_hit(store):
    save(store, "k")
    res = store.lookup("k")
    path = store.blob_path(res.manifest.artifacts["a1"])  # 70 000 bytes: a file
    assert res.hit and path is not None
    path.unlink()
    res = store.lookup("k")
    assert not res.hit and res.reason == "blob_missing"


def test_republish_evict_and_failed_read_are_seen(store):
    g1 = save(store, "k")
    assert store.lookup("k").generation == g1
    g2 = save(store, "k")
    assert store.lookup("k").generation == g2  # the entry row changed
    plan = store.plan_eviction(max_size=0)
    assert "k" in {v.key for v in plan.victims}
    plan.execute()
    assert store.lookup("k").reason == "absent"


def test_sweep_of_rows_bumps_the_epoch(store):
    """gc deletes zero-ref rows in one transaction; lookups re-check afterwards."""
    save(store, "k")
    assert store.lookup("k").hit
    before = _epoch(store)
    save(store, "k")  # the first generation's blobs drop to zero references
    store.plan_sweep().execute()
    assert _epoch(store) != before
    assert check_hit(store, "k")
