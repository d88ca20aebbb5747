"""A killed process's leftovers (private code directory, temp files in Inductor's and vLLM's directories) are swept.

A real child makes them and is killed with SIGKILL, so nothing of its own
cleans up; the sweep (``plan_dead_temps``, ``adstore gc``, ``enable()``)
removes exactly those, and never a live process's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adstore.store import Store, default_temp_dirs, plan_dead_temps

CHILD = r"""
import os, sys, time
from pathlib import Path
from adstore.integration.placement.dirs import private_dir, temp_name
code = private_dir()
(code / "engine.pt2").write_bytes(b"x" * 1000)
kernel = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "ab" / temp_name()
kernel.parent.mkdir(parents=True, exist_ok=True)
kernel.write_bytes(b"y" * 100)
rank = Path(os.environ["VLLM_CACHE_ROOT"]) / "torch_compile_cache" / "h" / "rank_0_0"
tree = rank / f".adstore-{os.getpid()}-q.backbone"
tree.mkdir(parents=True)
(tree / "model").write_bytes(b"z" * 10)
print(str(code), str(kernel), str(tree), flush=True)
time.sleep(600)
"""


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {
        **os.environ,
        "TMPDIR": str(tmp_path / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
        "ADSTORE_ROOT": str(tmp_path / "store"),
    }


def _killed_child(env: dict[str, str]) -> list[Path]:
    """What a child made before SIGKILL: its private code directory, a kernel temp file, a tree temp directory."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL and len(line) == 3, line
    return [Path(p) for p in line]


def _alive_leftover(env: dict[str, str]) -> Path:
    """A temp file of this (live) process: never swept."""
    mine = Path(env["TORCHINDUCTOR_CACHE_DIR"]) / "cd" / f".adstore-{os.getpid()}-live.tmp"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_bytes(b"in use")
    return mine


def test_a_killed_processs_leftovers_are_planned_and_removed_and_a_live_ones_stay(tmp_path):
    env = _env(tmp_path)
    left = _killed_child(env)
    live = _alive_leftover(env)
    assert all(p.exists() for p in left)
    dirs = default_temp_dirs(env)
    assert plan_dead_temps(dirs, grace=60.0, now=time.time()).victims == ()  # younger than the grace period
    plan = plan_dead_temps(dirs, grace=60.0, now=time.time() + 120)
    assert sorted(p for p, _ in plan.victims) == sorted(str(p) for p in left), plan
    assert plan.bytes_to_free == 1110
    assert plan.execute() == 1110
    assert not any(p.exists() for p in left) and live.exists()


def test_adstore_gc_sweeps_them(tmp_path):
    env = _env(tmp_path)
    Store.open(env["ADSTORE_ROOT"]).close()
    left = _killed_child(env)
    live = _alive_leftover(env)
    adstore = [sys.executable, "-m", "adstore.daemon"]
    dry = subprocess.run(
        [*adstore, "gc", "--grace-period", "0", "--dry-run", "--json"], env=env, capture_output=True, text=True
    )
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["dead_temps"]["dead_temps"] == 3 and all(p.exists() for p in left)
    done = subprocess.run([*adstore, "gc", "--grace-period", "0", "--json"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dead_temps"]["bytes_freed"] == 1110
    assert not any(p.exists() for p in left) and live.exists()


def test_enable_sweeps_them_in_the_background(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from adstore.integration import inductor
    from adstore.integration.inductor import plug

    env = _env(tmp_path)
    left = _killed_child(env)
    old = time.time() - 3600
    for p in left:
        os.utime(p, (old, old))
    for name in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"):
        monkeypatch.setenv(name, env[name])
    with Store.open(env["ADSTORE_ROOT"]) as store:
        assert inductor.enable(store)
        try:
            plug._state.toolchain.thread.join(60)
        finally:
            inductor.disable()
    assert not any(p.exists() for p in left)
