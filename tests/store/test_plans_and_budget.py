"""Typed outcomes of the store: frozen eviction plans, key resolution errors, verify findings,
the budget persisted in the index, pinned-bytes accounting and the entry shadows."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os

import pytest
from store_helpers import check_hit, save

from adstore.store import DEFAULT_GRACE_PERIOD, AmbiguousKey, Budget, KeyNotFound, MinFree, PlanKind, Reason, Store


def _entry_row(store: Store, key: str) -> dict:
    with store.index.env.begin() as txn:
        return json.loads(txn.get(key.encode(), db=store.index.db["entries"]))


def _put_entry_row(store: Store, key: str, obj: dict) -> None:
    """Rewrite an entry row by hand, as JSON with spaces (not the store's encoding)."""
    with store.index.env.begin(write=True) as txn:
        txn.put(key.encode(), json.dumps(obj).encode(), db=store.index.db["entries"])


# ---------------------------------------------------------------- plans
def test_plans_are_frozen_and_say_what_they_do(store):
    save(store, "a")
    save(store, "b")
    evict = store.plan_eviction(max_size=0)
    remove = store.plan_remove(["a"])
    assert evict.kind is PlanKind.EVICT and evict.kind == "evict"
    assert remove.kind is PlanKind.REMOVE and remove.to_dict()["kind"] == "remove"
    assert remove.to_dict()["reason"] == remove.why == "removal requested"
    assert evict.count == len(evict.victims) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        evict.bytes_to_free = 0  # type: ignore[misc]
    twice = store.plan_remove(["a", "a"])
    assert twice.count == 1
    twice.execute()
    assert store.verify().ok and not store.verify().warnings  # totals counted once


def test_execute_in_batches_reports_evicted_entries_and_physical_bytes(store):
    shared = os.urandom(200_000)  # one blob file under every entry: freed with the last of them
    for key in ("a", "b", "c"):
        save(store, key, sizes=(100, 80_000), shared=shared)
    plan = store.plan_eviction(max_size=0)
    before = store.size()
    batches = []
    freed = plan.execute(batch_size=1, on_batch=batches.append)
    assert [b.keys for b in batches] == [(e.key,) for e in plan.victims]
    assert sum(b.bytes_freed for b in batches) == freed == plan.bytes_to_free == before - store.size()
    assert batches[-1].bytes_freed > batches[0].bytes_freed  # the shared blob went with the last entry
    logical = sum(e.bytes for e in plan.victims)
    assert logical > freed  # the batches count physical bytes, not the entries' (logical) bytes


def test_execute_stops_between_batches(store):
    for key in ("a", "b", "c"):
        save(store, key)
    asked = []
    plan = store.plan_eviction(max_size=0)
    plan.execute(batch_size=1, should_stop=lambda: len(asked.append(1) or asked) > 1)
    assert sum(store.lookup(k, count=False).hit for k in ("a", "b", "c")) == 2
    done = []
    plan.execute(batch_size=1, on_batch=lambda batch: done.append(batch) or True)  # True: target reached
    assert len(done) == 1


def test_eviction_log_counts_evicted_not_planned(store, caplog):
    save(store, "a")
    save(store, "b")
    plan = store.plan_eviction(max_size=0)
    with caplog.at_level(logging.INFO, logger="adstore.store.maintenance.eviction"), store.lease("a"):
        plan.execute()
    assert "1 of 2 planned" in caplog.text
    assert store.lookup("a").hit and not store.lookup("b").hit


def test_a_plan_executed_after_another_writer_rechecks_its_victims(store_root):
    """A commit by anyone after the plan (here another store) sends execution down the re-checking path."""
    store = Store.open(store_root, grace_period=0.0)
    other = Store.open(store_root, grace_period=0.0)
    try:
        for key in ("a", "b", "c"):
            save(store, key)
        plan = store.plan_eviction(max_size=0)
        other.pin("b")
        save(other, "c")  # recommitted: its planned row no longer matches
        plan.execute()
        assert [k for k in ("a", "b", "c") if store.lookup(k, count=False).hit] == ["b", "c"]
        assert store.verify().ok
    finally:
        other.close()
        store.close()


@contextlib.contextmanager
def _two_handles_and_a_plan(store_root):
    """Entries a and b, a plan to evict both (a first), and a second handle to commit in between."""
    store = Store.open(store_root, grace_period=0.0)
    other = Store.open(store_root, grace_period=0.0)
    try:
        for key in ("a", "b"):
            save(store, key)
        plan = store.plan_eviction(max_size=0)
        assert [e.key for e in plan.victims] == ["a", "b"]
        yield store, other, plan
        report = store.verify()
        assert report.ok and not report.findings, report.findings
        assert store.stats().pinned_bytes == store.entry("b").bytes  # b, pinned by `other`, kept
    finally:
        other.close()
        store.close()


def test_a_batch_that_drops_nothing_does_not_hide_the_next_writer(store_root):
    """LMDB gives the next write the id of a commit that changed nothing: a batch whose victims all
    no longer qualify must still take its id, or a writer committing right after it looks like
    "nobody wrote since" to the next batch, which then drops rows as planned that have changed."""
    with _two_handles_and_a_plan(store_root) as (store, other, plan):
        assert store.lookup("a").hit  # used since the plan: the first batch drops nothing
        store.flush()
        between = [lambda: other.pin("b")]  # one commit between the batches
        plan.execute(batch_size=1, on_batch=lambda batch: between and between.pop()())
        assert [k for k in ("a", "b") if store.lookup(k, count=False).hit] == ["a", "b"]


def test_a_batch_that_saw_another_writer_leaves_the_later_batches_to_recheck(store_root):
    """A commit between the plan and its first batch sends that batch down the re-checking path,
    which reads only its own victims: the next batch must not take "nothing committed since the
    previous batch" for "every row as planned", or it drops an entry pinned since the plan."""
    with _two_handles_and_a_plan(store_root) as (store, other, plan):
        other.pin("b")  # after the plan, before the first batch
        plan.execute(batch_size=1)
        assert [k for k in ("a", "b") if store.lookup(k, count=False).hit] == ["b"]
        assert store.stats().logical_bytes == store.entry("b").bytes


# ---------------------------------------------------------------- keys
def test_resolve_key_raises_typed_errors(store):
    save(store, "abc1")
    save(store, "abc2")
    with pytest.raises(AmbiguousKey) as amb:
        store.resolve_key("abc")
    assert amb.value.candidates == ["abc1", "abc2"] and amb.value.reason == Reason.AMBIGUOUS_KEY
    with pytest.raises(KeyNotFound) as missing:
        store.resolve_key("zz")
    assert missing.value.reason == "unknown_key"
    with pytest.raises(KeyNotFound):
        store.plan_remove(["zz"])


# ---------------------------------------------------------------- verify
def test_verify_findings_carry_kind_subject_and_detail(store):
    save(store, "k")
    ref = store.lookup("k").manifest.artifacts["a1"]
    path = store.blob_path(ref)
    os.chmod(path, 0o644)
    path.write_bytes(b"x" * ref.size)  # same size, other content
    (store.root / "tmp" / "left-behind.tmp").write_bytes(b"t")
    report = store.verify()
    kinds = {(f.kind, f.subject, f.problem) for f in report.findings}
    assert (Reason.CHECKSUM, ref.digest, True) in kinds
    assert (Reason.STALE_TEMPS, "", False) in kinds
    data = report.to_dict()
    assert {"kind": "checksum", "subject": ref.digest, "severity": "problem"}.items() <= data["findings"][0].items()
    assert data["problems"] == report.problems and all(isinstance(p, str) for p in data["problems"])


# ---------------------------------------------------------------- budget
def test_budget_is_persisted_and_shown_by_stats(store_root):
    budget = Budget(
        max_size=10 << 20, min_free=MinFree(None, 5.0), high_watermark=0.9, low_watermark=0.7, grace_period=30.0
    )
    with Store.open(store_root) as store:
        assert store.budget() is None and store.stats().budget is None
        store.set_budget(budget)
    with Store.open(store_root) as store:  # another process would see the same
        assert store.budget() == budget
        shown = store.stats().to_dict()["budget"]
        assert shown == {
            "max_size": 10 << 20,
            "min_free_bytes": None,
            "min_free_percent": 5.0,
            "high_watermark": 0.9,
            "low_watermark": 0.7,
            "grace_period": 30.0,
        }
    assert budget.limit(size=0, fs_total=100 << 20, fs_free=100 << 20) == 10 << 20
    assert budget.limit(size=1 << 20, fs_total=100 << 20, fs_free=4 << 20) == 0  # under the 5% floor


def test_store_and_daemon_share_one_default_grace_period(store_root):
    from adstore.daemon.config import DaemonConfig

    with Store.open(store_root) as store:
        assert store.grace_period == DEFAULT_GRACE_PERIOD == DaemonConfig.from_mapping({}).grace_period


def test_writer_evicts_inline_under_the_persisted_budget(store_root):
    with Store.open(store_root) as store:
        store.set_budget(
            Budget(max_size=400_000, min_free=None, high_watermark=0.9, low_watermark=0.7, grace_period=0.0)
        )
    store = Store.open(store_root)  # its own grace period is the default: the budget's is used
    try:
        save(store, "a", sizes=(100, 150_000))
        save(store, "b", sizes=(100, 150_000))
        save(store, "c", sizes=(100, 150_000))  # evicts a inline, like the daemon would
        assert store.lookup("a").reason == "absent"
        assert store.size() <= 400_000
        with store.lease("b"), store.lease("c"):
            ref = store.put_bytes(os.urandom(300_000))  # nothing can go: the daemon's budget refuses no write
        assert store.has_blob(ref) and check_hit(store, "b") and store.verify().ok
    finally:
        store.close()


# ---------------------------------------------------------------- pinned bytes
def test_pinned_bytes_follow_pins_saves_and_removals(store):
    save(store, "p")
    save(store, "free")
    assert store.stats().pinned_bytes == 0
    store.pin("p")
    assert store.stats().pinned_bytes == store.entry("p").bytes > 0
    save(store, "p", sizes=(100, 90_000))  # a new generation: other bytes, still pinned
    assert store.stats().pinned_bytes == store.entry("p").bytes == 90_100
    store.unpin("p")
    assert store.stats().pinned_bytes == 0
    store.pin("p")
    store.plan_remove(["p"]).execute()
    assert store.stats().pinned_bytes == 0
    assert store.verify().ok and not store.verify().warnings


def test_pinned_bytes_are_decoded_not_searched_for(store):
    """An entry row written by other means (JSON with spaces) is decoded; verify --fix recounts the total."""
    save(store, "k")
    obj = _entry_row(store, "k")
    obj["pin"] = True
    _put_entry_row(store, "k", obj)  # '"pin": true': a byte search for '"pin":true' misses it
    report = store.verify()
    assert any(f.kind is Reason.TOTALS_DRIFT for f in report.findings)
    store.verify(fix=True)
    assert store.stats().pinned_bytes == obj["b"] > 0
    assert store.entry("k").pinned


# ---------------------------------------------------------------- shadows
def test_a_row_rewritten_by_hand_is_decoded_not_shadowed(store_root):
    store = Store.open(store_root, grace_period=60.0)
    try:
        save(store, "old")
        save(store, "new")
        assert store.plan_eviction(max_size=0).victims == []  # both younger than the grace period
        obj = _entry_row(store, "old")
        obj["t"] -= 3600  # created an hour ago: the shadow no longer matches the row
        _put_entry_row(store, "old", obj)
        plan = store.plan_eviction(max_size=0)
        assert [e.key for e in plan.victims] == ["old"] and plan.victims[0].created == obj["t"]
        plan.execute()
        assert store.lookup("old").reason == "absent" and store.lookup("new").hit
        assert store.verify().ok
    finally:
        store.close()
