"""The store's contract: blobs, manifests, entries, leases, stats, gc, verify."""

from __future__ import annotations

import hashlib
import os
import stat
import time

import pytest
from store_helpers import check_hit, payload, save

from adstore.store import (
    BlobMissing,
    BlobRef,
    ChecksumMismatch,
    InvalidDigest,
    InvalidKey,
    OverBudget,
    Store,
    StoreError,
    default_root,
)


def test_layout_and_cachedir_tag(store):
    for d in ("index", "blobs", "tmp", "quarantine"):
        assert (store.root / d).is_dir()
    assert (store.root / "CACHEDIR.TAG").read_bytes().startswith(b"Signature: 8a477f597d28d172789f06886806bc55")


def test_default_root_follows_environment(tmp_path):
    assert default_root({"ADSTORE_ROOT": str(tmp_path / "x")}) == tmp_path / "x"
    assert default_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "adstore"
    assert default_root({"HOME": "/h"}).name == "adstore"


def test_open_uses_adstore_root(store_root):
    with Store.open() as s:
        assert s.root == store_root


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


def test_hit_refreshes_last_access(store):
    save(store, "k")
    before = store.entry("k")
    time.sleep(0.01)
    assert store.lookup("k").hit
    store.flush()
    after = store.entry("k")
    assert after.last_access > before.last_access and after.hits == before.hits + 1


def test_stats_counters_and_totals(store):
    shared = b"S" * 100_000
    save(store, "a", shared=shared)
    save(store, "b", shared=shared)
    store.lookup("a")
    store.lookup("zz")
    store.record("bypass", "unsupported_hook")
    store.record("save", seconds_saved=1.5)
    st = store.stats()
    assert st.entries == 2
    assert st.counters["hits"] == 1 and st.counters["misses.absent"] == 1
    assert st.counters["bypasses.unsupported_hook"] == 1 and st.counters["saves"] == 1
    assert st.logical_bytes - st.physical_bytes == 100_000
    assert st.dedup_ratio > 1.0
    assert st.to_dict()["dedup_ratio"] == st.dedup_ratio


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


def test_verify_fix_repairs_corruption(store):
    save(store, "good")
    save(store, "bad")
    m = store.lookup("bad").manifest
    path = store.blob_path(m.artifacts["a1"])
    os.chmod(path, 0o644)
    path.write_bytes(b"garbage" * 20_000)
    rep = store.verify()
    assert not rep.ok and any("hashes to" in p for p in rep.problems)
    fixed = store.verify(fix=True)
    assert fixed.ok and fixed.fixed
    assert store.lookup("bad").reason == "absent"
    assert check_hit(store, "good")
    assert store.verify().ok


def test_undecodable_index_values_are_misses_and_fixable(store):
    save(store, "k")
    save(store, "ok")
    env = store.index.env
    with env.begin(write=True) as txn:
        txn.put(b"k", b"\xff not json", db=store.index.db["entries"])
    assert store.lookup("k").reason == "corrupt_index"
    assert [e.key for e in store.entries()] == ["ok"]
    assert not store.verify().ok
    assert store.verify(fix=True).ok
    assert store.verify().ok and check_hit(store, "ok")


def test_eviction_is_lru_by_entry(store):
    for key in ("a", "b", "c"):
        save(store, key, sizes=(100, 100_000))
        time.sleep(0.01)
    store.lookup("a")  # a becomes most recently used
    store.flush()
    plan = store.plan_eviction(max_size=store.size() - 1)
    assert [e.key for e in plan.victims] == ["b"]
    assert plan.bytes_to_free >= 100_000
    freed = plan.execute()
    assert freed == plan.bytes_to_free
    assert store.lookup("b").reason == "absent"
    assert store.lookup("a").hit and store.lookup("c").hit
    assert store.verify().ok


def test_eviction_skips_leased_pinned_and_young(store_root):
    store = Store.open(store_root, grace_period=0.0)
    for key in ("leased", "pinned", "free"):
        save(store, key)
    store.pin("pinned")
    with store.lease("leased"):
        plan = store.plan_eviction(max_size=0)
        assert [e.key for e in plan.victims] == ["free"]
        assert set(plan.skipped) == {"leased", "pinned"}
        plan.execute()
    assert store.lookup("leased").hit and store.lookup("pinned").hit
    store.unpin("pinned")
    young = Store.open(store_root, grace_period=3600.0)
    assert young.plan_eviction(max_size=0).victims == []  # younger than the grace period
    assert [e.key for e in store.plan_eviction(max_size=0).victims] == ["leased", "pinned"]


def test_eviction_plan_rechecks_at_execute(store):
    save(store, "k")
    plan = store.plan_eviction(max_size=0)
    with store.lease("k"):
        assert plan.execute() == 0
    assert store.lookup("k").hit


def test_eviction_spares_entries_used_pinned_or_recommitted_after_planning(store):
    for key in ("used", "pinned", "resaved", "idle"):
        save(store, key)
    time.sleep(0.01)
    plan = store.plan_eviction(max_size=0)
    assert {e.key for e in plan.victims} == {"used", "pinned", "resaved", "idle"}
    assert store.lookup("used").hit  # its entry row is unchanged; only its access row moves
    store.flush()
    store.pin("pinned")
    save(store, "resaved")
    plan.execute()
    assert [k for k in ("used", "pinned", "resaved", "idle") if store.lookup(k, record=False).hit] == [
        "used", "pinned", "resaved"]
    assert store.verify().ok


def test_older_than_and_min_free(store):
    save(store, "old")
    assert store.plan_eviction(older_than=3600).victims == []
    time.sleep(0.05)
    assert [e.key for e in store.plan_eviction(older_than=0.01).victims] == ["old"]
    free = os.statvfs(store.root).f_bavail * os.statvfs(store.root).f_frsize
    assert store.plan_eviction(min_free="1%").victims == [] or free < 0.01 * os.statvfs(store.root).f_blocks
    assert [e.key for e in store.plan_eviction(min_free="100%").victims] == ["old"]


def test_plan_remove(store):
    save(store, "a")
    save(store, "b")
    plan = store.plan_remove(["a"])
    assert [e.key for e in plan.victims] == ["a"] and plan.bytes_to_free > 0
    plan.execute()
    assert store.lookup("a").reason == "absent" and store.lookup("b").hit
    with pytest.raises(InvalidKey):
        store.plan_remove(["nope"])


def test_resolve_key_prefix(store):
    save(store, "abc123")
    save(store, "abd456")
    assert store.resolve_key("abc") == "abc123"
    with pytest.raises(InvalidKey, match="ambiguous"):
        store.resolve_key("ab")
    with pytest.raises(InvalidKey, match="no entry"):
        store.resolve_key("zz")


def test_sweep_collects_leftovers_of_killed_writers(store):
    save(store, "k")
    (store.root / "tmp" / "123-dead.tmp").write_bytes(b"x" * 1000)
    orphan = os.urandom(70_000)
    digest = hashlib.sha256(orphan).hexdigest()
    (store.root / "blobs" / digest[:2]).mkdir(exist_ok=True)
    (store.root / "blobs" / digest[:2] / digest).write_bytes(orphan)
    ref = store.put_bytes(b"u" * 80_000)
    gen = store.new_generation()
    store.publish("pending", generation=gen, artifacts={"u": ref})
    rep = store.verify()
    assert rep.ok and rep.warnings  # leftovers are warnings, not violations
    plan = store.plan_sweep()
    assert plan.to_dict()["stale_temps"] == 1 and plan.to_dict()["orphan_files"] == 1
    assert plan.to_dict()["stale_manifests"] == 1
    plan.execute()
    assert not (store.root / "tmp" / "123-dead.tmp").exists()
    assert not (store.root / "blobs" / digest[:2] / digest).exists()
    assert not store.has_blob(ref) and store.lookup("pending").reason == "absent"
    assert check_hit(store, "k")
    rep = store.verify()
    assert rep.ok and not rep.warnings, rep.to_dict()


def test_sweep_respects_grace_period(store_root):
    store = Store.open(store_root, grace_period=3600.0)
    ref = store.put_bytes(b"z" * 100_000)  # put, not yet published: protected
    (store.root / "tmp" / "fresh.tmp").write_bytes(b"x")
    assert store.plan_sweep().empty
    assert store.has_blob(ref)


def test_hard_limit_evicts_inline_then_refuses(store_root):
    store = Store.open(store_root, grace_period=0.0, max_size=400_000)
    save(store, "a", sizes=(100, 150_000))
    save(store, "b", sizes=(100, 150_000))
    save(store, "c", sizes=(100, 150_000))  # evicts a inline
    assert store.lookup("a").reason == "absent"
    assert store.size() <= 400_000
    with store.lease("b"), store.lease("c"):
        with pytest.raises(OverBudget) as exc:
            store.put_bytes(os.urandom(300_000))
    assert exc.value.reason == "over_budget"
    assert store.verify().ok


def test_network_filesystem_is_refused(tmp_path, monkeypatch):
    import psutil

    from adstore.store import UnsupportedFilesystem

    real = psutil.disk_partitions

    def with_nfs(all=False):  # the machine's mounts plus one NFS mount over tmp_path
        parts = real(all=all)
        nfs = type(parts[0])(device="server:/export", mountpoint=str(tmp_path), fstype="nfs4", opts="rw")
        return [*parts, nfs]

    monkeypatch.setattr(psutil, "disk_partitions", with_nfs)
    with pytest.raises(UnsupportedFilesystem, match="nfs4"):
        Store.open(tmp_path / "s")


def test_world_writable_root_is_refused(tmp_path):
    from adstore.store import UnsafeRoot

    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeRoot):
        Store.open(root)


def test_commit_without_publish_is_an_error(store):
    with pytest.raises(StoreError):
        store.commit("k", generation=5)


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


def test_index_of_another_schema_is_refused_and_left_alone(store_root):
    import lmdb

    from adstore.store import IncompatibleStore

    Store.open(store_root).close()
    env = lmdb.open(str(store_root / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"1", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(IncompatibleStore, match="schema 1") as err:
        Store.open(store_root)
    assert err.value.reason == "incompatible_store" and "delete" in str(err.value)
    env = lmdb.open(str(store_root / "index"), max_dbs=16)
    with env.begin() as txn:  # refused, not rewritten
        assert txn.get(b"schema", db=env.open_db(b"meta", txn=txn)) == b"1"
    env.close()


def test_hits_are_recorded_beside_the_entry_row(store):
    """Recording hits rewrites a small access row, never the entry (lookups memoize it by its bytes)."""
    from adstore.store.records import ACCESS_ROW

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
