"""LMDB hygiene across real processes: stale reader slots, map growth, an open racing a growth.

Readers SIGKILLed while holding a read transaction leave reader slots that
the next process to open the store reclaims; many processes writing inline
blobs at once grow the map from 128 KiB; a store opened while another
process grows the map opens cleanly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import lmdb
from store_helpers import parse_payload, payload, save

from adstore.store import Store

CTX = mp.get_context("spawn")


def _hold_reader_and_hang(root: str, ready) -> None:
    store = Store.open(root)
    txn = store.index.read().__enter__()  # a reader slot, held until SIGKILL
    txn.get(b"K", db=store.index.db["entries"])
    ready.set()
    time.sleep(600)


def _open_and_count(root: str, q) -> None:
    store = Store.open(root)
    q.put(store.reader_check())  # already reclaimed at open
    store.close()


def test_stale_reader_slots_of_killed_store_readers_are_reclaimed_at_open(store_root):
    with Store.open(store_root, grace_period=0.0) as store:
        save(store, "K")
    readers = []
    for _ in range(6):
        ready = CTX.Event()
        p = CTX.Process(target=_hold_reader_and_hang, args=(str(store_root), ready))
        p.start()
        readers.append((p, ready))
    for _p, ready in readers:
        assert ready.wait(60)
    env = lmdb.open(str(store_root / "index"), max_dbs=16, readonly=True, lock=True)
    try:
        live = env.readers()
    finally:
        env.close()
    assert sum(str(p.pid) in live for p, _ in readers) == 6, live
    for p, _ in readers:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    # A fresh process opening the store clears the six stale slots itself.
    q = CTX.Queue()
    c = CTX.Process(target=_open_and_count, args=(str(store_root), q))
    c.start()
    assert q.get(timeout=60) == 0
    c.join(timeout=30)
    with Store.open(store_root, grace_period=0.0) as store:
        assert store.reader_check() == 0
        # The pages the dead readers pinned are reusable: rewriting does not grow the file forever.
        before = (store_root / "index" / "data.mdb").stat().st_size
        for _i in range(40):
            save(store, "K", sizes=(30_000, 100))
        after = (store_root / "index" / "data.mdb").stat().st_size
        assert after < before + (8 << 20), (before, after)
        assert store.verify().ok


def _inline_writer(root: str, worker: int, n: int, q, barrier) -> None:
    try:
        store = Store.open(root, map_size=128 << 10, grace_period=0.0)
        barrier.wait(60)  # everybody opened at 128 KiB; now all write at once
        for i in range(n):
            key = f"w{worker}-{i}"
            gen = store.new_generation()
            arts = {"blob": store.put_bytes(payload(key, gen, 0, "blob", 30_000 + worker))}
            store.publish(key, generation=gen, artifacts=arts)
            store.commit(key, generation=gen)
        q.put(("ok", worker, store.index.map_size()))
        store.close()
    except BaseException:  # noqa: BLE001
        import traceback

        q.put(("error", worker, traceback.format_exc()[-1500:]))


def test_map_grows_under_many_concurrent_writers(store_root):
    Store.open(store_root, map_size=128 << 10).close()
    q = CTX.Queue()
    barrier = CTX.Barrier(6)
    workers = [CTX.Process(target=_inline_writer, args=(str(store_root), w, 25, q, barrier)) for w in range(6)]
    for p in workers:
        p.start()
    results = [q.get(timeout=300) for _ in workers]
    for p in workers:
        p.join(timeout=60)
    assert all(r[0] == "ok" for r in results), results
    assert max(r[2] for r in results) >= 4 << 20  # 6 x 25 x 30 KB inline: grew many times from 128 KiB
    with Store.open(store_root, grace_period=0.0) as store:
        assert store.verify().ok
        for w in range(6):
            for i in range(25):
                res = store.lookup(f"w{w}-{i}")
                assert res.hit, (w, i, res.reason)
                assert parse_payload(store.read_artifact(res.manifest, "blob"))[0] == f"w{w}-{i}"


def _grow_map(root: str) -> None:
    store = Store.open(root, map_size=128 << 10, grace_period=0.0)
    start = store.index.map_size()
    while store.index.map_size() < 4 * start:
        store.put_bytes(os.urandom(40_000))
    store.close()


def _open_while_another_process_grows(root: str, q) -> None:
    """Open the store; between lmdb.open and the first transaction another process grows the map."""
    import adstore.store.index.env as index_mod

    real_open = index_mod.lmdb.open

    def open_then_grow(*args, **kwargs):
        env = real_open(*args, **kwargs)
        p = CTX.Process(target=_grow_map, args=(root,))
        p.start()
        p.join(60)
        return env

    index_mod.lmdb.open = open_then_grow
    try:
        Store.open(root, map_size=128 << 10).close()
        q.put("ok")
    except BaseException as exc:  # noqa: BLE001
        q.put(f"{type(exc).__name__}: {exc}")


def test_open_while_another_process_grows_the_map(store_root):
    Store.open(store_root, map_size=128 << 10).close()
    q = CTX.Queue()
    p = CTX.Process(target=_open_while_another_process_grows, args=(str(store_root), q))
    p.start()
    outcome = q.get(timeout=120)
    p.join(timeout=30)
    assert outcome == "ok", outcome
