"""A simulated host of the single-flight tests: one process, its own store and directories, its own host name.

Run as ``python flight_hosts.py SPEC`` (JSON): it imports torch, waits for
the ``go`` file (so hosts started together compile together), compiles the
small model of :func:`inductor_hosts.compile_host` (or ``model`` of
:func:`model_host`), and writes the result as JSON to ``out``.  The host name
(``socket.gethostname``) is the spec's ``host``, so a lease's holder on
another simulated host cannot be checked and counts until it expires, as
on a real fleet.  When the process takes a build lease it writes
``<marks>/<host>.<pid>.leader`` first, for a test that kills builders.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "integration" / "inductor"))

__all__ = ["main", "model_host"]


def _mark_leaders(marks: Path, host: str) -> None:
    """Write a file each time this process leads a flight (the test's view of who builds)."""
    from adstore.store.remote import SingleFlight

    start = SingleFlight._start

    def marked(self: Any, flight: Any, heartbeat: Any, stale: bool = False) -> Any:
        if flight.leader:
            (marks / f"{host}.{os.getpid()}.leader").write_text(flight.key)
        return start(self, flight, heartbeat, stale)

    SingleFlight._start = marked  # type: ignore[method-assign]


def model_host(env: dict[str, str], version: int) -> dict[str, Any]:
    """``torch.compile`` model ``version`` (its layer widths differ, so its graphs and kernels do)."""
    import hashlib

    from inductor_hosts import count_builds

    os.environ.update(env)
    import torch

    from adstore.integration import inductor

    builds = count_builds()
    enabled = inductor.enable()
    torch.manual_seed(version)
    width = 16 + 8 * version
    m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 8)).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        out = torch.compile(m)(x)
    from torch._dynamo.utils import counters as dynamo_counters

    counters: dict[str, int] = {}
    entries = inductor.active()
    if entries is not None:
        entries.store.flush()
        counters = {k: v for k, v in entries.store.stats().counters.items() if k.startswith(("inductor.", "remote."))}
    inductor.disable()
    return {
        "enabled": enabled,
        "output": hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest(),
        "builds": [b for b in builds if not b.endswith(".i")],
        "inductor": dict(dynamo_counters["inductor"]),
        "store": counters,
    }


def main(spec: dict[str, Any]) -> None:
    host = str(spec["host"])
    socket.gethostname = lambda: host  # type: ignore[assignment]
    os.environ.update(spec["env"])
    import tempfile

    tempfile.tempdir = None
    import torch  # noqa: F401 - loaded before the start line: hosts start compiling together

    _mark_leaders(Path(spec["marks"]), host)
    go = Path(spec["go"])
    deadline = time.monotonic() + 300
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    if spec.get("version") is None:
        from inductor_hosts import compile_host

        result = compile_host(spec["env"])
    else:
        result = model_host(spec["env"], int(spec["version"]))
    result["wall"] = time.monotonic() - started
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
