"""``adstore run -- python prog.py``: a program with no adstore import gets the store, and nothing breaks it.

``prog.py`` compiles a tiny module with ``torch.compile`` and prints its
output and Inductor's cache counters.  Run twice through ``adstore run``,
each time with an empty Inductor cache directory and ``TMPDIR`` (another
host), the second run is served from the store; with a store root that is a
file the program still prints the right output (``ADSTORE_ENABLE=0``, which
imports nothing of adstore, is tested without a compile in
``tests/integration/test_autoenable.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from inductor_hosts import host_env

from adstore.store import Store

pytest.importorskip("torch")

FX = "inductor_fx_graph"

PROG = """
import json, sys
import torch

torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
x = torch.randn(2, 8)
with torch.no_grad():
    out = torch.compile(m)(x)
    want = m(x)
from torch._dynamo.utils import counters
print(json.dumps({
    "right": bool(torch.allclose(out, want)),
    "hits": counters["inductor"]["fxgraph_cache_hit"],
    "misses": counters["inductor"]["fxgraph_cache_miss"],
    "adstore": "adstore.integration.inductor.plug" in sys.modules,
}))
"""


def _run(tmp_path: Path, host: str, root: Path, *, wrap: bool = True, enable: str | None = None) -> dict:
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADSTORE_")}
    env.update(host_env(tmp_path, host, root))
    del env["ADSTORE_ROOT"]  # given as --root, or not at all
    if enable is not None:
        env["ADSTORE_ENABLE"] = enable
    argv = [sys.executable, str(prog)]
    if wrap:
        argv = [sys.executable, "-m", "adstore", "run", "--root", str(root), "--", *argv]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    return report


def _counters(root: Path) -> dict[str, int]:
    with Store.open(root) as store:
        return store.stats().counters


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """Host a's run through ``adstore run``: the compile that fills the store."""
    base = tmp_path_factory.mktemp("run")
    root = base / "store"
    report = _run(base, "a", root)
    assert report["right"] and report["adstore"] and report["misses"] == 1, report
    return base, root


def test_the_second_run_is_served_from_the_store(cold):
    base, root = cold
    warm = _run(base, "b", root)  # an empty Inductor cache directory: only the store can serve it
    assert warm["right"] and warm["hits"] == 1 and warm["misses"] == 0, warm
    counters = _counters(root)
    assert counters.get(f"inductor.hits.{FX}") == 1 and counters.get("autoenable.enabled") == 2, counters


def test_a_store_root_that_is_a_file_still_runs_the_program(cold):
    """``ADSTORE_ENABLE=0`` imports nothing (tests/integration/test_autoenable.py); a broken store is one line."""
    base, _ = cold
    root = base / "file"
    root.write_text("not a store")
    broken = _run(base, "a", root)  # host a's own Inductor cache: what torch does without adstore
    assert broken["right"] and broken["hits"] + broken["misses"] == 1, broken
    assert "Traceback" not in broken["stderr"] and "adstore" in broken["stderr"], broken["stderr"]
    assert root.read_text() == "not a store"
