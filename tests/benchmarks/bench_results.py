"""Where the benchmarks write their JSON (imported by each ``bench_*.py``).

``bench-results/`` at the repository root, where ``run_all.py`` collects
them, unless ``ADSTORE_BENCH_RESULTS`` names another directory: the smoke
tests run every benchmark small with it set, so they never overwrite
measured figures.

Importing it also makes the processes a benchmark starts run as an installed
adstore does: with the bytecode Python caches on first import (``pip
install`` writes it for a regular install).  An environment that sets
``PYTHONDONTWRITEBYTECODE`` (some sandboxes and CI images do) would make
every measured restart compile adstore's sources again, about 0.2 s per
process here, a cost no installed copy pays; so the variable is dropped for
the benchmark's children and the sources are compiled once, here.
"""

from __future__ import annotations

import compileall
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["results_dir", "write_results"]

REPO = Path(__file__).resolve().parents[2]

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
if not os.environ.get("ADSTORE_BENCH_COMPILED"):  # once per benchmark: its timed children import this too
    for _package in ("store", "integration", "daemon"):
        compileall.compile_dir(REPO / _package, quiet=2)
    os.environ["ADSTORE_BENCH_COMPILED"] = "1"


def results_dir() -> Path:
    out = Path(os.environ.get("ADSTORE_BENCH_RESULTS") or REPO / "bench-results")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_results(name: str, results: dict[str, Any], *, partial: bool) -> Path:
    """Write ``results`` to ``<results_dir>/<name>``; a ``partial`` run (some parts skipped) keeps the
    sections of the last run it did not measure, so one part can be measured again alone."""
    path = results_dir() / name
    merged: dict[str, Any] = {}
    if partial:
        try:
            merged = json.loads(path.read_text())
        except (OSError, ValueError):
            merged = {}
    merged.update(results)
    path.write_text(json.dumps(merged, indent=2))
    return path
