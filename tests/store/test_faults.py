"""Fault injection on a real store: SIGKILL at every I/O step, LMDB hygiene, corruption.

Kill points are deterministic, not timing luck.  A spawned driver process
forks one child per kill point ``k``; the child wraps every file-system call
the store makes (``os.open/write/fsync/chmod/replace/rename/unlink/mkdir``)
and both sides of every LMDB write-transaction commit with a counter, runs a
fixed sequence (a two-rank save that replaces an older generation, an
explicit removal of another entry, an orphan sweep, close) and SIGKILLs
itself at tick ``k``.  Each tick is reported through a pipe before it runs,
so the driver knows exactly where the child died.  After every kill the
driver checks that ``verify()`` finds no problem, that the replaced key is
served as exactly the old or exactly the new generation (a commit that
returned is durable; nothing before the first commit is visible), that the
removed entry is intact or absent, that a copy swept by gc and then rebuilt
from its on-disk records serves exactly the same (invariant 9), and that
the next writer is not blocked (LMDB's writer lock of the dead process is
recovered).

The sweep continues with k = 0, 3, 5, 8, 10, ... (steps alternating 3 and
2, so periodic sequences such as one blob write are cut at every phase) until
a child finishes without being killed; the slow run cuts every single tick.  The number of kill points is printed (run with ``-s``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import lmdb
import pytest
from adstore.store import BlobMissing, ChecksumMismatch, CorruptRecord, Store, StoreError
from adstore.store.records import manifest_key
from store_helpers import check_hit, parse_payload, payload, report_figures, save

CTX = mp.get_context("spawn")

# --------------------------------------------------------------------------- kill-point machinery

_TRAPPED_OS = ("open", "write", "fsync", "chmod", "replace", "rename", "unlink", "mkdir")


def _wait_for_trap(pid: int, r_fd: int) -> tuple[int, list[str]]:
    """Read a trapped child's step trace until it exits (or is killed); returns (status, lines)."""
    chunks = []
    while chunk := os.read(r_fd, 65536):
        chunks.append(chunk)
    os.close(r_fd)
    _, status = os.waitpid(pid, 0)
    return status, b"".join(chunks).decode().splitlines()


class _Trap:
    """Counts I/O steps in a forked child; SIGKILLs the process at step ``kill_at``."""

    def __init__(self, kill_at: int, report_fd: int) -> None:
        self.kill_at = kill_at
        self.n = 0
        self.fd = report_fd
        self.real_write = os.write

    def note(self, label: str) -> None:
        self.real_write(self.fd, (label + "\n").encode())

    def tick(self, label: str) -> None:
        self.note(f"{self.n}:{label}")
        if self.n == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.n += 1

    def install(self) -> None:
        from adstore.store.index import Index

        for name in _TRAPPED_OS:
            real = getattr(os, name)

            def wrapper(*args, __real=real, __name=name, **kwargs):
                self.tick(f"os.{__name}")
                return __real(*args, **kwargs)

            setattr(os, name, wrapper)
        real_txn = Index.write

        def write(index, fn):
            def inner(txn):
                result = fn(txn)
                self.tick("txn.before_commit")  # killed holding LMDB's writer lock
                return result

            result = real_txn(index, inner)
            self.tick("txn.after_commit")
            return result

        Index.write = write  # type: ignore[method-assign]


def _scenario(root: str, gen_new: int, trap: _Trap) -> None:
    """The sequence every kill point cuts: save K (2 ranks), remove 'victim', sweep, close."""
    store = Store.open(root, grace_period=0.0, flush_interval=3600.0)  # no flusher thread ticks
    art: dict[int, dict] = {}
    for rank in range(2):
        trap.note(f"phase:put{rank}")
        small = store.put_bytes(payload("K", gen_new, rank, "small", 100))
        big_src = Path(root).parent / f"src-{os.getpid()}-{rank}"
        if rank == 1:  # rank 1's big artifact goes through put_file
            with open(big_src, "wb") as f:
                f.write(payload("K", gen_new, rank, "big", 70_000))
            big = store.put_file(big_src)
        else:
            big = store.put_bytes(payload("K", gen_new, rank, "big", 70_000))
        art[rank] = {"small": small, "big": big}
    for rank in range(2):
        trap.note(f"phase:publish{rank}")
        store.publish("K", rank=rank, world_size=2, generation=gen_new, artifacts=art[rank],
                      components={"key": "K"})
    for rank in range(2):
        trap.note(f"phase:commit{rank}")
        store.commit("K", rank=rank, generation=gen_new)
        trap.note(f"done:commit{rank}")
    trap.note("phase:remove")
    store.plan_remove(["victim"]).execute()
    trap.note("done:remove")
    trap.note("phase:sweep")
    store.plan_sweep().execute()
    trap.note("phase:close")
    store.lookup("K")  # pending counters, so close() writes them
    store.close()
    trap.note("done:all")


def _current_gen(store: Store, key: str) -> int | None:
    res = store.lookup(key, record=False)
    return res.generation if res.hit else None


def _check_served(store: Store, key: str) -> tuple[bool, int | None, str | None]:
    """Lookup ``key``; a hit must be one whole generation (self-describing payloads)."""
    res = store.lookup(key, record=False)
    if not res.hit:
        return False, None, res.reason
    gens = set()
    for rank, m in res.manifests.items():
        for name in m.artifacts:
            k, gen, r, n = parse_payload(store.read_artifact(m, name))
            assert (k, r, n) == (key, rank, name), (k, r, n, key, rank, name)
            assert gen == m.generation
            gens.add(gen)
    assert len(gens) == 1, f"mixed generations served: {gens}"
    return True, gens.pop(), None


def _save_k(store: Store, gen: int) -> None:
    for rank in range(2):
        arts = {"small": store.put_bytes(payload("K", gen, rank, "small", 100)),
                "big": store.put_bytes(payload("K", gen, rank, "big", 70_000))}
        store.publish("K", rank=rank, world_size=2, generation=gen, artifacts=arts, components={"key": "K"})
    for rank in range(2):
        store.commit("K", rank=rank, generation=gen)


def _victim(store: Store) -> None:
    gen = store.new_generation()
    arts = {"v": store.put_bytes(payload("victim", gen, 0, "v", 90_000))}
    store.publish("victim", generation=gen, artifacts=arts)
    store.commit("victim", generation=gen)


def kill_point_driver(root: str, stride: int, seed: int, q) -> None:
    """Runs in a spawned process: one forked child per kill point, checks after each."""
    rng = random.Random(seed)
    failures: list[str] = []
    outcomes: Counter[str] = Counter()
    labels: Counter[str] = Counter()
    kill_points = 0
    k = 0
    completed = False
    while not completed and k < 5000:
        with Store.open(root, grace_period=0.0) as store:  # baseline: K committed, victim present
            # gc first, untrapped: what earlier cut runs left (obsolete lists, orphans) would otherwise
            # grow the scenario's own sweep by a few steps per run, and k would never catch up with it.
            store.plan_sweep().execute()
            gen_old = _current_gen(store, "K")
            if gen_old is None:
                gen_old = store.new_generation()
                _save_k(store, gen_old)
            if store.entry("victim") is None:
                _victim(store)
        gen_new = rng.getrandbits(60) + 1
        r_fd, w_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: trap, run, die at tick k (or finish)
            os.close(r_fd)
            try:
                trap = _Trap(k, w_fd)
                trap.install()
                _scenario(root, gen_new, trap)
                code = 0
            except BaseException:
                code = 3
            os._exit(code)
        os.close(w_fd)
        status, trace = _wait_for_trap(pid, r_fd)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not killed:
            if os.waitstatus_to_exitcode(status) != 0:
                failures.append(f"k={k}: scenario failed without a kill (exit {status}); trace tail {trace[-3:]}")
                break
            completed = True
        else:
            kill_points += 1
            last = next((line for line in reversed(trace) if line[:1].isdigit()), "?:?")
            labels[last.split(":", 1)[1]] += 1
        marks = {line for line in trace if not line[:1].isdigit()}
        where = f"k={k} ({trace[-1] if trace else 'before start'})"
        try:
            with Store.open(root, grace_period=0.0) as store:
                rep = store.verify()
                if not rep.ok:
                    failures.append(f"{where}: verify problems {rep.problems[:3]}")
                hit, gen, reason = _check_served(store, "K")
                committed0 = "done:commit0" in marks or _committed_in_phase(trace, "commit0")
                committed1 = "done:commit1" in marks or _committed_in_phase(trace, "commit1")
                if committed1:
                    ok = hit and gen == gen_new
                elif committed0:
                    ok = (not hit and reason == "generation_mismatch")
                else:
                    ok = hit and gen == gen_old
                if not ok:
                    failures.append(f"{where}: K served hit={hit} gen={'new' if gen == gen_new else gen} "
                                    f"reason={reason} (commit0 durable={committed0}, commit1={committed1})")
                outcomes["K:new" if gen == gen_new else "K:old" if hit else f"K:miss:{reason}"] += 1
                removed = "done:remove" in marks or _committed_in_phase(trace, "remove")
                v_hit, _, v_reason = _check_served_victim(store)
                if removed and store.entry("victim") is not None:
                    failures.append(f"{where}: victim still present after its removal committed")
                if not removed and not v_hit:
                    failures.append(f"{where}: victim lost before its removal committed ({v_reason})")
                # The records say what the index says: gc, then a lost index rebuilt from them (invariant 9).
                disagreement = _rebuild_disagrees(root, (hit, gen), v_hit)
                if disagreement:
                    failures.append(f"{where}: {disagreement}")
                # The next writer must not be blocked by the dead child's LMDB writer lock.
                t0 = time.monotonic()
                save(store, "probe", sizes=(50, 66_000))
                if time.monotonic() - t0 > 10:
                    failures.append(f"{where}: next write took {time.monotonic() - t0:.1f}s")
                if not check_hit(store, "probe"):
                    failures.append(f"{where}: probe save not restorable")
        except Exception as exc:  # noqa: BLE001 - report, the parent fails the test
            failures.append(f"{where}: {type(exc).__name__}: {exc}")
        if len(failures) > 20:
            break
        k += stride if stride > 0 else (2 if kill_points % 2 else 3)
    with Store.open(root, grace_period=0.0) as store:  # a final gc leaves nothing behind
        store.plan_sweep().execute()
        rep = store.verify()
        if not rep.ok or rep.warnings:
            failures.append(f"after final sweep: {rep.to_dict()}")
    q.put({"kill_points": kill_points, "completed": completed, "last_k": k, "failures": failures,
           "outcomes": dict(outcomes), "killed_at": dict(labels)})


def _rebuild_disagrees(root: str, k_served: tuple[bool, int | None], victim_hit: bool) -> str | None:
    """Copy the store, sweep it as gc would, lose its index, rebuild it from the records, compare.

    gc first: it removes the records of a removal cut short after its
    commit and finishes a commit cut short before its rename, so afterwards
    the rebuilt index must serve exactly what the sound one served: K as the
    same generation (or a miss), the victim present or gone.
    """
    copy = Path(root).parent / "rebuilt-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(root, copy, symlinks=True, ignore=shutil.ignore_patterns("lock.mdb"))
    try:
        with Store.open(copy, grace_period=0.0) as store:
            store.plan_sweep().execute()
        os.truncate(copy / "index" / "data.mdb", 8192)
        if Store.repair_index(copy) is None:
            return "a truncated index was not rebuilt"
        with Store.open(copy, grace_period=0.0) as store:
            hit, gen, reason = _check_served(store, "K")
            v_hit = _check_served_victim(store)[0]
        if (hit, gen if hit else None) != (k_served[0], k_served[1] if k_served[0] else None):
            return f"rebuilt index serves K hit={hit} gen={gen} ({reason}), the sound one hit={k_served}"
        if v_hit != victim_hit:
            return f"rebuilt index has the victim {'back' if v_hit else 'lost'} (sound index: {victim_hit})"
        return None
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def _committed_in_phase(trace: list[str], phase: str) -> bool:
    """True when a ``txn.after_commit`` tick *started* inside ``phase``... i.e. a commit returned.

    A tick is reported before it runs, so ``txn.after_commit`` reached means the
    transaction's commit call returned.  Only the first write transaction of the
    phase counts (``commit`` and ``remove`` are one transaction each).
    """
    inside = False
    for line in trace:
        if line == f"phase:{phase}":
            inside = True
        elif line.startswith("phase:") or line.startswith("done:"):
            inside = False
        elif inside and line.endswith(":txn.after_commit"):
            return True
    return False


def _check_served_victim(store: Store) -> tuple[bool, int | None, str | None]:
    res = store.lookup("victim", record=False)
    if not res.hit:
        return False, None, res.reason
    k, gen, r, n = parse_payload(store.read_artifact(res.manifest, "v"))
    assert (k, r, n, gen) == ("victim", 0, "v", res.generation)
    return True, gen, None


def _run_driver(root: Path, stride: int, seed: int) -> dict:
    Store.open(root).close()
    q = CTX.Queue()
    p = CTX.Process(target=kill_point_driver, args=(str(root), stride, seed, q))
    p.start()
    result = q.get(timeout=900)
    p.join(timeout=60)
    assert p.exitcode == 0
    print(f"\nkill points tried: {result['kill_points']} ({'every tick' if stride == 1 else 'sampled'}); outcomes {result['outcomes']}; "
          f"killed at {result['killed_at']}")
    _report("kill_points" + ("_every_tick" if stride == 1 else ""), {**result, "stride": stride})
    return result


def _report(name: str, data: dict) -> None:
    report_figures(name, data)


def test_sigkill_at_sampled_io_steps_of_save_publish_commit_remove_sweep(tmp_path):
    result = _run_driver(tmp_path / "store", stride=0, seed=1)
    assert result["completed"], result
    assert not result["failures"], "\n".join(result["failures"])
    assert result["kill_points"] >= 15
    # Every kind of step was cut at least once, including an open LMDB write transaction.
    assert {"txn.before_commit", "txn.after_commit", "os.replace", "os.fsync"} <= set(result["killed_at"])


@pytest.mark.slow
def test_sigkill_at_every_io_step(tmp_path):
    result = _run_driver(tmp_path / "store", stride=1, seed=2)
    assert result["completed"], result
    assert not result["failures"], "\n".join(result["failures"])
    assert result["kill_points"] >= 60


# --------------------------------------------------------------------------- kill points in the daemon's eviction

_EVICT_KEYS = [f"e{i:02d}" for i in range(24)]


def _evict_baseline(store: Store) -> None:
    """24 entries of ~70 KB (half of them 2-rank), all past the grace period, one leased."""
    for i, key in enumerate(_EVICT_KEYS):
        if store.lookup(key, record=False).hit:
            continue
        if store.entry(key) is not None:  # a generation_mismatch leftover is re-saved whole
            store.plan_remove([key]).execute()
        save(store, key, world_size=1 + i % 2, sizes=(120, 70_000))


def eviction_kill_driver(root: str, q, stride: int = 0) -> None:
    """Like ``kill_point_driver``, but the child runs one daemon enforcement pass (batches + sweep)."""
    from adstore.daemon.config import DaemonConfig
    from adstore.daemon.enforce import Enforcer

    config = DaemonConfig(max_size=1_200_000, high_watermark=0.9, low_watermark=0.5, grace_period=0.0,
                          batch_size=3)
    failures: list[str] = []
    labels: Counter[str] = Counter()
    kill_points = evicted_total = 0
    completed = False
    k = 0
    lease_ready = os.pipe()
    holder = os.fork()
    if holder == 0:  # another process restores e00 for the whole run: it must never be evicted
        store = Store.open(root)
        with store.lease("e00"):
            os.write(lease_ready[1], b"x")
            time.sleep(3600)
        os._exit(0)
    os.read(lease_ready[0], 1)
    try:
        while not completed and k < 5000:
            with Store.open(root, grace_period=0.0) as store:
                _evict_baseline(store)
                store.plan_sweep().execute()
            r_fd, w_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r_fd)
                code = 0
                try:
                    trap = _Trap(k, w_fd)
                    trap.install()
                    store = Store.open(root, grace_period=0.0, flush_interval=3600.0)
                    trap.note("phase:pass")
                    Enforcer(store, config).run_pass(sweep=True)
                    trap.note("done:pass")
                    store.close()
                except BaseException:
                    code = 3
                os._exit(code)
            os.close(w_fd)
            status, trace = _wait_for_trap(pid, r_fd)
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                kill_points += 1
                last = next((line for line in reversed(trace) if line[:1].isdigit()), "?:?")
                labels[last.split(":", 1)[1]] += 1
            elif os.waitstatus_to_exitcode(status) == 0:
                completed = True
            else:
                failures.append(f"k={k}: enforcement pass failed without a kill (exit {status})")
                break
            where = f"k={k} ({trace[-1] if trace else 'before start'})"
            try:
                with Store.open(root, grace_period=0.0) as store:
                    rep = store.verify()
                    if not rep.ok:
                        failures.append(f"{where}: verify problems {rep.problems[:3]}")
                    for key in _EVICT_KEYS:
                        res = store.lookup(key, record=False)
                        if res.hit:
                            check_hit(store, key)
                        elif store.entry(key) is not None:
                            failures.append(f"{where}: {key} left half-evicted ({res.reason})")
                        else:
                            evicted_total += 1
                    if not store.lookup("e00", record=False).hit:
                        failures.append(f"{where}: the leased entry was evicted")
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{where}: {type(exc).__name__}: {exc}")
            if len(failures) > 20:
                break
            k += stride if stride > 0 else (4 if kill_points % 2 else 5)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    q.put({"kill_points": kill_points, "completed": completed, "failures": failures,
           "killed_at": dict(labels), "entries_evicted_over_all_rounds": evicted_total})


def _run_eviction_driver(tmp_path: Path, stride: int) -> dict:
    pytest.importorskip("adstore.daemon.enforce")
    root = tmp_path / "store"
    Store.open(root).close()
    q = CTX.Queue()
    p = CTX.Process(target=eviction_kill_driver, args=(str(root), q, stride))
    p.start()
    result = q.get(timeout=900)
    p.join(timeout=60)
    print(f"\ndaemon eviction kill points: {result['kill_points']}; killed at {result['killed_at']}")
    _report("eviction_kill_points" + ("_every_tick" if stride == 1 else ""), result)
    return result


def test_sigkill_the_daemons_eviction_pass_at_sampled_io_steps(tmp_path):
    result = _run_eviction_driver(tmp_path, 0)
    assert result["completed"], result
    assert not result["failures"], "\n".join(result["failures"])
    assert result["kill_points"] >= 8
    assert result["entries_evicted_over_all_rounds"] > 0
    assert "txn.before_commit" in result["killed_at"] and "os.unlink" in result["killed_at"]


@pytest.mark.slow
def test_sigkill_the_daemons_eviction_pass_at_every_io_step(tmp_path):
    result = _run_eviction_driver(tmp_path, 1)
    assert result["completed"], result
    assert not result["failures"], "\n".join(result["failures"])
    assert result["kill_points"] >= 40


# --------------------------------------------------------------------------- timing sweep with the real writer


def _timed_writer(root: str, ready) -> None:
    store = Store.open(root, grace_period=0.0)
    ready.set()
    i = 0
    while True:
        save(store, f"t{i % 5}", world_size=2, sizes=(200, 80_000))
        if i % 4 == 3:
            store.plan_remove([f"t{(i + 2) % 5}"]).execute() if store.entry(f"t{(i + 2) % 5}") else None
        i += 1


@pytest.mark.slow
def test_sigkill_writer_after_n_milliseconds_sweep(tmp_path):
    """A writer saving in a loop, killed 0, 7, 14, ... ms after it is ready."""
    root = tmp_path / "store"
    Store.open(root).close()
    kills = 0
    for delay_ms in range(0, 400, 7):
        ready = CTX.Event()
        p = CTX.Process(target=_timed_writer, args=(str(root), ready))
        p.start()
        assert ready.wait(60)
        time.sleep(delay_ms / 1000)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        kills += 1
        with Store.open(root, grace_period=0.0) as store:
            rep = store.verify()
            assert rep.ok, (delay_ms, rep.problems)
            for entry in store.entries():
                check_hit(store, entry.key)
    print(f"\ntimed kill points: {kills}")
    _report("timed_kills", {"kills": kills})


# --------------------------------------------------------------------------- LMDB hygiene


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
    for p, ready in readers:
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
        for i in range(40):
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
    import adstore.store.index as index_mod

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


# --------------------------------------------------------------------------- corruption

def _populate(store: Store) -> dict[str, int]:
    return {key: save(store, key, sizes=(100, 70_000)) for key in ("a", "b", "c", "d")}


def _flip(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _big_path(store: Store, key: str) -> Path:
    path = store.blob_path(store.lookup(key, record=False).manifest.artifacts["a1"])
    assert path is not None
    return path


def _file_damage(kind: str):
    def damage(store: Store, key: str) -> None:
        path = _big_path(store, key)
        if kind == "flip_first":
            _flip(path, 0)
        elif kind == "flip_middle":
            _flip(path, 35_000)
        elif kind == "flip_last":
            _flip(path, 69_999)
        elif kind == "truncate_zero":
            os.chmod(path, 0o644)
            os.truncate(path, 0)
        elif kind == "truncate_half":
            os.chmod(path, 0o644)
            os.truncate(path, 35_000)
        elif kind == "append":
            os.chmod(path, 0o644)
            with open(path, "ab") as f:
                f.write(b"tail")
        elif kind == "same_size_garbage":
            os.chmod(path, 0o644)
            path.write_bytes(os.urandom(70_000))
        elif kind == "missing":
            path.unlink()
        elif kind == "symlink_elsewhere":
            decoy = store.root.parent / "decoy"
            decoy.write_bytes(b"x" * 70_000)
            path.unlink()
            path.symlink_to(decoy)
        elif kind == "directory":
            path.unlink()
            path.mkdir()
        else:
            raise AssertionError(kind)
    return damage


FILE_DAMAGE = ["flip_first", "flip_middle", "flip_last", "truncate_zero", "truncate_half", "append",
               "same_size_garbage", "missing", "symlink_elsewhere", "directory"]


def _rows(store: Store, dbname: str, fn) -> None:
    with store.index.env.begin(write=True) as txn:
        fn(txn, store.index.db[dbname])


def _lmdb_damage(kind: str):
    def damage(store: Store, key: str) -> None:
        res = store.lookup(key, record=False)
        m = res.manifest
        small = bytes.fromhex(m.artifacts["a0"].digest)
        mk = manifest_key(key, 0, m.generation)
        if kind == "inline_flip":
            def fn(txn, db):
                data = bytearray(txn.get(small, db=db))
                data[10] ^= 1
                txn.put(small, bytes(data), db=db)
            _rows(store, "blobdata", fn)
        elif kind == "inline_missing":
            _rows(store, "blobdata", lambda txn, db: txn.delete(small, db=db))
        elif kind == "blob_row_short":
            _rows(store, "blobs", lambda txn, db: txn.put(small, b"\x01\x02\x03", db=db))
        elif kind == "blob_row_deleted":
            _rows(store, "blobs", lambda txn, db: txn.delete(small, db=db))
        elif kind == "manifest_not_json":
            _rows(store, "manifests", lambda txn, db: txn.put(mk, b"\x80\x03not json", db=db))
        elif kind == "manifest_wrong_fields":
            _rows(store, "manifests", lambda txn, db: txn.put(mk, b'{"ws": "two", "a": 5}', db=db))
        elif kind == "manifest_artifacts_not_pairs":
            _rows(store, "manifests", lambda txn, db: txn.put(mk, b'{"ws": 1, "c": true, "a": {"a0": 7}}', db=db))
        elif kind == "entry_wrong_fields":
            _rows(store, "entries", lambda txn, db: txn.put(key.encode(), b'{"ns": "x", "ws": 1, "t": 0, "la": 0, '
                                                          b'"r": [1, 2]}', db=db))
        elif kind == "manifest_deleted":
            _rows(store, "manifests", lambda txn, db: txn.delete(mk, db=db))
        elif kind == "entry_not_json":
            _rows(store, "entries", lambda txn, db: txn.put(key.encode(), b"{{{", db=db))
        elif kind == "entry_wrong_generation":
            def fn(txn, db):
                obj = json.loads(bytes(txn.get(key.encode(), db=db)))
                obj["r"]["0"] = obj["r"]["0"] ^ 12345
                txn.put(key.encode(), json.dumps(obj).encode(), db=db)
            _rows(store, "entries", fn)
        elif kind == "manifest_uncommitted_flag":
            def fn(txn, db):
                obj = json.loads(bytes(txn.get(mk, db=db)))
                obj["c"] = False
                txn.put(mk, json.dumps(obj).encode(), db=db)
            _rows(store, "manifests", fn)
        else:
            raise AssertionError(kind)
    return damage


LMDB_DAMAGE = ["inline_flip", "inline_missing", "blob_row_short", "blob_row_deleted", "manifest_not_json",
               "manifest_wrong_fields", "manifest_artifacts_not_pairs", "manifest_deleted", "entry_not_json",
               "entry_wrong_fields", "entry_wrong_generation", "manifest_uncommitted_flag"]

#: Damage to a blob's row alone, while its content stays intact.
ROW_ONLY_DAMAGE = {"blob_row_short", "blob_row_deleted"}
MISS_REASONS = {"blob_missing", "corrupt_index", "incomplete", "uncommitted", "generation_mismatch", "absent"}


def _read_all(store: Store, key: str) -> None:
    res = store.lookup(key, record=False)
    for m in res.manifests.values():
        for name in m.artifacts:
            store.read_artifact(m, name)


@pytest.mark.parametrize("kind", FILE_DAMAGE + LMDB_DAMAGE)
def test_damage_is_a_named_miss_and_verify_fix_repairs(store, kind):
    gens = _populate(store)
    damage = _file_damage(kind) if kind in FILE_DAMAGE else _lmdb_damage(kind)
    damage(store, "b")
    # 1. The damaged entry is a miss with a reason, at lookup or at the verified read.
    #    This store checked "b" before the damage, so its hit is memoized: damage to
    #    bookkeeping rows alone is not seen until verify, and the content, verified on
    #    read, is served whole; any other damage fails the read, and lookups miss after.
    res = store.lookup("b", record=False)
    if res.hit:
        try:
            _read_all(store, "b")
        except (ChecksumMismatch, BlobMissing, CorruptRecord):
            res = store.lookup("b", record=False)
            assert not res.hit and res.reason in MISS_REASONS, (kind, res)
        else:
            assert kind in ROW_ONLY_DAMAGE, kind
    else:
        assert res.reason in MISS_REASONS, (kind, res)
    #    A store that never checked "b" misses at lookup or at the read, whatever the damage.
    with Store.open(store.root, grace_period=0.0) as fresh:
        res = fresh.lookup("b", record=False)
        if res.hit:
            with pytest.raises((ChecksumMismatch, BlobMissing)):
                _read_all(fresh, "b")
        else:
            assert res.reason in MISS_REASONS, (kind, res)
    # 2. Every other entry is untouched.
    for key in ("a", "c", "d"):
        assert check_hit(store, key), key
    # 3. verify sees it, fix repairs it, and the store is clean again.  Damage to the index alone
    #    costs nothing: the entry comes back whole from its on-disk record (invariant 9); a
    #    damaged blob file stays a miss (the record lists it, it does not hold it).
    assert not store.verify().ok, kind
    fixed = store.verify(fix=True)
    assert fixed.ok and fixed.fixed, fixed.to_dict()
    after = store.verify()
    assert after.ok and not after.problems, after.to_dict()
    if kind in FILE_DAMAGE:
        assert not store.lookup("b", record=False).hit
    else:
        assert check_hit(store, "b"), kind
        assert store.lookup("b", record=False).generation == gens["b"]
        assert any("from their on-disk records" in f for f in fixed.fixed), fixed.fixed
    for key in ("a", "c", "d"):
        assert check_hit(store, key), key
    # 4. The key can be saved again and is served whole.
    save(store, "b", sizes=(100, 70_000))
    assert check_hit(store, "b")
    store.plan_sweep().execute()
    assert store.verify().ok
    assert store.lookup("a", record=False).generation == gens["a"]




_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("kind", ["manifest_path_traversal_digest", "entry_world_size_zero",
                                  "entry_negative_world_size",
                                  pytest.param("manifest_deeply_nested"),
                                  pytest.param("entry_deeply_nested")])
def test_hostile_index_values_are_misses_not_exceptions(store, kind):
    """Values that decode as JSON but break the record's invariants (see bugs-found.md)."""
    gen = save(store, "b")
    save(store, "a")
    mk = manifest_key("b", 0, gen)
    if kind == "manifest_path_traversal_digest":
        def fn(txn, db):
            obj = json.loads(bytes(txn.get(mk, db=db)))
            obj["a"]["a1"][0] = "../../../../../etc/passwd"
            txn.put(mk, json.dumps(obj).encode(), db=db)
        _rows(store, "manifests", fn)
    elif kind == "manifest_deeply_nested":
        _rows(store, "manifests", lambda txn, db: txn.put(mk, f'{{"ws": 1, "c": true, "a": {{}}, "m": {_DEEP}}}'
                                                          .encode(), db=db))
    elif kind == "entry_deeply_nested":
        _rows(store, "entries", lambda txn, db: txn.put(b"b", f'{{"ns": "x", "r": {_DEEP}}}'.encode(), db=db))
    else:
        def fn(txn, db):
            obj = json.loads(bytes(txn.get(b"b", db=db)))
            obj["ws"] = 0 if kind == "entry_world_size_zero" else -3
            txn.put(b"b", json.dumps(obj).encode(), db=db)
        _rows(store, "entries", fn)
    res = store.lookup("b", record=False)
    assert not res.hit and res.reason == "corrupt_index", res
    assert check_hit(store, "a")
    assert not store.verify().ok
    store.plan_sweep()
    store.plan_eviction(max_size=0)
    assert store.verify(fix=True).ok
    assert store.verify().ok and check_hit(store, "a")


def test_deeply_nested_components_row_is_corrupt_record(store):
    save(store, "b")
    _rows(store, "components", lambda txn, db: txn.put(b"b", f'{{"model": {_DEEP}}}'.encode(), db=db))
    with pytest.raises(CorruptRecord):
        store.entry("b")


def test_missing_inline_data_becomes_a_lookup_miss_after_the_failed_read(store):
    save(store, "k")
    small = bytes.fromhex(store.lookup("k", record=False).manifest.artifacts["a0"].digest)
    _rows(store, "blobdata", lambda txn, db: txn.delete(small, db=db))
    with pytest.raises(BlobMissing):
        _read_all(store, "k")
    assert store.lookup("k", record=False).reason == "blob_missing"


def test_garbage_lmdb_file_is_a_store_error_not_a_crash(tmp_path):
    """A data.mdb that is not LMDB at all (overwritten by something else)."""
    root = tmp_path / "store"
    with Store.open(root) as s:
        save(s, "k")
    data = root / "index" / "data.mdb"
    data.write_bytes(os.urandom(8192) * 4)
    with pytest.raises(StoreError):
        Store.open(root)


def test_bit_rot_sweep_over_every_blob_byte_class(store):
    """Flip one bit at 16 spread offsets of one file blob, each in turn; each is caught."""
    save(store, "k", sizes=(100, 70_000))
    ref = store.lookup("k", record=False).manifest.artifacts["a1"]
    original = store.get_bytes(ref)
    caught = 0
    for offset in range(0, 70_000, 70_000 // 16):
        path = store.blob_path(ref)
        _flip(path, offset)
        with pytest.raises(ChecksumMismatch):
            store.get_bytes(ref)
        assert store.lookup("k", record=False).reason == "blob_missing"
        caught += 1
        store.put_bytes(original)  # the next writer of the same content repairs the blob
        assert hashlib.sha256(store.get_bytes(ref)).hexdigest() == ref.digest
        assert check_hit(store, "k")
    assert caught == 16
    fixed = store.verify(fix=True)  # quarantine leftovers are not problems
    assert fixed.ok


def test_cli_verify_fix_repairs_several_kinds_of_damage_at_once(store_root):
    """``adstore verify`` exits 1 on a damaged store, ``verify --fix`` repairs it, then 0."""
    import subprocess
    import sys

    with Store.open(store_root, grace_period=0.0) as store:
        _populate(store)
        _file_damage("flip_middle")(store, "a")
        _lmdb_damage("manifest_not_json")(store, "b")
        _lmdb_damage("inline_flip")(store, "c")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "adstore.daemon", "--root", str(store_root), *args],
                              capture_output=True, text=True, timeout=120, check=False)

    first = cli("verify")
    assert first.returncode == 1, (first.returncode, first.stdout, first.stderr)
    fixed = cli("verify", "--fix")
    assert fixed.returncode == 0, (fixed.returncode, fixed.stdout, fixed.stderr)
    again = cli("--json", "verify")
    assert again.returncode == 0 and json.loads(again.stdout)["ok"], again.stdout
    with Store.open(store_root, grace_period=0.0) as store:
        assert check_hit(store, "d")
        assert not store.lookup("a", record=False).hit  # its blob file was damaged
        assert check_hit(store, "b") and check_hit(store, "c")  # index damage: back from their records
        for key in ("a", "b", "c"):
            save(store, key)
            assert check_hit(store, key)
        assert store.verify().ok
