"""What a new user tripped over, following the docs: each answer says what is wrong and how to fix it.

Run through the real ``adstore`` executable, as a user would: the missing
``remote`` extra, a file where the store root should be, a ``gc`` that the
grace period stops, a remote whose records no key of ours signed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KIB = 1024


def _exe() -> list[str]:
    exe = shutil.which("adstore")
    return [exe] if exe else [sys.executable, "-m", "adstore"]


def adstore(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ADSTORE_")}
    return subprocess.run(
        [*_exe(), *argv], capture_output=True, text=True, timeout=120, cwd=cwd, env={**base, **(env or {})}
    )


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_keygen_without_the_remote_extra_is_one_line_naming_the_extra(tmp_path):
    """The fleet checklist's step 2 on an install without ``adstore[remote]``: no traceback, the fix."""
    hidden = tmp_path / "hidden"
    (hidden / "cryptography").mkdir(parents=True)
    (hidden / "cryptography" / "__init__.py").write_text("raise ImportError('No module named cryptography')\n")
    done = adstore("keygen", "keys", cwd=tmp_path, env={"PYTHONPATH": str(hidden)})
    line = _one_line(done)
    assert done.returncode == 2 and "pip install 'adstore[remote]'" in line and "cryptography" in line, line
    assert "ADSTORE_SIGNING_KEY" not in line
    assert not (tmp_path / "keys" / "adstore.key").exists()


def test_keygen_writes_the_pair_the_remote_reads(tmp_path):
    done = adstore("keygen", "keys", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "keys" / "adstore.key").stat().st_mode & 0o777 == 0o600
    assert "ADSTORE_TRUSTED_KEYS" in done.stdout and "Key id" in done.stdout


def _two_entries(root: Path) -> None:
    from adstore.store import Store

    with Store.open(root) as store:
        store.save("k1", {"a": store.put_bytes(os.urandom(200 * KIB))})
        store.save("k2", {"a": store.put_bytes(os.urandom(300))})


def test_gc_that_the_grace_period_stops_says_why_and_how(tmp_path):
    """``gc --max-size 0`` on entries just saved frees nothing: the line names the grace period and the flag."""
    root = tmp_path / "store"
    _two_entries(root)
    done = adstore("--root", str(root), "gc", "--max-size", "0", cwd=tmp_path)
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 8 and "2 entries inside the grace period" in line and "--grace-period 0" in line, line
    now = adstore("--root", str(root), "gc", "--max-size", "0", "--grace-period", "0", "--no-sweep", cwd=tmp_path)
    assert now.returncode == 0 and "freed 200" in now.stdout, now


def test_gc_stopped_by_orphans_inside_the_grace_period_says_how(tmp_path):
    root = tmp_path / "store"
    _two_entries(root)
    assert adstore("--root", str(root), "rm", "k1", "k2", cwd=tmp_path).returncode == 0
    done = adstore("--root", str(root), "gc", "--max-size", "0", "--no-sweep", cwd=tmp_path)
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 8 and "unreferenced blobs inside the grace period" in line, line
    assert "--grace-period 0" in line


def test_a_root_that_is_a_file_is_called_a_file(tmp_path):
    """Not "no adstore store" (read-only commands) nor "File exists" (writers): what is wrong, for both."""
    (tmp_path / "rootfile").write_text("not a store")
    for root in ("rootfile", "rootfile/sub"):
        for command in (["stats"], ["gc"], ["ls"]):
            done = adstore("--root", root, *command, cwd=tmp_path)
            line = _one_line(done)
            assert done.returncode == 13, (command, done)
            assert "rootfile is a file, not a directory" in line, line
    assert (tmp_path / "rootfile").read_text() == "not a store"


def test_a_root_that_is_a_file_through_the_api(tmp_path):
    from adstore.store import NoStore, RootNotADirectory, Store

    (tmp_path / "f").write_text("x")
    for create in (True, False):
        with pytest.raises(RootNotADirectory) as caught:
            Store.open(tmp_path / "f", create=create)
        assert isinstance(caught.value, NoStore) and str(caught.value).startswith(f"{tmp_path / 'f'} is a file")


def test_stats_zero_sets_the_counters_to_zero_and_keeps_the_entries(tmp_path):
    """Like ``ccache -z``: counting starts again from here; entries, sizes and the budget stay."""
    import json

    from adstore.store import Store

    root = tmp_path / "store"
    _two_entries(root)
    with Store.open(root) as store:
        assert store.lookup("k1").hit and not store.lookup("nope" * 16).hit

    def stats() -> dict:
        done = adstore("--root", str(root), "stats", "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    before = stats()
    assert before["counters"]["hits"] == 1 and before["counters"]["misses"] == 1 and before["counters_zeroed"] is None
    zeroed = adstore("--root", str(root), "stats", "--zero", cwd=tmp_path)
    assert zeroed.returncode == 0 and "zeroed" in zeroed.stdout, zeroed
    after = stats()
    assert not any(after["counters"].values()) and after["counters_zeroed"] is not None
    assert after["entries"] == 2 and after["physical_bytes"] == before["physical_bytes"]
    with Store.open(root) as store:
        assert store.lookup("k2").hit
    assert stats()["counters"]["hits"] == 1  # counting goes on from zero
    assert "Counted since" in adstore("--root", str(root), "stats", cwd=tmp_path).stdout
