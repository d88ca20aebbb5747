"""One enforcement pass on a real store: bounded batches, SIGTERM between batches,
max_age, orphan sweep and reclaim of leases held by dead processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from daemon_support import PROCS, populate

from adstore.daemon.config import DaemonConfig
from adstore.daemon.enforce import Enforcer
from adstore.store import Store

KIB = 1024


def _cfg(**kw: object) -> DaemonConfig:
    return DaemonConfig.from_mapping({"grace_period": 0, **kw})


def test_batches_are_bounded_and_reach_the_low_watermark(tmp_path: Path) -> None:
    root = tmp_path / "s"
    populate(root, count=50, size=2 * KIB, prefix="b")  # 100 KiB, inline blobs
    with Store.open(root, grace_period=0) as store:
        batches: list[int] = []
        enforcer = Enforcer(
            store,
            _cfg(max_size="50K", high_watermark=0.9, low_watermark=0.5, batch_size=7),
            on_batch=lambda: batches.append(store.stats().entries),
        )
        result = enforcer.run_pass()
        assert result.after.size <= 25 * KIB < result.before.size
        assert result.evicted_entries == 50 - store.stats().entries >= 38
        assert result.batches == len(batches) >= 6
        drops = [a - b for a, b in zip([50] + batches[:-1], batches, strict=True)]
        assert max(drops) <= 7
        assert not result.blocked and not result.interrupted
        assert store.verify().ok


def test_stop_between_batches(tmp_path: Path) -> None:
    root = tmp_path / "s"
    populate(root, count=30, size=2 * KIB, prefix="t")
    with Store.open(root, grace_period=0) as store:
        calls = {"n": 0}

        def stop_after_first() -> bool:
            calls["n"] += 1
            return calls["n"] > 1

        result = Enforcer(store, _cfg(max_size="10K", batch_size=5), should_stop=stop_after_first).run_pass()
        assert result.interrupted and result.batches == 1 and result.evicted_entries == 5
        assert store.stats().entries == 25


def test_under_budget_does_nothing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    populate(root, count=5, size=KIB, prefix="u")
    with Store.open(root, grace_period=0) as store:
        result = Enforcer(store, _cfg(max_size="1M")).run_pass()
        assert result.batches == 0 and result.evicted_entries == 0 and store.stats().entries == 5


def test_max_age_evicts_unused_entries_only(tmp_path: Path) -> None:
    root = tmp_path / "s"
    old = populate(root, count=3, size=KIB, prefix="old", age=5.0)
    new = populate(root, count=2, size=KIB, prefix="new")
    with Store.open(root, grace_period=0) as store:
        result = Enforcer(store, _cfg(max_age=0.5)).run_pass()
        assert result.aged_entries == 3
        assert all(store.entry(k) is None for k in old)
        assert all(store.entry(k) is not None for k in new)


def test_blocked_when_everything_left_is_pinned(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = populate(root, count=4, size=2 * KIB, prefix="p")
    with Store.open(root, grace_period=0) as store:
        for k in keys:
            store.pin(k)
        result = Enforcer(store, _cfg(max_size="2K")).run_pass()
        assert result.blocked and result.evicted_entries == 0 and result.swept


def test_sweep_reclaims_dead_leases_and_orphans(tmp_path: Path) -> None:
    root = tmp_path / "s"
    keys = populate(root, count=2, size=KIB, prefix="l")
    holder = subprocess.Popen(
        [sys.executable, str(PROCS), "lease", str(root), keys[0]], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "leased"
    os.kill(holder.pid, signal.SIGKILL)  # dies holding the lease: the row stays behind
    holder.wait()
    orphan = root / "blobs" / "cd" / ("cd" + "1" * 62)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"left by a killed writer")
    with Store.open(root, grace_period=0) as store:
        assert store.stats().leases == 1
        result = Enforcer(store, _cfg(max_size="1G")).run_pass(sweep=True)
        assert result.swept and result.swept_items >= 2
        assert store.stats().leases == 0
        assert not orphan.exists()
        assert store.entry(keys[0]) is not None  # reclaiming a lease never evicts the entry
