"""Invariant 9: the index is a rebuildable cache of the files (docs/operations.md, "Damage and repair").

Real stores, real LMDB, real record files.  Entries of one and two ranks,
pinned, with inline and file blobs are saved; the index is damaged the ways
the damage suite damages it; ``adstore verify --fix`` (a real CLI process)
rebuilds it, and every entry whose files are intact is a hit with the same
bytes, while removed and evicted entries stay gone.  Also: a record whose
blob is gone, leftovers of a crash between the index and the record files,
one rank of two on a host, and which generation a rebuild chooses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from store_helpers import run_cli, save, served_digests

from adstore.store import Reason, Store
from adstore.store.layout import Layout
from adstore.store.records.files import RecordFiles, RecordState

KEPT = ("one", "two", "pinned", "tiny")  # what must come back
GONE = ("removed", "evicted")  # what must not


def _save_all(store: Store) -> dict[str, dict[int, dict[str, str]]]:
    """Save the entries of every kind; returns the SHA-256 of every artifact the kept keys serve, by rank."""
    save(store, "evicted", sizes=(100, 70_000))  # the least recently used: the one eviction takes
    save(store, "one", sizes=(100, 70_000))  # an inline and a file blob
    save(store, "two", world_size=2, sizes=(300, 80_000))
    save(store, "pinned", sizes=(50, 90_000))
    store.pin("pinned")
    save(store, "tiny", sizes=(10, 20))  # inline blobs only: their bytes live in the index and the record
    save(store, "removed", sizes=(100, 75_000))
    store.plan_remove(["removed"]).execute()
    plan = store.plan_eviction(older_than=0, max_entries=1)
    assert [e.key for e in plan.victims] == ["evicted"]
    plan.execute()
    return {key: served_digests(store, key) for key in KEPT}


def _damage(root: Path, how: str) -> None:
    data = root / "index" / "data.mdb"
    if how == "truncate":
        os.truncate(data, data.stat().st_size // 2)
    elif how == "garbage":
        with open(data, "r+b") as f:  # the meta pages and the first B-tree pages
            f.write(os.urandom(4 * 4096))
    else:  # not LMDB at all
        data.unlink()
        data.write_bytes(b"this is not an index\n" * 1000)


@pytest.mark.parametrize("how", ["truncate", "garbage", "not_lmdb"])
def test_verify_fix_rebuilds_every_intact_entry_and_nothing_removed(store_root, how):
    with Store.open(store_root, grace_period=0.0) as store:
        want = _save_all(store)
    _damage(store_root, how)
    assert run_cli(store_root, "verify").returncode != 0
    fixed = run_cli(store_root, "--json", "verify", "--fix")
    assert fixed.returncode == 0, (fixed.stdout, fixed.stderr)
    report = json.loads(fixed.stdout)
    assert any("restored 4 entr(ies), 5 manifest(s)" in f for f in report["fixed"]), report["fixed"]
    with Store.open(store_root, grace_period=0.0) as store:
        for key, served in want.items():
            assert served_digests(store, key) == served, key
        for key in GONE:
            assert store.lookup(key, count=False).reason == Reason.ABSENT, key
        assert store.entry("pinned").pinned and not store.entry("one").pinned
        assert store.entry("two").components == {"key": "two"}
        assert store.plan_eviction(older_than=0).skipped == ["pinned"]  # the pin holds again
        rep = store.verify()
        assert rep.ok and not rep.warnings, rep.to_dict()
        assert rep.records_checked == 5
        # The rebuilt store works on: a new save, a removal, and another rebuild agrees.
        save(store, "after", sizes=(100, 70_000))
        store.plan_remove(["one"]).execute()
        want["after"] = served_digests(store, "after")
        del want["one"]
    os.truncate(store_root / "index" / "data.mdb", 4096)
    assert run_cli(store_root, "verify", "--fix").returncode == 0
    with Store.open(store_root, grace_period=0.0) as store:
        assert {key: served_digests(store, key) for key in want} == want
        assert store.lookup("one", count=False).reason == Reason.ABSENT


def test_a_record_whose_blob_is_gone_is_not_restored_and_is_reported(store_root):
    with Store.open(store_root, grace_period=0.0) as store:
        save(store, "one", sizes=(100, 70_000))
        save(store, "lost", sizes=(100, 70_000))
        big = store.lookup("lost", count=False).manifest.artifacts["a1"]
        path = store.blob_path(big)
    os.chmod(path, 0o644)
    path.write_bytes(b"not the content" * 100)  # corrupt: quarantined by the rebuild
    os.truncate(store_root / "index" / "data.mdb", 4096)
    _, report = Store.repair_index(store_root)
    assert report.entries == 1 and [s.reason for s in report.skipped] == [Reason.BLOB_MISSING]
    with Store.open(store_root, grace_period=0.0) as store:
        assert store.lookup("lost", count=False).reason == Reason.ABSENT
        assert store.lookup("one", count=False).hit
        assert store.verify(fix=True).ok
        assert not store.verify().warnings  # the useless record went (an orphan of the index)


def test_gc_finishes_a_commit_and_sweeps_a_removal_cut_short(store_root):
    """What a process killed between the index transaction and the record files leaves (test_kill_points.py cuts
    every step; here each leftover is made by hand), and what a rebuild does with it after gc."""
    with Store.open(store_root, grace_period=0.0) as store:
        save(store, "cut_commit", sizes=(100, 70_000))
        save(store, "cut_removal", sizes=(100, 70_000))
        want = served_digests(store, "cut_commit")
        files = RecordFiles(Layout(store_root))
        by_key = {f.key: f for f in files.scan() if f.state is RecordState.COMMITTED}
        c = by_key["cut_commit"]
        os.rename(c.path, files.pending_path(c.key, c.rank, c.generation))  # killed before the rename
        kept = by_key["cut_removal"].path.read_bytes()
        store.plan_remove(["cut_removal"]).execute()
        by_key["cut_removal"].path.write_bytes(kept)  # killed before the unlink
        rep = store.verify()
        assert rep.ok and {Reason.MISSING_RECORD, Reason.ORPHAN_RECORDS} <= {f.kind for f in rep.findings}
        plan = store.plan_sweep()
        assert plan.to_dict()["orphan_records"] == 1 and plan.to_dict()["unfinished_records"] == 1
        plan.execute()
        assert not store.verify().warnings
    os.truncate(store_root / "index" / "data.mdb", 4096)
    Store.repair_index(store_root)
    with Store.open(store_root, grace_period=0.0) as store:
        assert served_digests(store, "cut_commit") == want
        assert store.lookup("cut_removal", count=False).reason == Reason.ABSENT


@pytest.mark.slow
def test_rebuild_of_many_entries_restores_them_all(store_root):
    """300 entries of one or two ranks, a third pinned: all back after the index is lost, each with its bytes."""
    with Store.open(store_root, grace_period=0.0) as store:
        for i in range(300):
            save(store, f"k{i}", world_size=1 + i % 2, sizes=(50 + i, 65_536 + i))
            if i % 3 == 0:
                store.pin(f"k{i}")
        want = {f"k{i}": served_digests(store, f"k{i}") for i in range(300)}
    _damage(store_root, "not_lmdb")
    assert run_cli(store_root, "verify", "--fix").returncode == 0
    with Store.open(store_root, grace_period=0.0) as store:
        assert {k: served_digests(store, k) for k in want} == want
        assert sum(e.pinned for e in store.entries()) == 100
        assert store.verify().ok


def test_a_host_that_holds_one_rank_of_two_gets_it_back(store_root):
    """Ranks on different hosts: each store holds its own rank's manifest, and its rebuild restores that rank."""
    with Store.open(store_root, grace_period=0.0) as store:
        gen = store.new_generation()
        ref = store.put_bytes(b"rank one" * 10_000)
        store.publish("dist", rank=1, world_size=2, generation=gen, artifacts={"m": ref})
        store.commit("dist", rank=1, generation=gen)
        assert store.lookup("dist", rank=1, count=False).hit
        assert store.lookup("dist", count=False).reason == Reason.INCOMPLETE
    os.truncate(store_root / "index" / "data.mdb", 4096)
    _, report = Store.repair_index(store_root)
    assert report.entries == 1 and not report.skipped
    with Store.open(store_root, grace_period=0.0) as store:
        res = store.lookup("dist", rank=1, count=False)
        assert res.hit and res.generation == gen and store.read_artifact(res.manifest, "m") == b"rank one" * 10_000
        assert store.lookup("dist", count=False).reason == Reason.INCOMPLETE  # as before the index was lost
        assert store.verify().ok


def test_choose_prefers_the_newest_complete_generation():
    """A crash between two ranks' commits: the older generation every rank has wins over a newer partial one."""
    from adstore.store import BlobRef
    from adstore.store.records.format import Record
    from adstore.store.records.restore import choose

    ref = BlobRef("0" * 64, 1)

    def rec(rank: int, gen: int, created: float, ws: int = 2) -> Record:
        return Record("k", rank, ws, gen, "default", {}, {"a": ref}, created=created)

    old0, old1, new0 = rec(0, 5, 1.0), rec(1, 5, 1.0), rec(0, 9, 2.0)
    assert choose([new0, old0, old1]) == [old0, old1]
    new1 = rec(1, 9, 2.0)
    assert choose([new0, old0, old1, new1]) == [new0, new1]
    assert choose([new0, old1]) == [new0, old1]  # nothing complete: each rank's newest (a lookup says mismatch)
    solo = rec(0, 7, 3.0, ws=1)  # the newest save changed the topology
    assert choose([old0, old1, solo]) == [solo]


def test_a_record_published_again_after_its_obsolete_list_stays_live(store):
    """A restore may publish a dropped generation again: the rewritten record is newer than the list
    naming it, so scans and rebuilds keep it and gc does not delete it."""

    files = RecordFiles(Layout(store.root))
    arts = {"a": store.put_bytes(b"z" * 70_000)}
    gen = store.new_generation()
    store.publish("k", generation=gen, artifacts=arts)
    store.commit("k", generation=gen)
    store.plan_remove(["k"]).execute()
    assert [name for name in files.obsoleted() if name.endswith(f"k.0.{gen}")] and files.scan() == []
    for listed in files.obsolete_files():  # the new record must be visibly newer than its list
        os.utime(listed, (listed.stat().st_atime - 10, listed.stat().st_mtime - 10))
    arts = {"a": store.put_bytes(b"z" * 70_000)}  # (the removal may have taken the blob too)
    store.publish("k", generation=gen, artifacts=arts)
    store.commit("k", generation=gen)
    assert [f.generation for f in files.scan()] == [gen]
    store.plan_sweep().execute()
    assert [f.generation for f in files.scan()] == [gen] and files.obsolete_files() == []
    want = served_digests(store, "k")
    store.close()
    os.truncate(store.root / "index" / "data.mdb", 4096)
    assert run_cli(store.root, "verify", "--fix").returncode == 0
    with Store.open(store.root) as again:
        assert served_digests(again, "k") == want


def test_an_entry_whose_content_is_its_meta_survives_a_rebuild_and_its_seal_holds(store_root):
    """An entry with no artifact (the Inductor toolchain entry holding only ISA answers) has a readable record."""
    with Store.open(store_root, grace_period=0.0) as store:
        store.save("answers", {}, namespace="inductor_toolchain", meta={"isa_probes": {"a" * 64: True}})
        res = store.lookup("answers", trusted=frozenset({os.geteuid()}))  # the seal reads the record
        assert res.hit and res.manifest.artifacts == {}, res.reason
    _damage(store_root, "not_lmdb")
    assert run_cli(store_root, "verify", "--fix").returncode == 0
    with Store.open(store_root, grace_period=0.0) as store:
        res = store.lookup("answers", count=False)
        assert res.hit and res.manifest.meta["isa_probes"] == {"a" * 64: True}
