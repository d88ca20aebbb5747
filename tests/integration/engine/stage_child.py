"""One restart of the reference pipeline in a fresh process: ``python stage_child.py JOB_JSON``.

The job names the model, checkpoint, store root and the ``compile`` stage's
options; the child runs the pipeline, calls the module once and prints one
JSON line: the cache events, the output (hex of its bytes), and whether
dynamo, Inductor or transformers were imported and how many frames Dynamo traced.  The compile-stage tests run
it cold and warm (:func:`run_child`), the way a user restarts a job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["MODEL", "kinds", "main", "run_child"]

#: The model of the compile-stage restart tests.
MODEL = {"arch": "llama", "layers": 1, "hidden": 64}


#: Libraries a warm restart has no use for: what would export, hash or compile a graph ...
HEAVY = ("torch._dynamo", "torch._inductor", "transformers")
#: ... and the store's parts it never calls without a remote: the remote tier and the maintenance passes.
UNUSED = (
    "adstore.store.tiered",
    "adstore.store.remote.client",
    "adstore.store.remote.httpcache",
    "adstore.store.maintenance.eviction",
    "adstore.store.maintenance.verify",
    "adstore.store.records.rebuild",
)


def run_child(
    job: dict[str, Any], env: dict[str, str] | None = None, *, python: str = sys.executable, prefix: list[str] = ()
) -> dict[str, Any]:
    """Run this script on ``job`` in a fresh interpreter (``env`` added to this one's); its report.

    ``python`` and ``prefix`` (a command the interpreter runs under): another interpreter, or this one elsewhere.
    """
    proc = subprocess.run(
        [*prefix, python, str(Path(__file__)), json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kinds(report: dict[str, Any]) -> list[tuple[str, str | None]]:
    return [(e["kind"], e["reason"]) for e in report["events"]]


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    import torch

    from adstore.integration.pipeline.optimizer import InferenceOptimizer
    from adstore.integration.reference.models import ModelFactory
    from adstore.integration.reference.pipeline import default_transforms

    factory = ModelFactory.from_config(job["model"])
    transforms = default_transforms(
        pipeline_cache={"root": job["root"], **job.get("cache", {})}, compile=job.get("compile", {"backend": "aoti"})
    )
    opt = InferenceOptimizer(factory, job["checkpoint"], transforms)
    module = opt()
    for _ in range(job.get("runs", 1) - 1):  # "runs": 2 compiles twice in this process (the entry forgotten between)
        from adstore.integration.reference.demo import forget
        from adstore.store import Store

        with Store.open(job["root"]) as store:
            forget(store, opt.events[0].key)
        opt = InferenceOptimizer(factory, job["checkpoint"], transforms)
        module = opt()
    with torch.no_grad():
        out = module(*factory.example_inputs(batch=2, seq=8))
    report = {
        "events": [e.to_dict() for e in opt.events],
        "module": type(module).__name__,
        "output": out.detach().contiguous().numpy().tobytes().hex(),
        "imported": {name: name in sys.modules for name in (*HEAVY, *UNUSED)},
        "dynamo_frames": _dynamo_frames(),
    }
    print(json.dumps(report), flush=True)
    return 0


def _dynamo_frames() -> int:
    """Frames Dynamo traced in this process (0 when it was never imported)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(sum(counters["frames"].values()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
