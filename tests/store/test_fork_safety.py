"""A store used across ``os.fork()``: children, parent threads and snapshots, hit counters.

Forked children save and read while the parent keeps reading and writing; a
child that uses an inherited store must not reset the parent's LMDB read
snapshot (the store refuses instead); hit counters pending at the fork are
not counted twice.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

from store_helpers import check_hit, save

from adstore.store import Store, StoreError

CTX = mp.get_context("spawn")


def test_use_after_fork_concurrent_children_and_parent(store):
    save(store, "parent")
    stop = threading.Event()

    def read_loop() -> None:  # a parent thread keeps reading while the process forks
        while not stop.is_set():
            assert check_hit(store, "parent")

    reader = threading.Thread(target=read_loop)
    reader.start()
    kids = []
    for c in range(4):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for i in range(5):
                    save(store, f"child{c}-{i}")
                    assert check_hit(store, "parent")
                store.close()
            except BaseException:
                code = 1
            os._exit(code)
        kids.append(pid)
    save(store, "parent2")  # the parent keeps writing while the children do
    stop.set()
    reader.join()
    for pid in kids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    for c in range(4):
        for i in range(5):
            assert check_hit(store, f"child{c}-{i}")
    assert check_hit(store, "parent") and check_hit(store, "parent2")
    assert store.verify().ok


def _snapshot_across_fork(root: str, q) -> None:
    """Parent holds a read transaction; a forked child uses the store; writers churn."""
    store = Store.open(root, grace_period=0.0)
    meta = store.index.db["meta"]
    store.index.write(lambda txn: txn.put(b"probe", b"0" * 2000, db=meta))
    reading = store.index.read()
    txn = reading.__enter__()  # held across the fork, in the forking thread itself
    before = bytes(txn.get(b"probe", db=meta))
    pid = os.fork()
    if pid == 0:
        try:  # the child must not touch the parent's slot; the store refuses instead
            store.put_bytes(b"the child uses the inherited store")
        except StoreError:
            os._exit(0)
        os._exit(3)
    os.waitpid(pid, 0)
    for i in range(1, 40):
        store.index.write(lambda t, i=i: t.put(b"probe", str(i % 10).encode() * 2000, db=meta))
    after = txn.get(b"probe", db=meta)
    q.put(after is not None and bytes(after) == before)
    reading.__exit__(None, None, None)
    store.close()


def test_parent_read_snapshot_survives_a_child_using_the_store(store_root):
    """LMDB snapshot isolation of the parent must not depend on what a forked child does."""
    Store.open(store_root).close()
    q = CTX.Queue()
    p = CTX.Process(target=_snapshot_across_fork, args=(str(store_root), q))
    p.start()
    same = q.get(timeout=60)
    p.join(timeout=30)
    assert p.exitcode == 0
    assert same, "the parent's read transaction saw a later commit (its reader slot was reset by the child)"


def _fork_child_counts(root: str, q) -> None:
    store = Store.open(root, grace_period=0.0, flush_interval=0.2)
    for _ in range(5):
        assert store.lookup("K").hit  # 5 hits pending in this process
    pid = os.fork()
    if pid == 0:
        store.lookup("K")  # 1 hit by the child; it lives long enough for its flusher to run
        time.sleep(1.0)
        os._exit(0)
    os.waitpid(pid, 0)
    store.flush()
    q.put(store.stats().counters.get("hits", 0))
    store.close()


def test_counters_after_fork_are_not_counted_twice(store_root):
    """6 hit lookups happened (5 in the parent, 1 in the child): the store must count 6."""
    with Store.open(store_root, grace_period=0.0) as store:
        save(store, "K")
        store.flush()
        base = store.stats().counters.get("hits", 0)
    q = CTX.Queue()
    p = CTX.Process(target=_fork_child_counts, args=(str(store_root), q))
    p.start()
    hits = q.get(timeout=60)
    p.join(timeout=30)
    assert hits - base == 6, f"{hits - base} hits counted for 6 lookups (pending counters inherited by fork)"
