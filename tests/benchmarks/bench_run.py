"""Benchmark of ``ADSTORE_ENABLE=1`` (``adstore run``): what it adds to processes that never compile.

    python tests/benchmarks/bench_run.py [--repeat 40] [--torch-repeat 8] [--quick]

Every Python process under ``adstore run`` reads ``adstore-enable.pth`` at
start and watches for ``torch._dynamo``; the target (issue 41) is a few
milliseconds on ``python -c pass`` and nothing that grows with the program.
Each figure is a cold interpreter's wall time, median of ``--repeat`` runs,
with and without the variable taken in turns in the same run (the baseline):

1. ``python -c pass`` (target: + 5 ms at most);
2. ``python -c "import torch"``: torch's import must not wake adstore (the watch asks one dict per
   module imported); no target, since torch's own start varies by more than that from run to run.

Results print as a table and go to bench-results/run.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench_results import write_results

#: The most ``ADSTORE_ENABLE=1`` may add to a process start (issue 41: "a few milliseconds").
TARGET_SECONDS = 0.005

PROGRAMS = {"pass": "pass", "import_torch": "import torch"}


def _start(code: str, enabled: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k != "ADSTORE_ENABLE"}
    if enabled:
        env["ADSTORE_ENABLE"] = "1"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - t0


def measure(code: str, repeat: int, *, target: float | None) -> dict[str, Any]:
    """Median wall time of a cold ``python -c CODE`` without and with the variable, in turns."""
    _start(code, False), _start(code, True)  # warm the page cache and the bytecode caches
    off: list[float] = []
    on: list[float] = []
    for _ in range(repeat):
        off.append(_start(code, False))
        on.append(_start(code, True))
    base, with_ = statistics.median(off), statistics.median(on)
    return {
        "repeat": repeat,
        "off_seconds": base,
        "on_seconds": with_,
        "added_seconds": with_ - base,
        "ratio": with_ / base,
        "target_seconds": target,
        "meets_target": None if target is None else with_ - base <= target,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=40, help="runs of `python -c pass` each way")
    parser.add_argument("--torch-repeat", type=int, default=8, help="runs of `import torch` each way")
    parser.add_argument("--quick", action="store_true", help="fewer runs (indicative figures)")
    args = parser.parse_args()
    repeats = {"pass": args.repeat, "import_torch": args.torch_repeat}
    if args.quick:
        repeats = {"pass": 15, "import_torch": 3}
    results: dict[str, Any] = {"quick": args.quick}
    print(f"{'program':<14} {'without':>10} {'ADSTORE_ENABLE=1':>17} {'added':>10} {'ratio':>7}")
    for name, code in PROGRAMS.items():
        figures = measure(code, repeats[name], target=TARGET_SECONDS if name == "pass" else None)
        results[name] = figures
        print(
            f"{name:<14} {1000 * figures['off_seconds']:>8.1f}ms {1000 * figures['on_seconds']:>15.1f}ms "
            f"{1000 * figures['added_seconds']:>+8.1f}ms {figures['ratio']:>6.3f}x"
        )
    path = write_results("run.json", results, partial=False)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
