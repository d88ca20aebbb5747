"""SIGKILL the daemon's eviction pass (batches, then the sweep) at its I/O steps.

Like ``test_kill_points.py``, but each forked child runs one ``Enforcer``
pass over 24 entries of ~70 KB, one of them leased by another process for
the whole run.  After every kill: ``verify()`` finds no problem, every entry
is either served whole or gone (never half-evicted), and the leased entry is
never evicted.  The sampled run is in the default run, the every-tick run is
slow; the figures go to ``bench-results/faults.json``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from kill_trap import Trap, kill_point, verify_failures, wait_for_trap
from store_helpers import check_hit, report_figures, save

from adstore.store import Store

CTX = mp.get_context("spawn")


_EVICT_KEYS = [f"e{i:02d}" for i in range(24)]


def _evict_baseline(store: Store) -> None:
    """24 entries of ~70 KB (half of them 2-rank), all past the grace period, one leased."""
    for i, key in enumerate(_EVICT_KEYS):
        if store.lookup(key, count=False).hit:
            continue
        if store.entry(key) is not None:  # a generation_mismatch leftover is re-saved whole
            store.plan_remove([key]).execute()
        save(store, key, world_size=1 + i % 2, sizes=(120, 70_000))


def eviction_kill_driver(root: str, q, stride: int = 0) -> None:
    """Like ``kill_point_driver``, but the child runs one daemon enforcement pass (batches + sweep)."""
    from adstore.daemon.config import DaemonConfig
    from adstore.daemon.enforce import Enforcer

    config = DaemonConfig(max_size=1_200_000, high_watermark=0.9, low_watermark=0.5, grace_period=0.0, batch_size=3)
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
                    trap = Trap(k, w_fd)
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
            status, trace = wait_for_trap(pid, r_fd)
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                kill_points += 1
                last = next((line for line in reversed(trace) if line[:1].isdigit()), "?:?")
                labels[last.split(":", 1)[1]] += 1
            elif os.waitstatus_to_exitcode(status) == 0:
                completed = True
            else:
                failures.append(f"k={k}: enforcement pass failed without a kill (exit {status})")
                break
            where = kill_point(k, trace)
            try:
                with Store.open(root, grace_period=0.0) as store:
                    failures += verify_failures(store, where)
                    for key in _EVICT_KEYS:
                        res = store.lookup(key, count=False)
                        if res.hit:
                            check_hit(store, key)
                        elif store.entry(key) is not None:
                            failures.append(f"{where}: {key} left half-evicted ({res.reason})")
                        else:
                            evicted_total += 1
                    if not store.lookup("e00", count=False).hit:
                        failures.append(f"{where}: the leased entry was evicted")
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{where}: {type(exc).__name__}: {exc}")
            if len(failures) > 20:
                break
            k += stride if stride > 0 else (4 if kill_points % 2 else 5)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    q.put(
        {
            "kill_points": kill_points,
            "completed": completed,
            "failures": failures,
            "killed_at": dict(labels),
            "entries_evicted_over_all_rounds": evicted_total,
        }
    )


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
    report_figures("eviction_kill_points" + ("_every_tick" if stride == 1 else ""), result)
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
