"""SIGKILL a store writer at every I/O step of save, publish, commit, remove, sweep and close.

A spawned driver process forks one child per kill point ``k`` (the
``kill_trap`` machinery counts the child's file-system calls and LMDB
commits and SIGKILLs it at tick ``k``); the child runs a fixed sequence (a
two-rank save that replaces an older generation, an explicit removal of
another entry, an orphan sweep, close).  After every kill the driver checks
that ``verify()`` finds no problem, that the replaced key is served as
exactly the old or exactly the new generation (a commit that returned is
durable; nothing before the first commit is visible), that the removed entry
is intact or absent, that a copy swept by gc and then rebuilt from its
on-disk records serves exactly the same (invariant 9), and that the next
writer is not blocked (LMDB's writer lock of the dead process is recovered).

The sweep continues with k = 0, 3, 5, 8, 10, ... (steps alternating 3 and
2, so periodic sequences such as one blob write are cut at every phase) until
a child finishes without being killed; the slow run cuts every single tick.  The number of kill
points is printed (run with ``-s``).
A slow timing sweep also kills a real writer 0, 7, 14, ... ms after it is ready.
The figures go to ``bench-results/faults.json``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from kill_trap import Trap, kill_point, verify_failures, wait_for_trap
from store_helpers import check_hit, parse_payload, payload, report_figures, save

from adstore.store import Store

CTX = mp.get_context("spawn")


def _scenario(root: str, gen_new: int, trap: Trap) -> None:
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
        store.publish("K", rank=rank, world_size=2, generation=gen_new, artifacts=art[rank], components={"key": "K"})
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
    res = store.lookup(key, count=False)
    return res.generation if res.hit else None


def _check_served(store: Store, key: str) -> tuple[bool, int | None, str | None]:
    """Lookup ``key``; a hit must be one whole generation (self-describing payloads)."""
    res = store.lookup(key, count=False)
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
        arts = {
            "small": store.put_bytes(payload("K", gen, rank, "small", 100)),
            "big": store.put_bytes(payload("K", gen, rank, "big", 70_000)),
        }
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
                trap = Trap(k, w_fd)
                trap.install()
                _scenario(root, gen_new, trap)
                code = 0
            except BaseException:
                code = 3
            os._exit(code)
        os.close(w_fd)
        status, trace = wait_for_trap(pid, r_fd)
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
        where = kill_point(k, trace)
        try:
            with Store.open(root, grace_period=0.0) as store:
                failures += verify_failures(store, where)
                hit, gen, reason = _check_served(store, "K")
                committed0 = "done:commit0" in marks or _committed_in_phase(trace, "commit0")
                committed1 = "done:commit1" in marks or _committed_in_phase(trace, "commit1")
                if committed1:
                    ok = hit and gen == gen_new
                elif committed0:
                    ok = not hit and reason == "generation_mismatch"
                else:
                    ok = hit and gen == gen_old
                if not ok:
                    failures.append(
                        f"{where}: K served hit={hit} gen={'new' if gen == gen_new else gen} "
                        f"reason={reason} (commit0 durable={committed0}, commit1={committed1})"
                    )
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
    q.put(
        {
            "kill_points": kill_points,
            "completed": completed,
            "last_k": k,
            "failures": failures,
            "outcomes": dict(outcomes),
            "killed_at": dict(labels),
        }
    )


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
    res = store.lookup("victim", count=False)
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
    print(
        f"\nkill points tried: {result['kill_points']} ({'every tick' if stride == 1 else 'sampled'}); "
        f"outcomes {result['outcomes']}; killed at {result['killed_at']}"
    )
    report_figures("kill_points" + ("_every_tick" if stride == 1 else ""), {**result, "stride": stride})
    return result


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
    report_figures("timed_kills", {"kills": kills})
