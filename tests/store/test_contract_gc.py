"""The store's contract, gc: eviction plans, leases and pins, removal, sweeps, the hard limit, verify --fix."""

from __future__ import annotations

import hashlib
import os

import pytest
from store_helpers import check_hit, save

from adstore.store import InvalidKey, OverBudget, Store


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


def test_eviction_is_lru_by_entry(store, clock):
    for key in ("a", "b", "c"):
        save(store, key, sizes=(100, 100_000))
        clock.advance(1)
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
    young = Store.open(store_root, grace_period=3600.0, clock=store.clock)
    assert young.plan_eviction(max_size=0).victims == []  # younger than the grace period
    assert [e.key for e in store.plan_eviction(max_size=0).victims] == ["leased", "pinned"]


def test_eviction_plan_rechecks_at_execute(store):
    save(store, "k")
    plan = store.plan_eviction(max_size=0)
    with store.lease("k"):
        assert plan.execute() == 0
    assert store.lookup("k").hit


def test_eviction_spares_entries_used_pinned_or_recommitted_after_planning(store, clock):
    for key in ("used", "pinned", "resaved", "idle"):
        save(store, key)
    clock.advance(1)
    plan = store.plan_eviction(max_size=0)
    assert {e.key for e in plan.victims} == {"used", "pinned", "resaved", "idle"}
    assert store.lookup("used").hit  # its entry row is unchanged; only its access row moves
    store.flush()
    store.pin("pinned")
    save(store, "resaved")
    plan.execute()
    assert [k for k in ("used", "pinned", "resaved", "idle") if store.lookup(k, count=False).hit] == [
        "used",
        "pinned",
        "resaved",
    ]
    assert store.verify().ok


def test_older_than_and_min_free(store, clock):
    save(store, "old")
    assert store.plan_eviction(older_than=3600).victims == []
    clock.advance(1)
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


def in_killed_writer(publish) -> None:
    """``publish()`` in a forked writer that exits before its commit: a manifest gc may sweep (its producer is
    dead; a live producer's save is in flight and kept, test_save_in_flight.py)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            publish()
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_sweep_collects_leftovers_of_killed_writers(store):
    save(store, "k")
    (store.root / "tmp" / "123-dead.tmp").write_bytes(b"x" * 1000)
    orphan = os.urandom(70_000)
    digest = hashlib.sha256(orphan).hexdigest()
    (store.root / "blobs" / digest[:2]).mkdir(exist_ok=True)
    (store.root / "blobs" / digest[:2] / digest).write_bytes(orphan)
    ref = store.put_bytes(b"u" * 80_000)
    gen = store.new_generation()
    in_killed_writer(lambda: store.publish("pending", generation=gen, artifacts={"u": ref}))
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


def test_sweep_releases_what_a_stale_manifest_holds_when_it_runs(store):
    """A save that published again under the same generation after the sweep planned: the sweep
    releases the references of the row it drops, not those it planned (once each, never twice)."""
    first, second = store.put_bytes(b"1" * 70_000), store.put_bytes(b"2" * 70_000)
    gen = store.new_generation()
    in_killed_writer(lambda: store.publish("pending", generation=gen, artifacts={"a": first}))
    plan = store.plan_sweep()
    assert plan.to_dict()["stale_manifests"] == 1
    # releases `first`, holds `second`
    in_killed_writer(lambda: store.publish("pending", generation=gen, artifacts={"a": second}))
    plan.execute()
    assert store.manifests("pending") == []
    rep = store.verify()
    assert rep.ok and not rep.findings, rep.to_dict()


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
