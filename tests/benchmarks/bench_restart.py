"""Restart benchmark: a fresh process, from interpreter start to its first output.

What a user restarting a job feels is not the warm call in a warm process but
the whole new process: interpreter start, imports, cache key, restore, first
forward.  Each figure here is the wall time from ``Popen`` to the first line
the child prints, which it prints right after its first output exists (the
child's exit is not counted).  Measured, each in fresh processes, in one run:

* ``floor``: ``import torch`` and print — nothing adstore can remove;
* the reference pipeline (Llama, 4 layers hidden 256, and 24 layers hidden
  128): ``cold`` (empty store: miss, whole pipeline, save) and ``warm`` (the
  same job again: restore, resume after the cache point);
* the engine cache (an MLP compiled by AOTInductor): ``cold`` (empty store:
  compile and save) and ``warm`` (engine from the store, refit).

Targets (issue "restart"): a warm pipeline restart within floor + 0.5 s, and
at least 4x less time above the floor than the cold run.

    python tests/benchmarks/bench_restart.py [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_results import results_dir

#: (name, layers, hidden) of the pipeline models measured.
MODELS = (("llama-4x256", 4, 256), ("llama-24x128", 24, 128))


def child_pipeline(args: argparse.Namespace) -> None:
    import torch

    from adstore.integration.pipeline.optimizer import InferenceOptimizer
    from adstore.integration.reference.models import ModelFactory
    from adstore.integration.reference.pipeline import default_transforms

    factory = ModelFactory.from_config({"arch": "llama", "layers": args.layers, "hidden": args.hidden})
    opt = InferenceOptimizer(factory, args.checkpoint, default_transforms(pipeline_cache={"root": args.root}))
    module = opt()
    with torch.no_grad():
        out = module(*factory.example_inputs(batch=2, seq=8))
    first = {"event": opt.events[0].kind, "sum": float(out.double().sum())}
    print("FIRST " + json.dumps(first), flush=True)
    modules = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torch"))
    print(json.dumps({"transformers": "transformers" in sys.modules, "dynamo": "torch._dynamo" in sys.modules,
                      "modules": len(modules)}), flush=True)


def _mlp() -> Any:
    import torch

    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                               torch.nn.Linear(512, 10)).eval()


def child_engine(args: argparse.Namespace) -> None:
    import torch

    from adstore.integration.engine.cache import EngineCache
    from adstore.integration.engine.storage import StoreEngineStorage
    from adstore.store import Store

    model = _mlp()
    x = torch.randn(8, 256)
    with Store.open(args.root) as store:
        engine = EngineCache(StoreEngineStorage(store)).compile(model, (x,))
        with torch.no_grad():
            out = engine(x)
    print("FIRST " + json.dumps({"event": engine.event.kind, "sum": float(out.double().sum())}), flush=True)


def timed(argv: list[str]) -> tuple[float, dict[str, Any]]:
    """Seconds from starting ``argv`` to its ``FIRST`` line, and what that line says."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first: dict[str, Any] | None = None
    seconds = 0.0
    for line in proc.stdout:
        if line.startswith("FIRST"):
            seconds = time.perf_counter() - t0
            first = json.loads(line[len("FIRST"):])
        elif first is not None and line.startswith("{"):
            first.update(json.loads(line))
    err = proc.stderr.read() if proc.stderr else ""
    if proc.wait(timeout=900) != 0 or first is None:
        raise SystemExit(f"child {argv[3:]} failed ({proc.returncode}):\n{err[-3000:]}")
    return seconds, first


def me(*args: str) -> list[str]:
    return [sys.executable, __file__, *args]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each warm figure (median reported)")
    ap.add_argument("--quick", action="store_true", help="the 4-layer model only, two repeats, no engine")
    ap.add_argument("--child", choices=("pipeline", "engine"), help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "pipeline":
        child_pipeline(args)
        return 0
    if args.child == "engine":
        child_engine(args)
        return 0

    repeat = min(2, args.repeat) if args.quick else args.repeat
    models = MODELS[:1] if args.quick else MODELS
    from adstore.integration.reference.checkpoint import write_random_checkpoint
    from adstore.integration.reference.models import ModelFactory

    work = Path(tempfile.mkdtemp(prefix="adstore-bench-restart-"))
    floor_argv = [sys.executable, "-c", "import torch; print('FIRST {}', flush=True)"]
    floors = [timed(floor_argv)[0] for _ in range(repeat)]
    floor = statistics.median(floors)
    print(f"floor (python -c 'import torch'): {floor:.3f} s  {[round(f, 3) for f in floors]}")
    results: dict[str, Any] = {"floor_s": floor, "floor_runs": floors, "models": {}}

    for name, layers, hidden in models:
        factory = ModelFactory.from_config({"arch": "llama", "layers": layers, "hidden": hidden})
        ckpt = write_random_checkpoint(factory.build(), work / f"ckpt-{name}", seed=0)
        base = ["--child", "pipeline", "--checkpoint", str(ckpt), "--layers", str(layers), "--hidden", str(hidden)]
        colds, warms, sums, events, info = [], [], set(), [], {}
        for i in range(repeat):
            root = str(work / f"store-{name}-{i}")
            s, c = timed(me(*base, "--root", root))
            colds.append(s)
            s, w = timed(me(*base, "--root", root))
            warms.append(s)
            sums.update((c["sum"], w["sum"]))
            events.append((c["event"], w["event"]))
            info = {k: w[k] for k in ("transformers", "dynamo", "modules")}
        cold, warm = statistics.median(colds), statistics.median(warms)
        results["models"][name] = {
            "layers": layers, "hidden": hidden, "cold_s": cold, "warm_s": warm, "cold_runs": colds,
            "warm_runs": warms, "events": events, "outputs_equal": len(sums) == 1, "warm_imports": info,
            "warm_above_floor_s": warm - floor, "cold_above_floor_s": cold - floor,
            "above_floor_ratio": (cold - floor) / (warm - floor) if warm > floor else None,
            "speedup": cold / warm,
        }
        print(f"{name}: cold {cold:.3f} s, warm {warm:.3f} s (floor + {warm - floor:.3f} s), "
              f"{(cold - floor) / max(warm - floor, 1e-9):.1f}x less time above the floor; warm imports {info}; "
              f"events {events[0]}; outputs equal {len(sums) == 1}")

    if not args.quick:
        root = str(work / "store-engine")
        cold_s, c = timed(me("--child", "engine", "--root", root))
        warm_runs = [timed(me("--child", "engine", "--root", root)) for _ in range(repeat)]
        warm_s = statistics.median(s for s, _ in warm_runs)
        results["engine"] = {
            "cold_s": cold_s, "warm_s": warm_s, "warm_runs": [s for s, _ in warm_runs],
            "events": [c["event"]] + [w["event"] for _, w in warm_runs],
            "outputs_equal": len({c["sum"], *(w["sum"] for _, w in warm_runs)}) == 1,
            "warm_above_floor_s": warm_s - floor, "speedup": cold_s / warm_s,
        }
        print(f"engine: cold {cold_s:.3f} s, warm {warm_s:.3f} s (floor + {warm_s - floor:.3f} s)")

    out = results_dir() / "restart.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
