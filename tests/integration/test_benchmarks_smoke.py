"""Every benchmark still runs (small, in the slow tier): they are not collected
by pytest otherwise, and a signature change once broke one unnoticed.

Results go to a temporary ``ADSTORE_BENCH_RESULTS`` directory, so measured
figures in ``bench-results/`` are never overwritten.  The figures of these
small runs mean nothing; only that each benchmark completes and writes its
JSON is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

SMALL = {
    "bench_store": (["--quick", "--procs", "2"], "store.json"),
    "bench_daemon": (
        ["--entries", "2000", "--unique-blobs", "200", "--idle-seconds", "2", "--trials", "1"],
        "daemon.json",
    ),
    "bench_snapshot": (["--layers", "2", "--repeat", "1"], "bench_snapshot.json"),
    "bench_pipeline": (["--layers", "2", "--hidden", "64"], "bench_pipeline.json"),
    "bench_engine": (["--hidden", "64", "--batch", "4"], "engine.json"),
    "bench_restart": (["--quick", "--repeat", "1"], "restart.json"),
    "bench_remote": (["--quick"], "remote.json"),
    "bench_compression": (["--quick", "--big-mib", "8"], "compression.json"),
    "bench_scale": (["--quick"], "scale.json"),
    "bench_inductor": (["--quick"], "inductor.json"),
    "bench_aot_compile": (["--quick"], "aot_compile.json"),
    "bench_run": (["--repeat", "2", "--torch-repeat", "1"], "run.json"),
    "bench_zoo": (["--models", "sequential", "--repeat", "1"], "zoo.json"),
}
# bench_vllm is not here: its runs take minutes each (vLLM's processes), more than CI's slow tier can spare;
# its parts (vllm_env, vllm_run, vllm_hosts) run in tests/integration/vllm_plugin/test_vllm_real.py.
# bench_fleet is not here either: tests/integration/inductor/test_fleet_hosts.py starts the same hosts.
# Nor bench_programs: tests/integration/inductor/test_programs.py makes the same runs of the same programs.


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALL))
def test_benchmark_runs_small(name, tmp_path):
    args, written = SMALL[name]
    env = dict(
        os.environ,
        ADSTORE_BENCH_RESULTS=str(tmp_path / "results"),
        ADSTORE_BENCH_DIR=str(tmp_path),
        ADSTORE_ROOT=str(tmp_path / "store"),
    )
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "results" / written).read_text())
    assert figures, f"{name} wrote an empty {written}"
