"""Owed releases: an eviction batch that frees no blob owes its references instead of rewriting blob rows.

Refcounts may then be higher than the manifests (never lower); whoever next
releases (a settling batch, the sweep, a pass cut short) takes every owed row
in one transaction, and ``verify`` counts them, also after a process was
killed in the middle of a pass.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections import Counter
from pathlib import Path

from store_helpers import save

from adstore.store import Store

CTX = mp.get_context("spawn")
SHARED = [os.urandom(5000) for _ in range(3)]


def _owed(store: Store) -> Counter:
    with store._tables.read() as t:
        return t.owed_releases()


def _refs(store: Store, digest: str) -> int | None:
    with store._tables.read() as t:
        row = t.blob_row(digest)
        return None if row is None else row.refs


def _fill(store: Store, n: int) -> None:
    """Entries ``e00``.. over three shared blobs only: an entry's references are rarely a blob's last."""
    for i in range(n):
        save(store, f"e{i:02d}", sizes=(), shared=SHARED[i % 3])


def test_batches_that_free_nothing_owe_and_the_last_releases(store):
    _fill(store, 12)
    shared = [store.put_bytes(b).digest for b in SHARED]
    assert [_refs(store, d) for d in shared] == [4, 4, 4]
    plan = store.plan_eviction(max_size=1)
    seen: list[tuple[int, bool, list[int]]] = []

    def each(batch) -> None:  # mid-pass: owed rows, refcounts above the manifests, verify still sound
        seen.append((sum(_owed(store).values()), store.verify().ok, [_refs(store, d) for d in shared]))

    plan.execute(batch_size=2, on_batch=each)
    assert store.stats().entries == 0 and store.stats().blobs == 0 and not _owed(store)
    # e00..e07 drop no blob's last reference: those four batches owe and leave the blob rows as they
    # were; the batch of e08, e09 (the last of blob 0) releases all owed, and the last batch the rest.
    assert [owed for owed, _, _ in seen] == [2, 4, 6, 8, 0, 0]
    assert [refs for _, _, refs in seen] == [[4, 4, 4]] * 4 + [[None, 1, 1], [None, None, None]]
    assert all(ok for _, ok, _ in seen) and store.verify().ok


def test_a_pass_cut_short_releases_what_it_owed(store):
    _fill(store, 12)
    shared = [store.put_bytes(b).digest for b in SHARED]
    plan = store.plan_eviction(max_size=1)
    plan.execute(batch_size=1, on_batch=lambda batch: True)  # a target reached after the first batch
    assert not _owed(store)
    assert [_refs(store, d) for d in shared] == [3, 4, 4]  # e00's reference, owed then released
    assert store.verify().ok and not store.verify().findings


def _killed_mid_pass(root: str) -> None:
    store = Store.open(root, grace_period=0.0)
    batches = []

    def each(batch) -> None:
        batches.append(batch)
        with store._tables.read() as t:
            if t.owed_releases():  # a batch owes: die before anything releases it
                os.kill(os.getpid(), signal.SIGKILL)

    store.plan_eviction(max_size=1).execute(batch_size=1, on_batch=each)


def _owing_store(root: Path, n: int) -> None:
    """``n`` entries, then a pass SIGKILLed after its first batch that owed (in another process)."""
    with Store.open(root, grace_period=0.0) as store:
        _fill(store, n)
    p = CTX.Process(target=_killed_mid_pass, args=(str(root),))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL


def test_a_pass_killed_while_owing_leaves_a_sound_store_that_the_next_release_settles(store_root):
    _owing_store(store_root, 9)
    with Store.open(store_root, grace_period=0.0) as store:
        owed = _owed(store)
        assert owed
        report = store.verify()
        assert report.ok, report.problems
        left = store.stats().entries
        assert 0 < left < 9
        for i in range(9):  # what the killed pass left is served as before
            res = store.lookup(f"e{i:02d}", record=False)
            assert res.hit == (store.entry(f"e{i:02d}") is not None)
        plan = store.plan_eviction(max_size=1)  # planned with the owed references counted
        assert plan.count == left
        store.plan_sweep().execute()  # the sweep releases them
        assert not _owed(store) and store.verify().ok and not store.verify().findings
        plan.execute(batch_size=2)
        assert store.stats().entries == 0 and store.stats().blobs == 0 and store.verify().ok


def test_verify_fix_leaves_owed_references_of_a_sound_store_for_the_next_release(store_root):
    _owing_store(store_root, 6)
    with Store.open(store_root, grace_period=0.0) as store:
        owed = _owed(store)
        assert owed
        assert store.verify(fix=True).ok and _owed(store) == owed  # sound: nothing to repair
        store.plan_eviction(max_size=1).execute()
        assert not _owed(store) and store.stats().blobs == 0 and store.verify().ok


def test_a_torn_owed_row_counts_whole_digests_only(store):
    _fill(store, 3)
    digest = bytes.fromhex(store.put_bytes(SHARED[0]).digest)
    store._tables.write(lambda t: t.raw.put(b"torn", digest + digest[:7], db=t._db["releases"]))
    assert _owed(store) == Counter({digest: 1})
    assert not store.verify().ok  # one reference owed that no batch dropped: a refcount finding
    assert store.verify(fix=True).ok and not _owed(store) and store.verify().ok


def test_owed_rows_do_not_outlive_a_removal(store):
    _fill(store, 6)
    store.plan_remove([f"e{i:02d}" for i in range(6)]).execute(batch_size=1)
    assert not _owed(store) and store.stats().blobs == 0 and store.verify().ok
