"""A store on a real, size-limited filesystem (tmpfs, 8 MiB) filled to the last byte.

Nothing is simulated: the kernel returns ENOSPC to the store's own writes
(blob temp files, LMDB pages).  Saves must fail with ``StoreFull`` (reason
``disk_full``) and leave nothing half-written, reads and lookups of what is
already stored must keep working, ``verify`` must stay clean, space must come
back once entries are evicted, and the daemon must keep running on the full
disk and bring it back under its ``min_free`` floor.

The tests mount a tmpfs (root only); without the permission to mount they are
skipped with the reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from store_helpers import check_hit, payload, save

from adstore.store import OverBudget, Store, StoreError, StoreFull

MIB = 1 << 20


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(
            f"cannot mount a size-limited tmpfs here ({res.stderr.strip() or res.returncode}); "
            "run as root to test a real full disk"
        )
    try:
        yield mnt
    finally:
        r = subprocess.run(["umount", str(mnt)], capture_output=True)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(store: Store, prefix: str, size: int, limit: int = 200) -> tuple[list[str], BaseException]:
    """Save entries of ``size`` bytes until the disk refuses; returns the saved keys and the error."""
    keys: list[str] = []
    for i in range(limit):
        key = f"{prefix}{i}"
        try:
            save(store, key, sizes=(100, size))
        except StoreError as exc:
            return keys, exc
        keys.append(key)
    raise AssertionError(f"the 8 MiB filesystem never filled after {limit} entries of {size} bytes")


def _assert_nothing_half_written(store: Store) -> None:
    assert not list((store.root / "tmp").iterdir()), "a temp file survived the failed write"
    rep = store.verify()
    assert rep.ok and not rep.problems, rep.to_dict()
    assert not any("without an index row" in w for w in rep.warnings), rep.warnings


def test_file_blob_saves_fail_with_disk_full_and_nothing_is_half_written(small_fs):
    store = Store.open(small_fs / "store", grace_period=0.0)
    try:
        keys, exc = _fill(store, "k", 400_000)
        assert keys, "not even one entry fit"
        assert isinstance(exc, StoreFull) and exc.reason == "disk_full", repr(exc)
        _assert_nothing_half_written(store)
        # Every entry saved before the disk filled is served whole.
        for key in keys:
            assert check_hit(store, key), key
        # Retrying on the full disk fails the same way and still leaves nothing behind.
        for _ in range(3):
            with pytest.raises(StoreFull):
                save(store, "again", sizes=(100, 400_000))
        _assert_nothing_half_written(store)
        assert store.lookup("again", count=False).reason in ("absent", "uncommitted")
    finally:
        store.close()


def test_index_writes_on_a_full_disk_are_disk_full(small_fs):
    """Small (inline) blobs fill the LMDB file itself: the error must still say disk_full."""
    store = Store.open(small_fs / "store", grace_period=0.0)
    try:
        keys, exc = _fill(store, "i", 30_000, limit=400)
        assert keys
        assert exc.reason == "disk_full", f"{type(exc).__name__}({exc}) has reason {exc.reason!r}"
    finally:
        store.close()


def test_index_full_leaves_a_working_store(small_fs):
    """Whatever the reason says, an LMDB write that hit ENOSPC must not damage the index."""
    store = Store.open(small_fs / "store", grace_period=0.0)
    try:
        keys, exc = _fill(store, "i", 30_000, limit=400)
        assert isinstance(exc, StoreError)
        for key in keys:
            assert check_hit(store, key), key
        rep = store.verify()
        assert rep.ok, rep.problems
    finally:
        store.close()
    # A new process opens the full store and reads it (no MDB_PANIC left behind).
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys; from adstore.store import Store\n"
                f"s = Store.open({str(small_fs / 'store')!r})\n"
                "n = sum(1 for e in s.entries() if s.lookup(e.key).hit)\n"
                "print(n)\n"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == len(keys)


def test_space_comes_back_after_eviction(small_fs):
    store = Store.open(small_fs / "store", grace_period=0.0)
    try:
        keys, exc = _fill(store, "k", 400_000)
        assert isinstance(exc, StoreFull)
        freed = store.plan_remove(keys[: len(keys) // 2]).execute()
        assert freed >= 400_000 * (len(keys) // 2)
        save(store, "after", sizes=(100, 400_000))
        assert check_hit(store, "after")
        for key in keys[len(keys) // 2 :]:
            assert check_hit(store, key)
        _assert_nothing_half_written(store)
    finally:
        store.close()


def test_disk_filled_by_someone_else_between_put_and_commit(small_fs):
    """Blobs are stored, then another file takes every free byte; publish/commit either
    complete or fail with disk_full, and the entry is never half-restorable."""
    store = Store.open(small_fs / "store", grace_period=0.0)
    try:
        save(store, "before", sizes=(100, 200_000))
        gen = store.new_generation()
        arts = [
            {
                "a0": store.put_bytes(payload("k", gen, r, "a0", 100)),
                "a1": store.put_bytes(payload("k", gen, r, "a1", 200_000)),
            }
            for r in range(2)
        ]
        filler = small_fs / "filler"
        with open(filler, "wb", buffering=0) as f:  # unbuffered: no short write left for close()
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        assert shutil.disk_usage(small_fs).free < 128 << 10
        outcome = "committed"
        try:
            for r in range(2):
                store.publish("k", rank=r, world_size=2, generation=gen, artifacts=arts[r])
            for r in range(2):
                store.commit("k", rank=r, generation=gen)
        except StoreError as exc:
            outcome = exc.reason
        res = store.lookup("k", count=False)
        if outcome == "committed":
            assert check_hit(store, "k")
        else:
            assert not res.hit
        assert check_hit(store, "before")
        assert store.verify().ok
        filler.unlink()
        save(store, "k", world_size=2, sizes=(100, 200_000))
        assert check_hit(store, "k")
        assert store.verify().ok
    finally:
        store.close()


def _daemon(root: Path, log: Path, *flags: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "adstore.daemon", "daemon", "--root", str(root), *flags]
    return subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def test_daemon_keeps_running_on_a_full_disk_and_restores_min_free(small_fs, tmp_path):
    if shutil.which("adstore") is None and not _daemon_importable():
        pytest.skip("the adstore daemon is not installed")
    root = small_fs / "store"
    store = Store.open(root, grace_period=0.0)
    log = tmp_path / "daemon.log"
    daemon = _daemon(
        root,
        log,
        "--min-free",
        "3M",
        "--grace-period",
        "1s",
        "--debounce",
        "50ms",
        "--max-delay",
        "200ms",
        "--fallback-interval",
        "1s",
        "--low-watermark",
        "0.8",
        "--high-watermark",
        "0.9",
        "--sweep-interval",
        "2s",
    )
    try:
        time.sleep(1.0)
        assert daemon.poll() is None, log.read_text()
        # Writers push past the floor until the disk is full; the daemon evicts behind them.
        full_errors = 0
        saved = []
        deadline = time.monotonic() + 20
        i = 0
        while time.monotonic() < deadline and i < 60:
            try:
                save(store, f"d{i}", sizes=(100, 400_000))
                saved.append(f"d{i}")
            except (StoreFull, OverBudget):  # the disk, or the daemon's budget (persisted in the index)
                full_errors += 1
                time.sleep(0.2)
            i += 1
        assert daemon.poll() is None, f"the daemon died on the full disk:\n{log.read_text()[-3000:]}"
        # The daemon brings free space back over the floor (3 MiB of 8) and keeps running.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and shutil.disk_usage(small_fs).free < 3 * MIB:
            time.sleep(0.2)
        assert shutil.disk_usage(small_fs).free >= 3 * MIB * 0.9, (shutil.disk_usage(small_fs), log.read_text())
        assert daemon.poll() is None
        assert len(saved) > 10, (saved, full_errors)
        for entry in store.entries():
            assert check_hit(store, entry.key)
        assert store.verify().ok
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        store.close()
    assert daemon.returncode == 0, log.read_text()[-3000:]


def _daemon_importable() -> bool:
    try:
        import adstore.daemon.cli  # noqa: F401
    except ImportError:
        return False
    return True


def _full_disk_writer(root: str, worker: int, q) -> None:
    """Save until the disk has refused this writer 5 times; report what was committed."""
    store = Store.open(root, grace_period=0.0)
    saved, full, other = [], 0, []
    i = 0
    while full < 5 and i < 400:
        key = f"w{worker}-{i}"
        try:
            save(store, key, world_size=1 + i % 2, sizes=(100 + worker, 150_000 + 1000 * worker))
            saved.append(key)
        except StoreFull:
            full += 1
        except StoreError as exc:  # anything else is a finding
            other.append(f"{type(exc).__name__}: {exc}")
        i += 1
    store.close()
    q.put((worker, saved, full, other))


def test_concurrent_writers_on_a_full_disk_corrupt_nothing(small_fs):
    import multiprocessing as mp

    root = small_fs / "store"
    Store.open(root).close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_full_disk_writer, args=(str(root), w, q)) for w in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(full == 5 for _, _, full, _ in results), results
    assert not [o for *_, other in results for o in other], results
    with Store.open(root, grace_period=0.0) as store:
        _assert_nothing_half_written(store)
        for _, saved, _, _ in results:
            for key in saved:
                assert check_hit(store, key), key
