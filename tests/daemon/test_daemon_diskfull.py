"""The daemon on a real filesystem with 0 bytes free (an 8 MiB tmpfs filled to the last byte).

Holding ``daemon.lock`` needs no space, so the daemon must start whether the
lock file is left from an earlier run or has to be created, skip recording
its pid when that does not fit, and evict the store back under its
``min_free`` floor.  ``adstore gc`` at 0 bytes free needs an LMDB commit:
the store's ballast (docs/operations.md, "Damage and repair") is released to make it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from daemon_support import fill_to_the_last_byte, run_cli, wait_until, write_config

from adstore.store import Store, StoreError

MIB = 1 << 20


def _fill_store(root: Path) -> list[str]:
    """Save 300 KB entries until the disk refuses one; returns the keys saved."""
    keys: list[str] = []
    with Store.open(root, grace_period=0.0) as store:
        for i in range(100):
            try:
                ref = store.put_bytes(os.urandom(300_000))
                gen = store.new_generation()
                store.publish(f"k{i}", generation=gen, artifacts={"m": ref})
                store.commit(f"k{i}", generation=gen)
            except StoreError:
                return keys
            keys.append(f"k{i}")
    raise AssertionError("the 8 MiB tmpfs never filled")


@pytest.mark.parametrize("lock", ["left by an earlier run", "absent"])
def test_daemon_starts_and_evicts_at_0_bytes_free(small_tmpfs, tmp_path, start_daemon, notify_socket, lock):
    root = small_tmpfs / "store"
    if lock == "absent":
        Store.open(root).close()
    else:  # an earlier daemon ran (and stopped) while there was space
        assert run_cli("daemon", "--once", "--root", str(root), "--max-size", "1G").returncode == 0
        assert (root / "daemon.lock").is_file()
    keys = _fill_store(root)
    fill_to_the_last_byte(small_tmpfs)
    config = write_config(
        tmp_path / "adstore.toml",
        min_free="2M",
        grace_period="0s",
        debounce="50ms",
        max_delay="200ms",
        fallback_interval="1s",
        sweep_interval="1s",
    )
    daemon = start_daemon(config, root, notify=notify_socket)
    notify_socket.wait_for(lambda m: m.get("READY") == "1", proc=daemon.proc)
    wait_until(lambda: shutil.disk_usage(small_tmpfs).free >= 2 * MIB * 0.85, timeout=20)
    assert daemon.proc.poll() is None, daemon.log()
    if lock == "left by an earlier run":
        assert "cannot record the daemon's pid" not in daemon.log()  # the old pid's block is reused
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log()
    with Store.open(root, grace_period=0.0) as store:
        left = [e.key for e in store.entries()]
        assert left and len(left) < len(keys)
        for key in left:
            res = store.lookup(key, count=False)
            assert res.hit and len(store.read_artifact(res.manifest, "m")) == 300_000
        assert store.verify().ok


def test_a_second_daemon_at_0_bytes_free_names_the_first(small_tmpfs, start_daemon, notify_socket, tmp_path):
    root = small_tmpfs / "store"
    Store.open(root).close()
    config = write_config(tmp_path / "adstore.toml", max_size="1G")
    first = start_daemon(config, root, notify=notify_socket)
    notify_socket.wait_for(lambda m: m.get("READY") == "1", proc=first.proc)
    fill_to_the_last_byte(small_tmpfs)
    second = run_cli("daemon", "--root", str(root), "--max-size", "1G")
    assert second.returncode == 5 and f"pid {first.pid}" in second.stderr, second.stderr


def test_gc_at_0_bytes_free_frees_space(small_tmpfs):
    root = small_tmpfs / "store"
    keys = _fill_store(root)
    assert (root / "ballast").is_file()
    fill_to_the_last_byte(small_tmpfs)
    out = run_cli("gc", "--root", str(root), "--max-size", "1M", "--grace-period", "0")
    assert "Traceback" not in out.stderr and out.returncode != 70
    assert out.returncode == 0, out.stderr
    assert shutil.disk_usage(small_tmpfs).free > 5 * MIB and keys
    (small_tmpfs / "filler").unlink()
    with Store.open(root) as store:  # the ballast is back once there is room
        assert (root / "ballast").is_file() and store.verify().ok
