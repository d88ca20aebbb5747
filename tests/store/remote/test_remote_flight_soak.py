"""Soak: 4 simulated hosts, 16 processes, 3 model versions, builders killed with SIGKILL at random points.

Each host is a store root and an Inductor directory its 4 processes share,
and a host name of its own; one moto S3 server is the fleet's remote.  Every
process compiles one of 3 model versions, all started together; the test
kills up to 3 processes right after they take a build lease, after a random
delay.  Then: every process that lived computed what a lone cold run of its
version computes, every host's store is ``adstore verify``-clean, and the
compiler ran at most 1.1x per distinct graph, plus one run per takeover (the
dead builders' runs included).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_remote_flight_inductor import HERE, TIMEOUT

from adstore.store.remote import write_keypair

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "inductor"))
from inductor_hosts import host_env  # noqa: E402

pytestmark = pytest.mark.slow

#: hosts, processes per host, model versions, most builders killed (``ADSTORE_SOAK=2,2,2,1`` for a smaller run).
HOSTS, PROCS, VERSIONS, KILLS = (int(n) for n in os.environ.get("ADSTORE_SOAK", "4,4,3,3").split(","))


def spawn(spec: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "flight_hosts.py"), json.dumps(spec)])


def test_a_fleet_with_builders_killed_compiles_each_graph_about_once(s3_url, tmp_path):
    rng = random.Random(int(os.environ.get("ADSTORE_SOAK_SEED", "42")))
    # A lone cold run per version: the outputs every process must match.
    lone = {}
    for v in range(VERSIONS):
        spec = {"host": f"lone-{v}", "env": host_env(tmp_path / "lone", f"v{v}"), "version": v}
        spec.update(go=str(tmp_path / "lone" / "go"), marks=str(tmp_path / "lone"), out=str(tmp_path / f"lone{v}.json"))
        (tmp_path / "lone" / "go").touch()
        assert spawn(spec).wait(TIMEOUT) == 0
        lone[v] = json.loads((tmp_path / f"lone{v}.json").read_text())["output"]

    private, public = write_keypair(tmp_path / "keys")
    marks, go = tmp_path / "marks", tmp_path / "go"
    marks.mkdir()
    procs: dict[str, tuple[subprocess.Popen, int, Path]] = {}
    for h in range(HOSTS):
        env = host_env(
            tmp_path,
            f"h{h}",
            ADSTORE_REMOTE=s3_url,
            ADSTORE_REMOTE_MODE="read-write",
            ADSTORE_SIGNING_KEY=str(private),
            ADSTORE_TRUSTED_KEYS=str(public),
            ADSTORE_FLIGHT_TTL="10s",
        )
        for p in range(PROCS):
            v, out = (h + p) % VERSIONS, tmp_path / f"h{h}p{p}.json"
            spec = {"host": f"h{h}", "env": env, "go": str(go), "marks": str(marks), "out": str(out), "version": v}
            procs[f"h{h}p{p}"] = (spawn(spec), v, out)
    time.sleep(1.0)
    go.touch()

    killed: set[int] = set()
    seen: set[str] = set()
    deadline = time.monotonic() + TIMEOUT
    while any(proc.poll() is None for proc, _, _ in procs.values()) and time.monotonic() < deadline:
        for mark in sorted(marks.iterdir()):
            if mark.name in seen:
                continue
            seen.add(mark.name)
            pid = int(mark.name.split(".")[1])
            if len(killed) < KILLS and rng.random() < 0.6:
                time.sleep(rng.uniform(0.0, 4.0))  # somewhere in its compile, its save or its push
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass  # it finished first
        time.sleep(0.05)

    results = {}
    for name, (proc, v, out) in procs.items():
        proc.wait(60)
        if proc.pid in killed and proc.returncode == -signal.SIGKILL:
            continue
        assert proc.returncode == 0, name
        results[name] = (v, json.loads(out.read_text()))
    for name, (v, r) in results.items():
        assert r["output"] == lone[v], name  # every hit verified by the store; the output is a lone run's

    # Compiler runs of the processes that lived, a takeover's among them (a killed builder's run is lost with it).
    runs = sum(r["inductor"].get("fxgraph_cache_miss", 0) for _, r in results.values())
    # A host's processes share its store's counters: each host's last (largest) reading, summed over hosts.
    takeovers = sum(
        max(
            (r["store"].get("remote.flight.takeovers", 0) for n, (_, r) in results.items() if n.startswith(f"h{h}p")),
            default=0,
        )
        for h in range(HOSTS)
    )
    flights = {n: {k: v for k, v in r["store"].items() if "flight" in k} for n, (_, r) in results.items()}
    assert runs <= 1.1 * VERSIONS + takeovers, (runs, takeovers, killed, flights)

    for h in range(HOSTS):
        check = subprocess.run(
            [sys.executable, "-m", "adstore.daemon", "--root", str(tmp_path / f"h{h}" / "store"), "verify"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert check.returncode == 0, check.stdout + check.stderr
