"""Where the benchmarks write their JSON (imported by each ``bench_*.py``).

``bench-results/`` at the repository root, where ``run_all.py`` collects
them, unless ``ADSTORE_BENCH_RESULTS`` names another directory: the smoke
tests run every benchmark small with it set, so they never overwrite
measured figures.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["results_dir"]

REPO = Path(__file__).resolve().parents[2]


def results_dir() -> Path:
    out = Path(os.environ.get("ADSTORE_BENCH_RESULTS") or REPO / "bench-results")
    out.mkdir(parents=True, exist_ok=True)
    return out
