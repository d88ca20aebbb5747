"""A fleet is not a set of twins: hosts that differ from the builder by one real thing start from its compile.

Each test starts a user's own model (``fleet_run.py``: two MLP-Mixer blocks
under plain ``torch.compile``) on a host simulated for real by
``tests/benchmarks/fleet_hosts.py`` (a mount namespace with another
``/proc/cpuinfo``, uid 1001 with umask 002, a read-only bind mount of the
builder's store, the interpreter and venv bind-mounted at another path) and counts the
compiler runs of that process (``g++ ... -o``, ``TORCHINDUCTOR_COMPILE_THREADS=1``).
The builder compiled cold once and pushed to a signed WebDAV remote on
127.0.0.1.  Slow: each host is a fresh torch process; needs root, as CI runs.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_restart import http_remote  # noqa: E402
from fleet_hosts import Fleet  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="simulated hosts need root (mount namespaces, other uids)"),
]


@pytest.fixture(scope="module")
def fleet() -> Any:
    # Not under pytest's own temporary directory: pytest keeps it private (0700), and uid 1001 must reach its host.
    work = Path(tempfile.mkdtemp(prefix="adstore-fleet-"))
    work.chmod(0o755)
    server, remote = http_remote(work)
    try:
        hosts = Fleet(work / "hosts", remote)
        cold = hosts.run(hosts.host("builder"))
        assert cold["compiler_runs"] > 0, "the builder compiled nothing: the test would prove nothing"
        yield hosts, cold
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _start(fleet: Any, kind: str) -> dict[str, Any]:
    hosts, cold = fleet
    run = hosts.run(hosts.host(kind))
    assert run["sha"] == cold["sha"], f"{kind}: output differs from the builder's"
    assert run["enabled"], f"{kind}: enable() failed: {run['stderr']}"
    return run


@pytest.mark.parametrize("kind", ["twin", "cpu_flags", "other_user", "read_only", "install_path"])
def test_host_runs_no_compiler(fleet: Any, kind: str) -> None:
    run = _start(fleet, kind)
    assert run["compiler_runs"] == 0, (
        f"{kind}: {run['compiler_runs']} compiler runs {run['compiler_targets']}; "
        f"fail-open {run.get('failopen')}; warnings {run.get('warnings')}"
    )
