"""Invariant 9: the index is a rebuildable cache of the files (README, "Damage and repair").

Real stores, real LMDB, real record files.  Entries of one and two ranks,
pinned, with inline and file blobs are saved; the index is damaged the ways
the damage suite damages it; ``adstore verify --fix`` (a real CLI process)
rebuilds it, and every entry whose files are intact is a hit with the same
bytes, while removed and evicted entries stay gone.  Tampered records are
skipped with a reason, never a crash; ``verify`` and gc keep the records in
step with the index.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from store_helpers import save

from adstore.store import Reason, Store, UnsafeRoot
from adstore.store.layout import Layout
from adstore.store.recordfiles import RecordFiles, RecordState
from adstore.store.recordfmt import RECORD_FORMAT, BadRecord, decode_record, encode_record
from adstore.store.records import MANIFEST_SUFFIX, manifest_key

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
    return {key: _served(store, key) for key in KEPT}


def _served(store: Store, key: str) -> dict[int, dict[str, str]]:
    res = store.lookup(key, record=False)
    assert res.hit, (key, res.reason)
    return {rank: {n: hashlib.sha256(store.read_artifact(m, n)).hexdigest() for n in m.artifacts}
            for rank, m in res.manifests.items()}


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "adstore.daemon", "--root", str(root), *args],
                          capture_output=True, text=True, timeout=300, check=False)


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
    assert _cli(store_root, "verify").returncode != 0
    fixed = _cli(store_root, "--json", "verify", "--fix")
    assert fixed.returncode == 0, (fixed.stdout, fixed.stderr)
    report = json.loads(fixed.stdout)
    assert any("restored 4 entr(ies), 5 manifest(s)" in f for f in report["fixed"]), report["fixed"]
    with Store.open(store_root, grace_period=0.0) as store:
        for key, served in want.items():
            assert _served(store, key) == served, key
        for key in GONE:
            assert store.lookup(key, record=False).reason == Reason.ABSENT, key
        assert store.entry("pinned").pinned and not store.entry("one").pinned
        assert store.entry("two").components == {"key": "two"}
        assert store.plan_eviction(older_than=0).skipped == ["pinned"]  # the pin holds again
        rep = store.verify()
        assert rep.ok and not rep.warnings, rep.to_dict()
        assert rep.records_checked == 5
        # The rebuilt store works on: a new save, a removal, and another rebuild agrees.
        save(store, "after", sizes=(100, 70_000))
        store.plan_remove(["one"]).execute()
        want["after"] = _served(store, "after")
        del want["one"]
    os.truncate(store_root / "index" / "data.mdb", 4096)
    assert _cli(store_root, "verify", "--fix").returncode == 0
    with Store.open(store_root, grace_period=0.0) as store:
        assert {key: _served(store, key) for key in want} == want
        assert store.lookup("one", record=False).reason == Reason.ABSENT


def test_records_follow_every_change_of_the_index(store):
    files = RecordFiles(Layout(store.root))

    def states() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for f in files.scan():
            out.setdefault(f.state.value, []).append(f"{f.key}.{f.rank}.{f.generation}" if f.rank >= 0 else f.key)
        return out

    gen = store.new_generation()
    store.publish("k", generation=gen, artifacts={"a": store.put_bytes(b"x" * 10)})
    assert states() == {"pending": [f"k.0.{gen}"]}  # published: not restorable, not committed on disk
    store.commit("k", generation=gen)
    assert states() == {"committed": [f"k.0.{gen}"]}
    gen2 = save(store, "k")
    assert states() == {"committed": [f"k.0.{gen2}"]}  # the older generation's record went with its row
    store.pin("k")
    assert states() == {"committed": [f"k.0.{gen2}"], "pin": ["k"]}
    store.unpin("k")
    store.pin("k")
    gen3 = store.new_generation()
    store.publish("k", generation=gen3, artifacts={"a": store.put_bytes(b"y" * 10)})
    assert store.abort("k", generation=gen3)
    assert states() == {"committed": [f"k.0.{gen2}"], "pin": ["k"]}  # an aborted save leaves nothing
    store.plan_remove(["k"]).execute()
    assert states() == {}
    # Dropped records are named by obsolete lists (one small file per batch, not a syscall per record):
    # scans skip them, gc deletes them and then the lists.
    listed = {name.rpartition("/")[2] for name in files.obsoleted()}
    assert listed >= {f"k.0.{gen}", f"k.0.{gen2}", f"k.0.{gen3}"}
    assert all(f.name.endswith(".list") for f in files.obsolete_files())
    on_disk = {p.name for p in (store.root / "records").rglob("k.0.*") if "obsolete" not in p.parts}
    assert f"k.0.{gen2}" in on_disk  # still there until gc, but dead
    assert store.plan_sweep().to_dict()["obsolete_records"] >= 1
    store.plan_sweep().execute()
    assert files.obsolete_files() == []
    assert not [p for p in (store.root / "records").rglob("k.*") if p.is_file()]
    assert store.verify().ok and not store.verify().warnings


def test_the_remote_payload_is_the_record_format_without_local_fields(store):
    from adstore.store.tiered import record_payload

    save(store, "k", sizes=(100, 70_000))
    payload = record_payload(store, "k", 0)
    assert payload["format"] == RECORD_FORMAT and "inline" not in payload and "producer" not in payload
    (found,) = [f for f in RecordFiles(Layout(store.root)).scan() if f.state is RecordState.COMMITTED]
    local = json.loads(found.path.read_bytes())["record"]
    assert {k: v for k, v in local.items() if k not in ("inline", "producer")} == payload
    assert len(local["inline"]) == 1  # the 100-byte blob, inline in the index


# -- tampered records ------------------------------------------------------------


def _rewrite(path: Path, edit) -> None:
    """Replace a record file with ``edit(payload)``, checksummed again (a deliberate, well-formed lie)."""
    payload = json.loads(path.read_bytes())["record"]
    edit(payload)
    os.chmod(path, 0o644)
    path.write_bytes(encode_record(payload))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def _relocate(path: Path, other: Path) -> None:
    """Put this key's record where another key's belongs (same content, another name)."""
    os.chmod(other, 0o644)
    shutil.copyfile(path, other)


TAMPER = {
    "bad_checksum": (_flip_byte, Reason.CORRUPT_RECORD),
    "newer_format": (lambda p: _rewrite(p, lambda d: d.update(format=RECORD_FORMAT + 1)), Reason.NEWER_RECORD),
    "digest_path_traversal": (lambda p: _rewrite(p, lambda d: d["artifacts"]["a1"].__setitem__(0, "../../../etc/passwd")),
                              Reason.CORRUPT_RECORD),
    "artifact_name_path": (lambda p: _rewrite(p, lambda d: d["artifacts"].__setitem__("../../evil", d["artifacts"]["a1"])),
                           Reason.CORRUPT_RECORD),
    "key_path_traversal": (lambda p: _rewrite(p, lambda d: d.update(key="../../../tmp/x")), Reason.CORRUPT_RECORD),
    "key_of_another_entry": (lambda p: _rewrite(p, lambda d: d.update(key="one")), Reason.CORRUPT_RECORD),
    "inline_bytes_lie": (lambda p: _rewrite(p, lambda d: d["inline"].update(
        {k: "QUFBQQ==" for k in d["inline"]})), Reason.CORRUPT_RECORD),
    "negative_size": (lambda p: _rewrite(p, lambda d: d["artifacts"]["a1"].__setitem__(1, -5)), Reason.CORRUPT_RECORD),
    "world_size_zero": (lambda p: _rewrite(p, lambda d: d.update(world_size=0)), Reason.CORRUPT_RECORD),
    "deep_components": (lambda p: _rewrite(p, lambda d: d.update(components=json.loads("[" * 500 + "]" * 500))),
                        Reason.CORRUPT_RECORD),
    "not_json": (lambda p: (os.chmod(p, 0o644), p.write_bytes(b"\x00\xff" * 100)), Reason.CORRUPT_RECORD),
    "empty": (lambda p: (os.chmod(p, 0o644), p.write_bytes(b"")), Reason.CORRUPT_RECORD),
    "symlink": (lambda p: (p.unlink(), os.symlink("/etc/passwd", p)), Reason.CORRUPT_RECORD),
    "directory": (lambda p: (p.unlink(), p.mkdir()), Reason.CORRUPT_RECORD),
}


@pytest.mark.parametrize("kind", sorted(TAMPER))
def test_a_tampered_record_is_skipped_with_a_reason(store_root, kind):
    with Store.open(store_root, grace_period=0.0) as store:
        save(store, "one", sizes=(100, 70_000))
        save(store, "victim", sizes=(100, 70_000))
        want = _served(store, "one")
    files = RecordFiles(Layout(store_root))
    (path,) = [f.path for f in files.scan() if f.key == "victim"]
    damage, reason = TAMPER[kind]
    damage(path)
    os.truncate(store_root / "index" / "data.mdb", 4096)
    why, report = Store.repair_index(store_root)
    assert report.entries == 1, report
    assert [s.reason for s in report.skipped] == [reason], report.skipped
    assert "victim" in report.skipped[0].path
    with Store.open(store_root, grace_period=0.0) as store:
        assert _served(store, "one") == want
        assert store.lookup("victim", record=False).reason == Reason.ABSENT
        rep = store.verify()  # the tampered file is a problem until --fix moves it to quarantine/
        assert not rep.ok and any(f.kind is Reason.CORRUPT_RECORD for f in rep.findings), rep.to_dict()
        fixed = store.verify(fix=True)
        assert fixed.ok, fixed.to_dict()
        after = store.verify()
        assert after.ok and not after.warnings, after.to_dict()
        assert _served(store, "one") == want
    assert not os.path.lexists(path)


def test_a_symlinked_records_directory_is_refused(store_root, tmp_path):
    """Records would be written through it, wherever it points (invariant 10)."""
    with Store.open(store_root) as store:
        save(store, "k")
    outside = tmp_path / "outside"
    shutil.move(store_root / "records", outside)
    os.symlink(outside, store_root / "records")
    with pytest.raises(UnsafeRoot, match="records/ is a symlink"):
        Store.open(store_root)
    assert _cli(store_root, "verify", "--fix").returncode == 7


def test_decode_record_refuses_a_file_too_large_or_without_a_checksum():
    with pytest.raises(BadRecord, match="no record and checksum"):
        decode_record(b'{"record": {"format": 1}}', "x")
    with pytest.raises(BadRecord, match="more than any record"):
        decode_record(b" " * ((64 << 20) + 1), "x")


# -- verify, gc and crashes ---------------------------------------------------------


def test_a_record_whose_blob_is_gone_is_not_restored_and_is_reported(store_root):
    with Store.open(store_root, grace_period=0.0) as store:
        save(store, "one", sizes=(100, 70_000))
        save(store, "lost", sizes=(100, 70_000))
        big = store.lookup("lost", record=False).manifest.artifacts["a1"]
        path = store.blob_path(big)
    os.chmod(path, 0o644)
    path.write_bytes(b"not the content" * 100)  # corrupt: quarantined by the rebuild
    os.truncate(store_root / "index" / "data.mdb", 4096)
    _, report = Store.repair_index(store_root)
    assert report.entries == 1 and [s.reason for s in report.skipped] == [Reason.BLOB_MISSING]
    with Store.open(store_root, grace_period=0.0) as store:
        assert store.lookup("lost", record=False).reason == Reason.ABSENT
        assert store.lookup("one", record=False).hit
        assert store.verify(fix=True).ok
        assert not store.verify().warnings  # the useless record went (an orphan of the index)


def test_verify_reports_and_fix_repairs_records_out_of_step(store):
    save(store, "a")
    save(store, "b")
    save(store, "c")
    store.pin("c")
    files = RecordFiles(Layout(store.root))
    by_key = {f.key: f for f in files.scan() if f.state is RecordState.COMMITTED}
    by_key["a"].path.unlink()  # a record lost: the entry would not survive a rebuild
    orphan = by_key["b"].path.with_name(f"b.0.{by_key['b'].generation + 1}")
    shutil.copyfile(by_key["b"].path, orphan)
    _rewrite(orphan, lambda d: d.update(generation=d["generation"] + 1))  # a record the index knows nothing of
    files.set_pinned("c", False)  # a pin marker lost
    rep = store.verify()
    kinds = {f.kind for f in rep.findings}
    assert rep.ok and {Reason.MISSING_RECORD, Reason.ORPHAN_RECORDS} <= kinds, rep.to_dict()
    fixed = store.verify(fix=True)
    assert fixed.ok and len(fixed.fixed) >= 3, fixed.to_dict()
    assert not store.verify().warnings
    assert by_key["a"].path.exists() and not orphan.exists() and files.pin_path("c").exists()


def test_a_damaged_record_of_a_sound_index_is_quarantined_and_written_again(store):
    save(store, "k", sizes=(100, 70_000))
    files = RecordFiles(Layout(store.root))
    (found,) = [f for f in files.scan() if f.state is RecordState.COMMITTED]
    good = files.read(found.path)
    _flip_byte(found.path)
    rep = store.verify()
    assert not rep.ok and [f.kind for f in rep.findings if f.problem] == [Reason.CORRUPT_RECORD], rep.to_dict()
    assert store.verify(fix=True).ok
    assert files.read(found.path) == good  # written again from the index
    assert any(p.name.startswith("record.") for p in (store.root / "quarantine").iterdir())
    assert store.verify().ok and not store.verify().warnings


def test_a_hostile_key_in_the_index_names_no_record_file(store, tmp_path):
    """Rows copied under a key that is a path: verify and --fix must not write or move anything outside."""
    from adstore.store.records import manifest_key

    gen = save(store, "k")
    evil = "../../../evil"  # from records/<ab>/: beside the store root, in tmp_path
    with store.index.env.begin(write=True) as txn:
        db = store.index.db
        txn.put(evil.encode(), txn.get(b"k", db=db["entries"]), db=db["entries"])
        txn.put(manifest_key(evil, 0, gen), txn.get(manifest_key("k", 0, gen), db=db["manifests"]),
                db=db["manifests"])
    with pytest.raises(ValueError):
        RecordFiles(Layout(store.root)).committed_path(evil, 0, gen)
    store.verify()
    store.verify(fix=True)
    store.plan_sweep().execute()
    assert store.root.parent == tmp_path and not list(tmp_path.glob("evil*"))
    assert store.lookup("k", record=False).hit


def test_gc_finishes_a_commit_and_sweeps_a_removal_cut_short(store_root):
    """What a process killed between the index transaction and the record files leaves (test_faults cuts
    every step; here each leftover is made by hand), and what a rebuild does with it after gc."""
    with Store.open(store_root, grace_period=0.0) as store:
        save(store, "cut_commit", sizes=(100, 70_000))
        save(store, "cut_removal", sizes=(100, 70_000))
        want = _served(store, "cut_commit")
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
        assert _served(store, "cut_commit") == want
        assert store.lookup("cut_removal", record=False).reason == Reason.ABSENT


def test_a_save_whose_record_cannot_be_written_fails_whole(store, monkeypatch):
    from adstore.store import recordfiles

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    gen = store.new_generation()
    ref = store.put_bytes(b"z" * 100)
    monkeypatch.setattr(recordfiles, "write_chunks", full)
    with pytest.raises(Exception, match="No space left"):
        store.publish("k", generation=gen, artifacts={"a": ref})
    monkeypatch.undo()
    assert store.manifests("k") == [] and store.entry("k") is None  # nothing half-published
    assert not list(RecordFiles(Layout(store.root)).scan())


def test_a_store_without_records_gets_them_from_verify_fix(store):
    """An index written before records existed: verify says what a rebuild would lose, --fix writes them."""
    save(store, "old", world_size=2, sizes=(100, 70_000))
    root = store.root / "records"
    for f in RecordFiles(Layout(store.root)).scan():
        f.path.unlink()
    rep = store.verify()
    assert rep.ok and sum(f.kind is Reason.MISSING_RECORD for f in rep.findings) == 2
    store.verify(fix=True)
    assert not store.verify().warnings
    assert len(list(root.glob("*/old.*"))) == 2


@pytest.mark.slow
def test_rebuild_of_many_entries_restores_them_all(store_root):
    """300 entries of one or two ranks, a third pinned: all back after the index is lost, each with its bytes."""
    with Store.open(store_root, grace_period=0.0) as store:
        for i in range(300):
            save(store, f"k{i}", world_size=1 + i % 2, sizes=(50 + i, 65_536 + i))
            if i % 3 == 0:
                store.pin(f"k{i}")
        want = {f"k{i}": _served(store, f"k{i}") for i in range(300)}
    _damage(store_root, "not_lmdb")
    assert _cli(store_root, "verify", "--fix").returncode == 0
    with Store.open(store_root, grace_period=0.0) as store:
        assert {k: _served(store, k) for k in want} == want
        assert sum(e.pinned for e in store.entries()) == 100
        assert store.verify().ok


def test_a_host_that_holds_one_rank_of_two_gets_it_back(store_root):
    """Ranks on different hosts: each store holds its own rank's manifest, and its rebuild restores that rank."""
    with Store.open(store_root, grace_period=0.0) as store:
        gen = store.new_generation()
        ref = store.put_bytes(b"rank one" * 10_000)
        store.publish("dist", rank=1, world_size=2, generation=gen, artifacts={"m": ref})
        store.commit("dist", rank=1, generation=gen)
        assert store.lookup("dist", rank=1, record=False).hit
        assert store.lookup("dist", record=False).reason == Reason.INCOMPLETE
    os.truncate(store_root / "index" / "data.mdb", 4096)
    _, report = Store.repair_index(store_root)
    assert report.entries == 1 and not report.skipped
    with Store.open(store_root, grace_period=0.0) as store:
        res = store.lookup("dist", rank=1, record=False)
        assert res.hit and res.generation == gen and store.read_artifact(res.manifest, "m") == b"rank one" * 10_000
        assert store.lookup("dist", record=False).reason == Reason.INCOMPLETE  # as before the index was lost
        assert store.verify().ok


def test_choose_prefers_the_newest_complete_generation():
    """A crash between two ranks' commits: the older generation every rank has wins over a newer partial one."""
    from adstore.store import BlobRef
    from adstore.store.fromrecords import choose
    from adstore.store.recordfmt import Record

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
    import time

    files = RecordFiles(Layout(store.root))
    arts = {"a": store.put_bytes(b"z" * 70_000)}
    gen = store.new_generation()
    store.publish("k", generation=gen, artifacts=arts)
    store.commit("k", generation=gen)
    store.plan_remove(["k"]).execute()
    assert [name for name in files.obsoleted() if name.endswith(f"k.0.{gen}")] and files.scan() == []
    time.sleep(0.05)  # file times tick coarsely: the new record must be visibly newer than its list
    arts = {"a": store.put_bytes(b"z" * 70_000)}  # (the removal may have taken the blob too)
    store.publish("k", generation=gen, artifacts=arts)
    store.commit("k", generation=gen)
    assert [f.generation for f in files.scan()] == [gen]
    store.plan_sweep().execute()
    assert [f.generation for f in files.scan()] == [gen] and files.obsolete_files() == []
    want = _served(store, "k")
    store.close()
    os.truncate(store.root / "index" / "data.mdb", 4096)
    assert _cli(store.root, "verify", "--fix").returncode == 0
    with Store.open(store.root) as again:
        assert _served(again, "k") == want


def test_a_tampered_obsolete_list_names_nothing_outside_the_records(store, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    save(store, "live")
    files = RecordFiles(Layout(store.root))
    (live,) = files.scan()
    suffix = MANIFEST_SUFFIX.pack(0, 1)
    hostile = [b"../../victim\x00" + suffix, f"{tmp_path}/victim".encode() + b"\x00" + suffix,
               b"ab/../../../victim\x00" + suffix, b"live\x00" + suffix[:5], b"live", b"\x00",
               "é".encode() + b"\x00" + suffix, b"li\nve\x00" + suffix, b"\xff\xfe\x00" + suffix]
    files.write_obsolete_list([(mk, 3) for mk in hostile] + [(manifest_key("live", 0, live.generation), 1)])
    (listed,) = files.obsolete_files()
    with open(listed, "ab") as f:
        f.write(b"\x01\xff\xffab/../victim")  # a torn or lying last item
    (files.obsolete / "evil.list").write_bytes(b"ab/live.0.1\n" + bytes(100))  # not a list at all
    assert set(files.obsoleted()) == {f"{live.path.parent.name}/{live.path.name}"}
    store.plan_sweep().execute()  # the live record keeps its manifest row: gc keeps the file
    assert victim.read_bytes() == b"keep" and live.path.exists() and files.obsolete_files() == []
    assert store.verify().ok and store.lookup("live", record=False).hit


def test_an_eviction_in_batches_lists_every_record_once_even_when_a_writer_commits_between(store, monkeypatch):
    """Each batch lists the previous batch's records inside its own transaction (the last batch's after it):
    every evicted record is listed exactly once, a record saved meanwhile is not, and a list that cannot be
    written never fails the eviction (its records are orphans that gc sweeps)."""
    files = RecordFiles(Layout(store.root))
    gens = {f"e{i}": save(store, f"e{i}", sizes=(100,)) for i in range(7)}
    plan = store.plan_eviction(max_size=1)
    assert plan.count == 7

    def meanwhile(batch) -> None:  # other writers commit between batches: the next batch re-checks
        if "late" not in gens:
            gens["late"] = save(store, "late", sizes=(100,))
            again = batch.keys[0]  # a restore publishes an evicted generation again before it is listed
            store.publish(again, generation=gens[again], artifacts={"a": store.put_bytes(b"again")})
            store.commit(again, generation=gens[again])
            gens["again"] = again

    plan.execute(batch_size=2, on_batch=meanwhile)
    again = gens.pop("again")
    listed = [name.rpartition("/")[2] for name in files.obsoleted()]
    assert sorted(listed) == sorted(f"e{i}.0.{gens[f'e{i}']}" for i in range(7) if f"e{i}" != again)
    assert len(files.obsolete_files()) == 4  # one list per batch
    assert sorted((f.key, f.generation) for f in files.scan()) == sorted([("late", gens["late"]), (again, gens[again])])
    store.plan_sweep().execute()
    assert files.obsolete_files() == [] and store.verify().ok

    gens = {f"f{i}": save(store, f"f{i}", sizes=(100,)) for i in range(3)}

    def full(self, dropped):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RecordFiles, "write_obsolete_list", full)
    store.plan_eviction(max_size=1).execute(batch_size=1)
    assert store.stats().entries == 0 and files.obsolete_files() == []
    monkeypatch.undo()
    assert {f.key for f in files.scan()} == {"late", again, "f0", "f1", "f2"}  # left behind: orphans
    report = store.verify()
    assert report.ok and [f.kind for f in report.findings] == [Reason.ORPHAN_RECORDS]
    store.plan_sweep().execute()
    assert files.scan() == [] and not store.verify().warnings
