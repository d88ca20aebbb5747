"""Third-party programs, unmodified, through ``adstore run``: a second run and a second host compile nothing.

Issue 41, item 3.  Each program (``tests/benchmarks/programs.py``) is the
source a user of transformers, Lightning or ``torchrun`` writes from that
library's documentation, with no adstore import:

* transformers' ``torch.compile`` recipe: a small Llama built from a config
  (random weights, offline), ``model.forward = torch.compile(model.forward,
  mode="reduce-overhead", fullgraph=True)`` and ``generate(...,
  cache_implementation="static")``;
* Lightning's ``Trainer`` fitting a ``torch.compile``d ``LightningModule``
  for six steps on CPU (skipped where ``lightning`` is not installed);
* ``torchrun --nproc-per-node 2`` (gloo, CPU), each rank compiling.

Three runs each: host a cold (fills its store), host a again with an empty
Inductor cache directory, ``TMPDIR`` and ``HOME`` (only the store can serve
it), and host f: this interpreter and venv bind-mounted at another path in a
private mount namespace, another ``HOME``/``TMPDIR``, and an empty store
whose seed is host a's store.  The last two must run no C++ compiler in any
process (the program's, its compile workers', every rank's) and print what
the cold run printed; transformers' tokens must also equal eager
``generate``'s.  ``torchrun``'s ranks also start on a new host at another
path from a signed HTTP remote the first host pushed to, and with a store
root that is a file they still print the right output, one line each naming
why adstore is off.  Slow (minutes each: real compiles of real libraries)
and needs root (mount namespaces), as CI's slow tier runs.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_restart import http_remote  # noqa: E402
from programs import PROGRAMS, Run, available, run_program  # noqa: E402

pytest.importorskip("torch")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.geteuid() != 0, reason="a host at another path needs root (a mount namespace)"),
]


@pytest.fixture
def work() -> Iterator[Path]:
    # Not pytest's tmp_path: the moved interpreter's mount points are made under it, kept short and private.
    path = Path(tempfile.mkdtemp(prefix="adstore-programs-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _served(run: Run, what: str, cold: Run) -> None:
    assert run.compiler_runs == 0, f"{what} ran the compiler: {run.compiler_targets}\n{run.stderr[-4000:]}"
    assert run.output == cold.output, f"{what} printed another output"
    assert "Traceback" not in run.stderr, run.stderr[-4000:]


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_program_compiles_once_for_a_second_run_and_a_host_at_another_path(name: str, work: Path) -> None:
    program = PROGRAMS[name]
    if not available(program):
        pytest.skip(f"{program.needs} is not installed")
    store = work / "a" / "store"
    cold = run_program(program, work, "a", store=store)
    assert cold.compiler_runs > 0, "the cold run compiled nothing: the test would prove nothing"
    ranks = 2 if name == "torchrun" else 1
    # Every rank enabled itself (the program's compile workers, which compile kernels only, need not).
    assert cold.counters.get("autoenable.enabled") == ranks, cold.counters
    _check_output(name, cold.report)

    warm = run_program(program, work, "a-again", store=store)
    _served(warm, "the second run", cold)
    assert warm.counters.get("autoenable.enabled") == 2 * ranks, warm.counters

    moved = run_program(program, work, "f", store=work / "f" / "store", seed=store, moved=True)
    _served(moved, "the host at another path", cold)
    assert moved.counters.get("seed.hits", 0) > 0, moved.counters


def _check_output(name: str, report: dict[str, Any]) -> None:
    """What the cold run computed is right: eager's tokens, every rank's output as its eager model's."""
    if name == "transformers":
        assert report["output"] == report["eager"], report
    elif name == "torchrun":
        assert [r["rank"] for r in report["output"]] == [0, 1] and all(r["right"] for r in report["output"]), report


def test_torchrun_ranks_run_when_the_store_cannot_be_opened(work: Path) -> None:
    """Fail open in every rank: a store root that is a file is one line per rank, and the program's output."""
    root = work / "not-a-store"
    root.write_text("a file, not a store")
    run = run_program(PROGRAMS["torchrun"], work, "a", store=root)
    _check_output("torchrun", run.report)
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    assert run.stderr.count("compiles without adstore here (no_store)") == 2, run.stderr[-4000:]  # once a rank
    assert root.read_text() == "a file, not a store"


def test_torchrun_ranks_on_a_new_host_fed_by_the_remote_compile_nothing(work: Path) -> None:
    """The fleet's way: host a pushes to a signed WebDAV remote on 127.0.0.1; a new host at another path pulls.

    Both ranks of the new host miss the same keys together and restore them
    from the remote into one store at once: each is a hit (no ``store_error``).
    """
    (work / "remote").mkdir()
    server, remote = http_remote(work / "remote")
    try:
        program = PROGRAMS["torchrun"]
        cold = run_program(program, work, "a", store=work / "a" / "store", remote=remote["writer"])
        assert cold.compiler_runs > 0 and cold.counters.get("remote.records_up", 0) > 0, cold.counters
        new = run_program(program, work, "n", store=work / "n" / "store", moved=True, remote=remote["reader"])
        _served(new, "the new host", cold)
        assert new.counters.get("remote.hits", 0) > 0, new.counters
        assert not any(".store_error" in name for name in new.counters), new.counters
    finally:
        server.stop()
