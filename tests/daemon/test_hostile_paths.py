"""Files the daemon writes in a (possibly shared) root, planted by someone else.

``daemon.lock`` as a symlink, a FIFO or a hard link to another file is refused
(``unsafe_root``, exit 7) before anything is written, and the other file is
left as it was; the status and metrics files are replaced by a rename, never
written through a planted symlink; a FIFO where the status file belongs does
not hang ``adstore stats``; a new lock file has the store's mode whatever the
umask.  The two-user variants (a group member's symlink, umask 077) are in
``test_permissions.py``.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from daemon_support import run_cli

from adstore.daemon.lock import LOCK_NAME, STATUS_NAME, InstanceLock, read_status
from adstore.store import Store, UnsafeRoot

SECRET = "another user's private file\n"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    Store.open(root).close()
    return root


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_text(SECRET)
    return path


def _plant(kind: str, path: Path, victim: Path) -> None:
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "dangling symlink":
        path.symlink_to(victim.parent / "does-not-exist")
    elif kind == "hard link":
        os.link(victim, path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "hard link", "fifo", "directory"])
def test_a_planted_lock_file_is_refused_and_nothing_is_written(root, victim, kind):
    _plant(kind, root / LOCK_NAME, victim)
    out = run_cli("--json", "daemon", "--once", "--root", str(root), "--max-size", "1G")
    assert out.returncode == 7, out.stderr
    error = json.loads(out.stdout)["error"]
    assert error["reason"] == "unsafe_root" and error["exit_code"] == 7 and "daemon.lock" in error["message"]
    assert victim.read_text() == SECRET
    assert not (victim.parent / "does-not-exist").exists()
    with pytest.raises(UnsafeRoot):
        InstanceLock.acquire(root)


def test_the_lock_file_gets_the_store_mode_whatever_the_umask(tmp_path):
    plain, shared = tmp_path / "plain", tmp_path / "shared"
    Store.open(plain).close()
    shared.mkdir()
    os.chmod(shared, 0o2775)  # a group-shared root (docs/configuration.md, "A store shared by several users")
    Store.open(shared).close()
    old = os.umask(0o077)
    try:
        for root, mode in ((plain, 0o644), (shared, 0o664)):
            with InstanceLock.acquire(root) as lock:
                assert stat.S_IMODE(os.stat(lock.path).st_mode) == mode
                assert lock.path.read_text() == f"{os.getpid()}\n"
    finally:
        os.umask(old)


def test_a_released_lock_keeps_the_pid_and_the_next_holder_overwrites_it(root):
    with InstanceLock.acquire(root):
        pass
    (root / LOCK_NAME).write_text("99999999 a longer stale line\n")
    with InstanceLock.acquire(root) as lock:
        assert lock.path.read_text() == f"{os.getpid()}\n"


def test_status_and_metrics_are_replaced_never_written_through_a_symlink(root, victim, tmp_path):
    metrics = tmp_path / "node-exporter" / "adstore.prom"
    metrics.parent.mkdir()
    (root / STATUS_NAME).symlink_to(victim)
    metrics.symlink_to(victim)
    out = run_cli("daemon", "--once", "--root", str(root), "--max-size", "1G", "--metrics-path", str(metrics))
    assert out.returncode == 0, out.stderr
    assert victim.read_text() == SECRET
    for path in (root / STATUS_NAME, metrics):
        assert not path.is_symlink() and path.is_file()
    assert "adstore_stored_bytes" in metrics.read_text()
    assert json.loads((root / STATUS_NAME).read_text())["once"] is True


def test_a_fifo_or_symlink_as_status_file_does_not_hang_or_leak_into_stats(root, victim):
    os.mkfifo(root / STATUS_NAME)
    assert read_status(root) is None
    out = run_cli("--json", "stats", "--root", str(root), timeout=20)
    assert out.returncode == 0 and json.loads(out.stdout)["daemon"] is None
    (root / STATUS_NAME).unlink()
    victim.write_text(json.dumps({"pid": os.getpid(), "pid_start": 0, "secret": SECRET}))
    (root / STATUS_NAME).symlink_to(victim)
    assert read_status(root) is None
