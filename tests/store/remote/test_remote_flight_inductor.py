"""A fleet that starts cold together compiles each FX graph once (single-flight on Inductor's entries).

Three simulated hosts (each its own process, store, Inductor directory,
``TMPDIR`` and host name; one moto S3 server on 127.0.0.1) start the same
small ``torch.compile`` together.  Without single-flight each would build
every kernel; with it one builds and the others wait for its entry, then
hit (0 kernel builds), with the same output.  When the builder is killed
with SIGKILL right after it takes the lease, its lease expires (a short
``ADSTORE_FLIGHT_TTL``) and exactly one of the others takes it over; the
third waits again and hits (slow run; the default run takes the takeover
with injected time in ``test_remote_singleflight`` and ``test_remote_entry_flights``).
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

from adstore.store.remote import write_keypair

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "inductor"))
from inductor_hosts import host_env  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMEOUT = 600


def start_hosts(base: Path, url: str, names: list[str], **extra: str) -> tuple[dict, Path, Path]:
    """Spawn one process per host, all waiting for the ``go`` file; returns (procs, go, marks)."""
    private, public = write_keypair(base / "keys")
    marks = base / "marks"
    marks.mkdir()
    go = base / "go"
    procs = {}
    for name in names:
        env = host_env(
            base,
            name,
            ADSTORE_REMOTE=url,
            ADSTORE_REMOTE_MODE="read-write",
            ADSTORE_SIGNING_KEY=str(private),
            ADSTORE_TRUSTED_KEYS=str(public),
            **extra,
        )
        out = str(base / f"{name}.json")
        spec = {"host": f"host-{name}", "env": env, "go": str(go), "marks": str(marks), "out": out}
        procs[name] = subprocess.Popen([sys.executable, str(HERE / "flight_hosts.py"), json.dumps(spec)])
    return procs, go, marks


def results(base: Path, procs: dict) -> dict[str, dict]:
    out = {}
    for name, proc in procs.items():
        proc.wait(TIMEOUT)
        if proc.returncode == 0:
            out[name] = json.loads((base / f"{name}.json").read_text())
    return out


def kernels(result: dict) -> list[str]:
    """What a host's compiler built: kernels, ISA probes and the precompiled header (every C++ build)."""
    return list(result["builds"])


def test_three_hosts_started_together_compile_once(s3_url, tmp_path):
    procs, go, _ = start_hosts(tmp_path, s3_url, ["a", "b", "c"])
    time.sleep(0.5)
    go.touch()
    res = results(tmp_path, procs)
    assert len(res) == 3, res.keys()
    built = {n: kernels(r) for n, r in res.items()}
    leaders = [n for n, r in res.items() if r["store"].get("remote.flight.leader")]
    assert len(leaders) == 1 and built[leaders[0]], (leaders, built)
    for name, r in res.items():
        assert r["output"] == res[leaders[0]]["output"], name
        if name in leaders:
            continue
        assert built[name] == [], (name, r["builds"])
        assert r["inductor"].get("fxgraph_cache_hit") == 1, (name, r["inductor"])
        assert r["store"].get("remote.flight.follower") and r["store"].get("remote.flight.ready"), r["store"]
        assert r["store"].get("remote.flight.waited_ms", 0) > 0, r["store"]


@pytest.mark.slow  # the default run covers the takeover with injected time (test_remote_singleflight, _entry_flights)
def test_a_killed_builder_is_taken_over_by_one_waiter(s3_url, tmp_path):
    procs, go, marks = start_hosts(tmp_path, s3_url, ["a", "b", "c"], ADSTORE_FLIGHT_TTL="2s")
    time.sleep(0.5)
    go.touch()
    deadline = time.monotonic() + TIMEOUT
    while not list(marks.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)
    (first,) = list(marks.iterdir())
    host, pid = first.name.split(".")[:2]
    os.kill(int(pid), signal.SIGKILL)  # the builder dies holding its lease
    res = results(tmp_path, procs)
    killed = host.removeprefix("host-")
    assert procs[killed].returncode == -signal.SIGKILL and set(res) == set(procs) - {killed}, res.keys()
    takeovers = [n for n, r in res.items() if r["store"].get("remote.flight.takeovers")]
    assert len(takeovers) == 1, {n: r["store"] for n, r in res.items()}
    (other,) = set(res) - set(takeovers)
    assert kernels(res[takeovers[0]]) and kernels(res[other]) == [], {n: r["builds"] for n, r in res.items()}
    assert res[other]["inductor"].get("fxgraph_cache_hit") == 1 and res[other]["output"] == res[takeovers[0]]["output"]
    assert len(list(marks.iterdir())) == 2  # the dead builder's lease, and the one taken over


@pytest.mark.slow
def test_two_hosts_aot_compiling_one_module_together_compile_it_once(s3_url, tmp_path):
    """``aot_compile`` entries take the same lease: one host compiles, the other waits for it (or finds it), loads."""
    import threading

    from aot_hosts import aot_host
    from inductor_hosts import on_host

    private, public = write_keypair(tmp_path / "keys")
    env = {
        "ADSTORE_REMOTE": s3_url,
        "ADSTORE_REMOTE_MODE": "read-write",
        "ADSTORE_SIGNING_KEY": str(private),
        "ADSTORE_TRUSTED_KEYS": str(public),
    }
    got: dict[str, dict] = {}

    def run(name: str) -> None:
        got[name] = on_host(aot_host, host_env(tmp_path, name, **env), False, 0)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(r["outcome"] for r in got.values()) == ["compiled", "hit"], got
    hit = next(r for r in got.values() if r["outcome"] == "hit")
    assert hit["builds"] == [] and len({r["output"] for r in got.values()}) == 1, hit
