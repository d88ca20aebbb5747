"""The record files follow the index: every publish, commit, pin, removal, eviction batch and failure.

Each change of the index leaves the records in step (dropped records named
by obsolete lists that gc deletes); a save whose record cannot be written
fails whole; an index without records gets them from ``verify --fix``; the
remote payload is the record format without its local fields.
"""

from __future__ import annotations

import json

import pytest
from store_helpers import save

from adstore.store import Reason
from adstore.store.layout import Layout
from adstore.store.records.files import RecordFiles, RecordState
from adstore.store.records.format import RAW_FORMAT


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
    assert payload["format"] == RAW_FORMAT and "inline" not in payload and "producer" not in payload
    (found,) = [f for f in RecordFiles(Layout(store.root)).scan() if f.state is RecordState.COMMITTED]
    local = json.loads(found.path.read_bytes())["record"]
    assert {k: v for k, v in local.items() if k not in ("inline", "producer")} == payload
    assert len(local["inline"]) == 1  # the 100-byte blob, inline in the index


def test_a_save_whose_record_cannot_be_written_fails_whole(store, monkeypatch):
    from adstore.store.records import files as recordfiles

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
