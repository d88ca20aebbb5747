"""Single-flight of Inductor's entries across hosts: a lone cold start, 4 hosts together, and 4 with a kill.

    python tests/benchmarks/bench_flight.py [--hosts 4] [--kill-after 8] [--ttl 15]

Each simulated host is a fresh process with its own store, Inductor
directory, ``TMPDIR`` and host name (``tests/store/remote/flight_hosts.py``);
one moto S3 server on 127.0.0.1 is the remote (a fresh prefix per row).
Every host runs plain ``torch.compile`` of the small MLP of the Inductor
tests with ``adstore.integration.inductor.enable()``.  Rows:

* lone cold start: one host, nothing anywhere: its wall time (import to
  output) and its C++ builds (kernels, ISA probes, the precompiled header);
* ``--hosts`` together: total C++ builds over the lone host's (goal ≤ 1.25)
  and the slowest host's wall time over the lone one's (goal ≤ 2);
* the same, the builder killed with SIGKILL ``--kill-after`` seconds after
  the start (leases of ``--ttl`` seconds): the others' slowest wall time over
  the lone one's (goal ≤ 3) and identical outputs.

Writes ``bench-results/flight.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REMOTE_TESTS = REPO / "tests" / "store" / "remote"
sys.path.insert(0, str(REMOTE_TESTS))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "integration" / "inductor"))
from bench_results import write_results  # noqa: E402
from inductor_hosts import host_env  # noqa: E402
from remote_servers import BUCKET, S3_ENV, start_moto  # noqa: E402


def fleet(base: Path, url: str, n: int, *, keys: tuple[Path, Path], kill_after: float | None, ttl: float) -> dict:
    """Start ``n`` hosts together on one fresh remote prefix; kill the first builder ``kill_after`` s in."""
    marks, go = base / "marks", base / "go"
    marks.mkdir(parents=True)
    procs = {}
    for i in range(n):
        env = host_env(
            base,
            f"h{i}",
            ADSTORE_REMOTE=url,
            ADSTORE_REMOTE_MODE="read-write",
            ADSTORE_SIGNING_KEY=str(keys[0]),
            ADSTORE_TRUSTED_KEYS=str(keys[1]),
            ADSTORE_FLIGHT_TTL=f"{ttl:g}s",
        )
        out = base / f"h{i}.json"
        spec = {"host": f"h{i}", "env": env, "go": str(go), "marks": str(marks), "out": str(out)}
        procs[f"h{i}"] = (
            subprocess.Popen([sys.executable, str(REMOTE_TESTS / "flight_hosts.py"), json.dumps(spec)]),
            out,
        )
    time.sleep(1.0)
    go.touch()
    start = time.monotonic()
    killed = None
    if kill_after is not None:
        while not list(marks.iterdir()) and time.monotonic() - start < 600:
            time.sleep(0.05)
        time.sleep(max(0.0, kill_after - (time.monotonic() - start)))
        first = sorted(marks.iterdir(), key=lambda p: p.stat().st_mtime)[0]
        killed = first.name.split(".")[0]
        proc = procs[killed][0]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    hosts: dict[str, Any] = {}
    for name, (proc, out) in procs.items():
        proc.wait(1800)
        if proc.returncode == 0:
            r = json.loads(out.read_text())
            hosts[name] = {
                "wall_s": r["wall"],
                "builds": len(r["builds"]),
                "fx_misses": r["inductor"].get("fxgraph_cache_miss", 0),
                "output": r["output"],
                "flight": {k: v for k, v in r["store"].items() if k.startswith("remote.flight.")},
            }
    return {"hosts": hosts, "killed": killed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--kill-after", type=float, default=8.0)
    ap.add_argument("--ttl", type=float, default=15.0, help="lease TTL of the hosts (ADSTORE_FLIGHT_TTL)")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="adstore-bench-flight-"))
    (work / "moto").mkdir(parents=True, exist_ok=True)
    server = start_moto(work / "moto")
    os.environ.update(S3_ENV)
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    try:
        import boto3

        boto3.session.Session().client("s3").create_bucket(Bucket=BUCKET)
        from adstore.store.remote import write_keypair

        keys = write_keypair(work / "keys")

        def url() -> str:
            return f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"

        lone = fleet(work / "lone", url(), 1, keys=keys, kill_after=None, ttl=args.ttl)["hosts"]["h0"]
        together = fleet(work / "together", url(), args.hosts, keys=keys, kill_after=None, ttl=args.ttl)
        kill = fleet(work / "kill", url(), args.hosts, keys=keys, kill_after=args.kill_after, ttl=args.ttl)
    finally:
        server.stop()

    def summary(run: dict) -> dict:
        hosts = run["hosts"].values()
        return {
            **run,
            "total_builds": sum(h["builds"] for h in hosts),
            "total_fx_compiles": sum(h["fx_misses"] for h in hosts),
            "slowest_s": max(h["wall_s"] for h in hosts),
            "identical": len({h["output"] for h in hosts} | {lone["output"]}) == 1,
        }

    t, k = summary(together), summary(kill)
    result = {
        "model": "Linear(16,32)-ReLU-Linear(32,8), batch 4, CPU",
        "hosts": args.hosts,
        "kill_after_s": args.kill_after,
        "ttl_s": args.ttl,
        "lone": lone,
        "together": t,
        "kill": k,
        "together_builds_over_lone": t["total_builds"] / max(1, lone["builds"]),
        "together_slowest_over_lone": t["slowest_s"] / lone["wall_s"],
        "kill_slowest_over_lone": k["slowest_s"] / lone["wall_s"],
    }
    result["together_within_goal"] = (
        result["together_builds_over_lone"] <= 1.25 and result["together_slowest_over_lone"] <= 2 and t["identical"]
    )
    result["kill_within_goal"] = result["kill_slowest_over_lone"] <= 3 and k["identical"]
    print(f"wrote {write_results('flight.json', result, partial=False)}")
    print(
        f"lone cold {lone['wall_s']:.1f} s, {lone['builds']} builds; "
        f"{args.hosts} together: {t['total_builds']} builds ({result['together_builds_over_lone']:.2f}x), "
        f"slowest {t['slowest_s']:.1f} s ({result['together_slowest_over_lone']:.2f}x); "
        f"killed {k['killed']} at {args.kill_after:g} s: slowest other {k['slowest_s']:.1f} s "
        f"({result['kill_slowest_over_lone']:.2f}x), identical {k['identical']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
