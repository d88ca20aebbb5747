"""A fleet is not a set of twins: a user's own torch.compile model started on hosts that differ from the builder.

Every figure is a fresh process timed from its start to its first compiled
output (``fleet_run.py``: two MLP-Mixer blocks under plain ``torch.compile``
with ``adstore.integration.inductor.enable()``).  Host A builds cold and
pushes to a signed HTTP remote (WebDAV on 127.0.0.1); its local warm restart
is the baseline.  Hosts B to F (``fleet_hosts.py``) each differ from A by one
thing, simulated for real (a mount namespace, another uid, a read-only bind
mount, the venv at another path), and start once, empty but for the remote
(E: A's store read-only, no remote).  Reported per host: start, compiler
runs (``g++ ... -o``, preprocessing left out), the ratio to A's local warm
restart, whether the output is bit-identical to A's cold run, and what
adstore said of any miss.

Goal (issues 36, 41): B to F run no compiler and start within 1.3x A's
local warm restart + 0.5 s.  Needs
root (namespaces, uid 1001).

    python tests/benchmarks/bench_fleet.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_restart import http_remote, timed  # noqa: E402
from bench_results import write_results  # noqa: E402
from fleet_hosts import HOSTS, Fleet  # noqa: E402

SLACK_RATIO = 1.3
SLACK_S = 0.5


def measure(work: Path, repeat: int, kinds: list[str]) -> dict[str, Any]:
    """Floor, A cold and warm (median of ``repeat``), then each other host once; the figures."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ADSTORE_", "TORCHINDUCTOR_"))}
    floors = [timed([sys.executable, "-c", "import torch; print('FIRST {}', flush=True)"], clean)[0] for _ in range(3)]
    server, remote = http_remote(work)
    try:
        fleet = Fleet(work / "hosts", remote)
        builder = fleet.host("builder")
        cold = fleet.run(builder)
        warm_runs = [fleet.run(builder) for _ in range(max(repeat, 1))]
        warm = statistics.median(r["seconds"] for r in warm_runs)
        hosts: dict[str, Any] = {}
        for kind in kinds:
            run = fleet.run(fleet.host(kind))
            budget = SLACK_RATIO * warm + SLACK_S
            hosts[kind] = {
                "label": HOSTS[kind][0],
                "differs_by": HOSTS[kind][1],
                "seconds": run["seconds"],
                "compiler_runs": run["compiler_runs"],
                "compiler_targets": run["compiler_targets"],
                "over_local_warm": run["seconds"] / warm,
                "within_goal": run["compiler_runs"] == 0 and run["seconds"] <= budget,
                "identical": run["sha"] == cold["sha"],
                "failopen": run.get("failopen"),
                "store": run.get("store"),
                "warnings": run.get("warnings"),
            }
            print(
                f"  {hosts[kind]['label']} {kind}: {run['seconds']:.2f} s, {run['compiler_runs']} compiler runs, "
                f"{run['seconds'] / warm:.2f}x warm, identical {hosts[kind]['identical']}, "
                f"fail-open {run.get('failopen') or 'none'}",
                flush=True,
            )
    finally:
        server.stop()
    return {
        "model": "two MLP-Mixer blocks (fleet_run.mixer), plain torch.compile",
        "floor_s": statistics.median(floors),
        "cold": {"seconds": cold["seconds"], "compiler_runs": cold["compiler_runs"]},
        "local_warm": {
            "seconds": warm,
            "runs": [r["seconds"] for r in warm_runs],
            "compiler_runs": max(r["compiler_runs"] for r in warm_runs),
        },
        "goal": f"<= {SLACK_RATIO}x local warm + {SLACK_S} s, no compiler run",
        "hosts": hosts,
    }


def print_table(r: dict[str, Any]) -> None:
    warm = r["local_warm"]["seconds"]
    print(f"\n{r['model']}; floor (import torch) {r['floor_s']:.2f} s")
    print(f"  {'host':<4} {'differs from A by':<52} {'start':>7} {'compiler runs':>14} {'/ warm':>7} {'identical':>10}")
    print(f"  {'A':<4} {'cold (builds, pushes)':<52} {r['cold']['seconds']:>7.2f} {r['cold']['compiler_runs']:>14}")
    print(f"  {'A':<4} {'local warm restart':<52} {warm:>7.2f} {r['local_warm']['compiler_runs']:>14} {1.0:>7.2f}")
    for h in r["hosts"].values():
        print(
            f"  {h['label']:<4} {h['differs_by']:<52} {h['seconds']:>7.2f} {h['compiler_runs']:>14} "
            f"{h['over_local_warm']:>7.2f} {('yes' if h['identical'] else 'NO'):>10}"
        )
    print(f"  goal: {r['goal']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="local warm restarts of A (median reported)")
    ap.add_argument("--hosts", default="", help="host kinds to start (comma-separated; default: all)")
    args = ap.parse_args()
    kinds = [k for k in HOSTS if k != "builder" and (not args.hosts or k in args.hosts.split(","))]
    if os.geteuid() != 0:
        print("bench_fleet needs root (mount namespaces, another uid)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="adstore-bench-fleet-", dir=os.environ.get("ADSTORE_BENCH_DIR")) as tmp:
        os.chmod(tmp, 0o755)  # uid 1001 reaches its host's directories through it
        results = measure(Path(tmp), args.repeat, kinds)
    print_table(results)
    print(f"\nwrote {write_results('fleet.json', results, partial=False)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
