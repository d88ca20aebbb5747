"""The daemon as systemd runs it: a real subprocess started from the unit's
ExecStart, a notify socket bound by the test, real writer processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from daemon_support import PROCS, key_for, populate, run_writer, store_size, wait_until, write_config

from adstore.daemon.cli import main as cli_main
from adstore.store import Budget, Store

KIB = 1024
MIB = 1024 * 1024


def test_notify_lifecycle_ready_watchdog_stopping(tmp_path: Path, notify_socket, start_daemon) -> None:
    root = tmp_path / "store"
    cfg = write_config(tmp_path / "adstore.toml", max_size="10M", grace_period="1s", fallback_interval="1h")
    d = start_daemon(cfg, root, notify=notify_socket, watchdog_usec=300_000)
    ready = notify_socket.wait_for(lambda m: m.get("READY") == "1", proc=d.proc)
    assert int(ready["MAINPID"]) == d.pid  # ExecStart execs through to the daemon: systemd sees its pid
    assert "budget 10.0 MiB" in ready["STATUS"]
    # WATCHDOG=1 at half of WATCHDOG_USEC (0.15 s): several pings in well under a second each.
    for _ in range(3):  # each within 2 s, or wait_for fails the test
        notify_socket.wait_for(lambda m: m.get("WATCHDOG") == "1", timeout=2.0, proc=d.proc)
        notify_socket.messages.clear()
    d.signal(signal.SIGTERM)
    assert d.wait() == 0, d.log()
    notify_socket.poll()
    assert any(m.get("STOPPING") == "1" for m in notify_socket.messages), notify_socket.messages


def test_writers_over_budget_are_brought_under_low_watermark_leases_survive(
    tmp_path: Path, notify_socket, start_daemon
) -> None:
    root = tmp_path / "store"
    old = populate(root, count=12, size=100 * KIB, prefix="old", age=10.0)  # past the 1 s grace period
    cfg = write_config(
        tmp_path / "adstore.toml",
        max_size="2M",
        high_watermark=0.9,
        low_watermark=0.6,
        grace_period="1s",
        batch_size=3,
        fallback_interval="1h",
    )
    d = start_daemon(cfg, root, notify=notify_socket)
    notify_socket.wait_for(lambda m: m.get("READY") == "1", proc=d.proc)
    # The least recently used entry is leased by another live process.
    holder = subprocess.Popen(
        [sys.executable, str(PROCS), "lease", str(root), old[0]], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "leased"
        # Two writer processes push the store from 1.2 MB past the 1.8 MiB high watermark.
        writers = [run_writer(root, count=5, size=100 * KIB, prefix=f"new{w}", wait=False) for w in range(2)]
        for w in writers:
            assert w.wait(timeout=60) == 0
        low = int(2 * MIB * 0.6)
        wait_until(lambda: store_size(root) <= low, timeout=30)
        with Store.open(root) as store:
            assert store.entry(old[0]) is not None, "a leased entry was evicted"
            assert store.lookup(old[0], count=False).hit
            for w in range(2):  # the new entries are younger than the grace period and most recent
                for i in range(5):
                    assert store.entry(key_for(f"new{w}", i)) is not None
            evicted = [k for k in old if store.entry(k) is None]
            assert len(evicted) >= 9
            assert store.verify().ok
    finally:
        holder.kill()
        holder.wait()
    status = notify_socket.wait_for(lambda m: "last eviction" in m.get("STATUS", ""), proc=d.proc)
    assert "budget 2.0 MiB" in status["STATUS"]


def persisted_budget(root: Path) -> Budget:
    with Store.open(root) as store:
        budget = store.budget()
    assert budget is not None
    return budget


def test_sighup_applies_new_budget(tmp_path: Path, notify_socket, start_daemon) -> None:
    root = tmp_path / "store"
    populate(root, count=10, size=100 * KIB, prefix="e")
    cfg = write_config(tmp_path / "adstore.toml", max_size="10M", grace_period="0s", fallback_interval="1h")
    d = start_daemon(cfg, root, notify=notify_socket)
    notify_socket.wait_for(lambda m: m.get("READY") == "1", proc=d.proc)
    time.sleep(0.3)
    size = store_size(root)
    assert size >= 10 * 100 * KIB  # nothing evicted under the 10 MiB budget
    assert persisted_budget(root).max_size == 10 * 1024 * KIB  # writers and `stats` see it
    write_config(cfg, max_size="600K", high_watermark=0.9, low_watermark=0.5, grace_period="0s", fallback_interval="1h")
    notify_socket.messages.clear()
    d.signal(signal.SIGHUP)
    notify_socket.wait_for(lambda m: m.get("RELOADING") == "1", proc=d.proc)
    notify_socket.wait_for(lambda m: m.get("READY") == "1", proc=d.proc)
    wait_until(lambda: store_size(root) <= 300 * KIB, timeout=30)
    budget = persisted_budget(root)
    assert (budget.max_size, budget.high_watermark, budget.low_watermark) == (600 * KIB, 0.9, 0.5)
    # An invalid edit is reported and the daemon keeps running on the last good config.
    cfg.write_text('max_size = "lots"\n')
    notify_socket.messages.clear()
    d.signal(signal.SIGHUP)
    msg = notify_socket.wait_for(lambda m: "reload failed" in m.get("STATUS", ""), proc=d.proc)
    assert "max_size" in msg["STATUS"]
    assert d.proc.poll() is None
    assert persisted_budget(root).max_size == 600 * KIB  # the last good budget stays
    d.signal(signal.SIGTERM)
    assert d.wait() == 0


def test_second_daemon_is_refused(tmp_path: Path, notify_socket, start_daemon) -> None:
    root = tmp_path / "store"
    cfg = write_config(tmp_path / "adstore.toml", max_size="10M")
    first = start_daemon(cfg, root, notify=notify_socket)
    notify_socket.wait_for(lambda m: m.get("READY") == "1", proc=first.proc)
    second = start_daemon(cfg, root)
    assert second.wait(timeout=30) == 5
    text = second.log()
    assert f"pid {first.pid}" in text and "already manages this store" in text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1
    assert first.proc.poll() is None
    first.signal(signal.SIGTERM)
    assert first.wait() == 0


def test_sigkill_mid_eviction_leaves_a_verifiable_store(tmp_path: Path, start_daemon) -> None:
    root = tmp_path / "store"
    populate(root, count=300, size=70 * KIB, prefix="bulk")  # file blobs (above the inline threshold)
    cfg = write_config(
        tmp_path / "adstore.toml",
        max_size="2M",
        high_watermark=0.9,
        low_watermark=0.5,
        grace_period="0s",
        batch_size=2,
        fallback_interval="1h",
        log_level="info",
    )
    d = start_daemon(cfg, root)
    wait_until(lambda: "evicted" in d.log(), timeout=30, interval=0.005)
    d.signal(signal.SIGKILL)
    assert d.wait() == -signal.SIGKILL
    low = int(2 * MIB * 0.5)
    killed_at = store_size(root)
    assert killed_at > low, "eviction finished before the kill; the test did not kill mid-eviction"
    # After a restart the daemon completes the job and the store verifies clean.
    d2 = start_daemon(cfg, root)
    wait_until(lambda: store_size(root) <= low, timeout=30)
    d2.signal(signal.SIGTERM)
    assert d2.wait() == 0
    assert cli_main(["verify", "--root", str(root)]) == 0
    with Store.open(root) as store:
        report = store.verify()
        assert report.ok and not report.problems, report.problems


def test_sigterm_mid_eviction_finishes_the_batch_and_exits_0(tmp_path: Path, notify_socket, start_daemon) -> None:
    root = tmp_path / "store"
    populate(root, count=300, size=70 * KIB, prefix="bulk")
    cfg = write_config(
        tmp_path / "adstore.toml",
        max_size="2M",
        high_watermark=0.9,
        low_watermark=0.5,
        grace_period="0s",
        batch_size=2,
        fallback_interval="1h",
    )
    d = start_daemon(cfg, root, notify=notify_socket)
    wait_until(lambda: "evicted" in d.log(), timeout=30, interval=0.005)
    d.signal(signal.SIGTERM)
    assert d.wait(timeout=10) == 0, d.log()
    assert "stopping" in d.log()
    notify_socket.poll()
    assert any(m.get("STOPPING") == "1" for m in notify_socket.messages)
    assert store_size(root) > int(2 * MIB * 0.5), "the daemon did not stop between batches"
    with Store.open(root) as store:
        assert store.verify().ok


def test_fallback_timer_enforces_without_filesystem_events(tmp_path: Path, notify_socket, start_daemon) -> None:
    root = tmp_path / "store"
    cfg = write_config(
        tmp_path / "adstore.toml",
        max_size="1M",
        high_watermark=0.9,
        low_watermark=0.5,
        grace_period="0s",
        fallback_interval="500ms",
        watch="false",
    )
    d = start_daemon(cfg, root, notify=notify_socket)
    notify_socket.wait_for(lambda m: m.get("READY") == "1", proc=d.proc)
    # 900 KiB: under the high watermark (921.6 KiB), so neither the daemon nor the writer evicts;
    # then one more entry (1000 KiB, still under the writers' hard limit of 1 MiB) crosses it.
    populate(root, count=9, size=100 * KIB, prefix="f")
    populate(root, count=1, size=100 * KIB, prefix="g")
    # Nothing but the 0.5 s timer can wake the daemon (no inotify watching).
    wait_until(lambda: store_size(root) <= 512 * KIB, timeout=30)
    assert "filesystem events disabled" in d.log()
    d.signal(signal.SIGTERM)
    assert d.wait() == 0


def test_readers_under_lease_never_lose_blobs_while_writers_and_daemon_race(
    tmp_path: Path, notify_socket, start_daemon
) -> None:
    import json

    root = tmp_path / "store"
    populate(root, count=10, size=70 * KIB, prefix="seed")
    cfg = write_config(
        tmp_path / "adstore.toml",
        max_size="1500K",
        high_watermark=0.8,
        low_watermark=0.4,
        grace_period="0s",
        batch_size=2,
        debounce="50ms",
        max_delay="200ms",
        fallback_interval="1h",
    )
    d = start_daemon(cfg, root, notify=notify_socket)
    notify_socket.wait_for(lambda m: m.get("READY") == "1", proc=d.proc)
    reader = subprocess.Popen(
        [sys.executable, str(PROCS), "read", str(root), "--seconds", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writers = [
        run_writer(root, count=25, size=70 * KIB, prefix=f"w{w}", delay=0.03, wait=False, grace_period=0)
        for w in range(2)
    ]
    for w in writers:  # a save may lose its blob to a sweep (zero grace period): it says so and goes on
        wout, werr = w.communicate(timeout=60)
        assert w.returncode == 0, werr.decode()[-3000:]
        assert int(wout.decode().split()[1].rstrip(",")) > 0, wout
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    counts = json.loads(out)
    assert counts["read_errors"] == 0, counts["errors"]
    assert counts["hits"] > 0
    wait_until(lambda: store_size(root) <= int(1500 * KIB * 0.8), timeout=30)
    d.signal(signal.SIGTERM)
    try:
        code = d.wait(timeout=30)
    except subprocess.TimeoutExpired:
        d.signal(signal.SIGUSR1)
        time.sleep(1)
        raise AssertionError("daemon hung after SIGTERM:\n" + d.log()[-6000:]) from None
    assert code == 0
    assert "evicted" in d.log()
    with Store.open(root) as store:
        report = store.verify()
        assert report.ok, report.problems


def test_reload_applies_a_new_grace_period_to_the_store_and_its_budget(tmp_path: Path) -> None:
    """In-process: the store's plans and the persisted budget take the reloaded grace period."""
    from adstore.daemon.config import DaemonConfig
    from adstore.daemon.daemon import Daemon
    from adstore.daemon.notify import Notifier

    cfg = write_config(tmp_path / "adstore.toml", max_size="10M", grace_period="1h")
    d = Daemon(DaemonConfig.from_config(cfg, root=str(tmp_path / "store")), notifier=Notifier(address=None), environ={})
    d._open()
    try:
        assert d._store.grace_period == 3600.0 and persisted_budget(tmp_path / "store").grace_period == 3600.0
        write_config(cfg, max_size="20M", grace_period="5s")
        d._apply_reload()
        assert d.config.grace_period == 5.0 and d._store.grace_period == 5.0
        budget = persisted_budget(tmp_path / "store")
        assert (budget.max_size, budget.grace_period) == (20 * MIB, 5.0)
    finally:
        d._store.close()
        d._lock.release()
        d._rsock.close()
        d._wsock.close()
