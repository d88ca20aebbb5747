"""The store's contract, entries: keys, publish, commit, lookup reasons, generations, hits, stats."""

from __future__ import annotations

import os

import pytest
from store_helpers import check_hit, payload, save

from adstore.store import BlobMissing, BlobRef, InvalidKey, StoreError


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "a\x00b", " x", "k" * 201, None])
def test_bad_keys_are_refused(store, bad):
    with pytest.raises(InvalidKey):
        store.lookup(bad)
    ref = store.put_bytes(b"x")
    with pytest.raises(InvalidKey):
        store.publish(bad, generation=1, artifacts={"a": ref})


def test_bad_publish_arguments(store):
    ref = store.put_bytes(b"x")
    with pytest.raises(InvalidKey):
        store.publish("k", rank=2, world_size=2, generation=1, artifacts={"a": ref})
    with pytest.raises(InvalidKey):
        store.publish("k", generation=0, artifacts={"a": ref})
    with pytest.raises(InvalidKey):
        store.publish("k", generation=1, artifacts={"../a": ref})
    with pytest.raises(BlobMissing):
        store.publish("k", generation=1, artifacts={"a": BlobRef("0" * 64, 3)})
    assert store.lookup("k").reason == "absent"


def test_publish_commit_lookup_reasons(store):
    assert store.lookup("k").reason == "absent"
    gen = store.new_generation()
    a = store.put_bytes(payload("k", gen, 0, "a0", 100))
    store.publish("k", rank=0, world_size=2, generation=gen, artifacts={"a0": a})
    assert store.lookup("k").reason == "uncommitted"
    store.commit("k", rank=0, generation=gen)
    assert store.lookup("k").reason == "incomplete"  # rank 1 never saved
    assert store.lookup("k", rank=0).hit
    b = store.put_bytes(payload("k", gen, 1, "a0", 100))
    store.publish("k", rank=1, world_size=2, generation=gen, artifacts={"a0": b})
    store.commit("k", rank=1, generation=gen)
    res = store.lookup("k")
    assert res.hit and res.generation == gen and set(res.manifests) == {0, 1}
    assert check_hit(store, "k")


def test_generation_mismatch_is_a_miss(store):
    save(store, "k", world_size=2)
    gen2 = store.new_generation()
    ref = store.put_bytes(payload("k", gen2, 0, "a0", 10))
    store.publish("k", rank=0, world_size=2, generation=gen2, artifacts={"a0": ref})
    store.commit("k", rank=0, generation=gen2)  # rank 1 died before committing gen2
    assert store.lookup("k").reason == "generation_mismatch"
    assert store.verify().ok


def test_republish_replaces_old_generation(store):
    g1 = save(store, "k", sizes=(100, 100_000))
    old = store.lookup("k").manifest
    g2 = save(store, "k", sizes=(100, 100_000))
    assert g1 != g2
    res = store.lookup("k")
    assert res.generation == g2 and check_hit(store, "k")
    assert len(store.manifests("k")) == 1
    # The old generation's blobs lost their references and are swept.
    store.plan_sweep().execute()
    for ref in old.artifacts.values():
        assert not store.has_blob(ref)
    report = store.verify()
    assert report.ok and not report.warnings, report.to_dict()


def test_world_size_change_drops_old_ranks(store):
    save(store, "k", world_size=2)
    save(store, "k", world_size=1)
    res = store.lookup("k")
    assert res.hit and set(res.manifests) == {0}
    assert {m.rank for m in store.manifests("k")} == {0}
    assert store.verify().ok


def test_abort_drops_uncommitted_manifest(store):
    ref = store.put_bytes(b"x" * 10)
    gen = store.new_generation()
    store.publish("k", generation=gen, artifacts={"a": ref})
    assert store.abort("k", generation=gen)
    assert store.lookup("k").reason == "absent"
    assert store.verify().ok


def test_hit_refreshes_last_access(store, clock):
    save(store, "k")
    before = store.entry("k")
    clock.advance(1)
    assert store.lookup("k").hit
    store.flush()
    after = store.entry("k")
    assert after.last_access > before.last_access and after.hits == before.hits + 1


def test_stats_counters_and_totals(store):
    shared = os.urandom(100_000)  # stored raw: physical bytes are content bytes
    save(store, "a", shared=shared)
    save(store, "b", shared=shared)
    store.lookup("a")
    store.lookup("zz")
    store.count_event("bypass", "unsupported_hook")
    store.count_event("save", seconds_saved=1.5)
    st = store.stats()
    assert st.entries == 2
    assert st.counters["hits"] == 1 and st.counters["misses.absent"] == 1
    assert st.counters["bypasses.unsupported_hook"] == 1 and st.counters["saves"] == 1
    assert st.logical_bytes - st.physical_bytes == 100_000
    assert st.dedup_ratio > 1.0
    assert st.to_dict()["dedup_ratio"] == st.dedup_ratio


def test_resolve_key_prefix(store):
    save(store, "abc123")
    save(store, "abd456")
    assert store.resolve_key("abc") == "abc123"
    with pytest.raises(InvalidKey, match="ambiguous"):
        store.resolve_key("ab")
    with pytest.raises(InvalidKey, match="no entry"):
        store.resolve_key("zz")


def test_commit_without_publish_is_an_error(store):
    with pytest.raises(StoreError):
        store.commit("k", generation=5)


def test_hits_are_recorded_beside_the_entry_row(store):
    """Recording hits rewrites a small access row, never the entry (lookups memoize it by its bytes)."""
    from adstore.store.index.rows import ACCESS_ROW

    save(store, "k")
    env, dbs = store.index.env, store.index.db
    with env.begin() as txn:
        row = txn.get(b"k", db=dbs["entries"])
    assert store.lookup("k").hit and store.lookup("k").hit
    store.flush()
    with env.begin() as txn:
        assert txn.get(b"k", db=dbs["entries"]) == row
    assert store.entry("k").hits == 2
    with env.begin(write=True) as txn:  # an access row whose entry is gone
        txn.put(b"gone", ACCESS_ROW.pack(1.0, 1), db=dbs["access"])
    rep = store.verify()
    assert rep.ok and any("access row" in w for w in rep.warnings), rep.to_dict()
    store.verify(fix=True)
    with env.begin() as txn:
        assert txn.get(b"gone", db=dbs["access"]) is None
        assert txn.get(b"k", db=dbs["access"]) is not None
    assert store.verify().warnings == []
