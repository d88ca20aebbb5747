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

* the pipeline with its compile stage (``--backends``, default ``aoti`` and
  ``torch_compile``), per model: ``cold`` (empty store and an empty
  Inductor cache directory; the first cold run also pushes to an HTTP
  remote, WebDAV on 127.0.0.1), ``warm`` (the same store and directory
  again), and ``new host`` (an empty store and Inductor directory, every
  entry pulled from the remote); outputs compared bit for bit across them
  and against the eager backend.

Targets: a warm pipeline restart within floor + 0.5 s, and at least 4x less
time above the floor than the cold run; with ``aoti``, a warm restart within
floor + 0.5 s and at least 10x less time above the floor than cold, a new
host within floor + 1.0 s, outputs bit-identical and within 1e-4 of eager;
with ``torch_compile``, a new host within 1.3x the local warm restart.

``torch_compile`` is also measured against the floor + the import of Dynamo
and Inductor (``import torch._dynamo, torch._inductor.compile_fx``, timed
alone in fresh processes): its target is a warm restart within that + 1.0 s.

    python tests/benchmarks/bench_restart.py [--repeat 3] [--quick] [--backends aoti,torch_compile]
                                             [--skip pipeline,engine] [--models llama-4x256]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_results import write_results

#: (name, layers, hidden) of the pipeline models measured.
MODELS = (("llama-4x256", 4, 256), ("llama-24x128", 24, 128))


def child_pipeline(args: argparse.Namespace) -> None:
    import torch

    from adstore.integration.pipeline.optimizer import InferenceOptimizer
    from adstore.integration.reference.models import ModelFactory
    from adstore.integration.reference.pipeline import default_transforms

    factory = ModelFactory.from_config({"arch": "llama", "layers": args.layers, "hidden": args.hidden})
    transforms = default_transforms(pipeline_cache={"root": args.root}, compile={"backend": args.compile})
    opt = InferenceOptimizer(factory, args.checkpoint, transforms)
    module = opt()
    with torch.no_grad():
        out = module(*factory.example_inputs(batch=2, seq=8))
    data = out.detach().contiguous().numpy().tobytes()
    first = {
        "event": opt.events[0].kind,
        "sum": float(out.double().sum()),
        "sha": hashlib.sha256(data).hexdigest(),
        "events": [[str(e.kind), e.reason and str(e.reason), str(e.source), e.detail] for e in opt.events],
    }
    print("FIRST " + json.dumps(first), flush=True)
    if args.out:
        Path(args.out).write_bytes(data)
    modules = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torch"))
    print(
        json.dumps(
            {
                "transformers": "transformers" in sys.modules,
                "dynamo": "torch._dynamo" in sys.modules,
                "inductor": "torch._inductor" in sys.modules,
                "modules": len(modules),
            }
        ),
        flush=True,
    )


def _mlp() -> Any:
    import torch

    torch.manual_seed(5)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 10)
    ).eval()


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


def started(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 900
) -> tuple[float, dict[str, Any] | None, int, str]:
    """Run ``argv``: seconds from its start to its ``FIRST`` line, that line with the JSON lines after it
    merged in (None if it printed none), its exit code and the end of its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    first: dict[str, Any] | None = None
    seconds = 0.0
    for line in proc.stdout:
        if line.startswith("FIRST"):
            seconds = time.perf_counter() - t0
            first = json.loads(line[len("FIRST") :])
        elif first is not None and line.startswith("{"):
            first.update(json.loads(line))
    err = proc.stderr.read() if proc.stderr else ""
    return seconds, first, proc.wait(timeout=timeout), err[-4000:]


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, dict[str, Any]]:
    """Seconds from starting ``argv`` (in ``env``, else this environment) to its ``FIRST`` line, and that line."""
    seconds, first, code, err = started(argv, env)
    if code != 0 or first is None:
        raise SystemExit(f"child {argv[3:]} failed ({code}):\n{err[-3000:]}")
    return seconds, first


def me(*args: str) -> list[str]:
    return [sys.executable, __file__, *args]


def _floats(path: Path) -> Any:
    import numpy as np

    return np.frombuffer(path.read_bytes(), dtype=np.float32)


def compile_stage(
    backend: str,
    name: str,
    layers: int,
    hidden: int,
    ckpt: Path,
    work: Path,
    floor: float,
    repeat: int,
    remote: dict[str, dict[str, str]],
    eager_out: Path,
) -> dict[str, Any]:
    """Restarts with the compile stage on ``backend``: cold, warm, and a new host served by the remote.

    cold: empty store and empty Inductor cache directory (the first cold run also pushes to the remote);
    warm: the same store and Inductor directory again; new host: an empty store and an empty Inductor
    directory whose entries come from the HTTP remote.
    """
    base = me(
        "--child",
        "pipeline",
        "--checkpoint",
        str(ckpt),
        "--layers",
        str(layers),
        "--hidden",
        str(hidden),
        "--compile",
        backend,
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ADSTORE_", "TORCHINDUCTOR_"))}
    tag = f"{name}-{backend}"

    def run(i: int, kind: str, root: Path, inductor: Path, extra: dict[str, str]) -> tuple[float, dict[str, Any]]:
        out = work / f"{tag}-{kind}-{i}.bin"
        s, first = timed(
            [*base, "--root", str(root), "--out", str(out)],
            {**clean, "TORCHINDUCTOR_CACHE_DIR": str(inductor), **extra},
        )
        first["out"] = str(out)
        return s, first

    colds, warms, hosts = [], [], []
    for i in range(repeat):
        root, inductor = work / f"store-{tag}-{i}", work / f"inductor-{tag}-{i}"
        colds.append(run(i, "cold", root, inductor, remote["writer"] if i == 0 else {}))
        warms.append(run(i, "warm", root, inductor, {}))
    for i in range(repeat):
        hosts.append(run(i, "host", work / f"host-{tag}-{i}", work / f"host-inductor-{tag}-{i}", remote["reader"]))
    cold, warm, host = (statistics.median(s for s, _ in runs) for runs in (colds, warms, hosts))
    shas = {f["sha"] for _, f in colds + warms + hosts}
    diff = float(abs(_floats(Path(colds[0][1]["out"])) - _floats(eager_out)).max())
    result = {
        "backend": backend,
        "layers": layers,
        "hidden": hidden,
        "floor_s": floor,
        "cold_s": cold,
        "warm_s": warm,
        "new_host_s": host,
        "cold_runs": [s for s, _ in colds],
        "warm_runs": [s for s, _ in warms],
        "new_host_runs": [s for s, _ in hosts],
        "warm_above_floor_s": warm - floor,
        "new_host_above_floor_s": host - floor,
        "above_floor_ratio": (cold - floor) / (warm - floor) if warm > floor else None,
        "new_host_over_warm": host / warm,
        "events": {"cold": colds[0][1]["events"], "warm": warms[0][1]["events"], "new_host": hosts[0][1]["events"]},
        "warm_imports": {k: warms[0][1][k] for k in ("transformers", "dynamo", "inductor")},
        "outputs_bit_identical": len(shas) == 1,
        "max_abs_diff_vs_eager": diff,
    }
    print(
        f"{tag}: cold {cold:.3f} s, warm {warm:.3f} s (floor + {warm - floor:.3f} s, "
        f"{(cold - floor) / max(warm - floor, 1e-9):.1f}x less above the floor), new host {host:.3f} s "
        f"(floor + {host - floor:.3f} s, {host / warm:.2f}x warm); outputs identical {len(shas) == 1}, "
        f"vs eager {diff:.2e}; warm imports {result['warm_imports']}"
    )
    return result


def http_remote(work: Path) -> tuple[Any, dict[str, dict[str, str]]]:
    """A WebDAV server on 127.0.0.1 (the Bazel HTTP cache protocol) and the writer's and readers' environments."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store" / "remote"))
    from remote_servers import start_webdav

    from adstore.store.remote import write_keypair

    server = start_webdav(work)
    private, public = write_keypair(work / "keys")
    url = f"{server.endpoint}/restart-{os.getpid()}"
    return server, {
        "writer": {"ADSTORE_REMOTE": url, "ADSTORE_REMOTE_MODE": "read-write", "ADSTORE_SIGNING_KEY": str(private)},
        "reader": {"ADSTORE_REMOTE": url, "ADSTORE_TRUSTED_KEYS": str(public)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each warm figure (median reported)")
    ap.add_argument("--quick", action="store_true", help="the 4-layer model only, two repeats, no engine")
    ap.add_argument("--child", choices=("pipeline", "engine"), help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--compile", default="eager", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument(
        "--backends",
        default="aoti,torch_compile",
        help="compile-stage backends to measure (comma-separated; '' for none; --quick: aoti)",
    )
    ap.add_argument("--skip", default="", help="sections not to measure this time: pipeline,engine")
    ap.add_argument("--models", default="", help="models to measure (comma-separated names; default: all)")
    args = ap.parse_args()
    if args.child == "pipeline":
        child_pipeline(args)
        return 0
    if args.child == "engine":
        child_engine(args)
        return 0

    repeat = min(2, args.repeat) if args.quick else args.repeat
    models = MODELS[:1] if args.quick else MODELS
    if args.models:
        models = tuple(m for m in MODELS if m[0] in args.models.split(","))
    from adstore.integration.reference.checkpoint import write_random_checkpoint
    from adstore.integration.reference.models import ModelFactory

    work = Path(tempfile.mkdtemp(prefix="adstore-bench-restart-"))
    floor_argv = [sys.executable, "-c", "import torch; print('FIRST {}', flush=True)"]
    floors = [timed(floor_argv)[0] for _ in range(repeat)]
    floor = statistics.median(floors)
    print(f"floor (python -c 'import torch'): {floor:.3f} s  {[round(f, 3) for f in floors]}")
    results: dict[str, Any] = {"floor_s": floor, "floor_runs": floors}
    if "torch_compile" in args.backends.split(","):
        import_argv = [
            sys.executable,
            "-c",
            "import torch, torch._dynamo, torch._inductor.compile_fx; print('FIRST {}', flush=True)",
        ]
        imports = [timed(import_argv)[0] for _ in range(repeat)]
        results["dynamo_inductor_import_s"] = statistics.median(imports) - floor
        results["dynamo_inductor_import_runs"] = imports
        runs = [round(f, 3) for f in imports]
        print(f"floor + import of Dynamo and Inductor: {statistics.median(imports):.3f} s  {runs}")
    skip = {x for x in args.skip.split(",") if x}
    for name, layers, hidden in models:
        factory = ModelFactory.from_config({"arch": "llama", "layers": layers, "hidden": hidden})
        write_random_checkpoint(factory.build(), work / f"ckpt-{name}", seed=0)

    for name, layers, hidden in models if "pipeline" not in skip else ():
        results.setdefault("models", {})
        ckpt = work / f"ckpt-{name}"
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
            "layers": layers,
            "hidden": hidden,
            "cold_s": cold,
            "warm_s": warm,
            "cold_runs": colds,
            "warm_runs": warms,
            "events": events,
            "outputs_equal": len(sums) == 1,
            "warm_imports": info,
            "warm_above_floor_s": warm - floor,
            "cold_above_floor_s": cold - floor,
            "above_floor_ratio": (cold - floor) / (warm - floor) if warm > floor else None,
            "speedup": cold / warm,
        }
        print(
            f"{name}: cold {cold:.3f} s, warm {warm:.3f} s (floor + {warm - floor:.3f} s), "
            f"{(cold - floor) / max(warm - floor, 1e-9):.1f}x less time above the floor; warm imports {info}; "
            f"events {events[0]}; outputs equal {len(sums) == 1}"
        )

    backends = [b for b in args.backends.split(",") if b] if not args.quick else ["aoti"]
    if backends:
        server, remote = http_remote(work)
        results["compile"] = {}
        try:
            for name, layers, hidden in models:
                ckpt = work / f"ckpt-{name}"
                eager_out = work / f"{name}-eager.bin"
                timed(
                    me(
                        "--child",
                        "pipeline",
                        "--checkpoint",
                        str(ckpt),
                        "--layers",
                        str(layers),
                        "--hidden",
                        str(hidden),
                        "--root",
                        str(work / f"store-{name}-eager"),
                        "--out",
                        str(eager_out),
                    )
                )
                for backend in backends:
                    figures = compile_stage(backend, name, layers, hidden, ckpt, work, floor, repeat, remote, eager_out)
                    if backend == "torch_compile":
                        above = figures["warm_s"] - floor - results["dynamo_inductor_import_s"]
                        figures["warm_above_floor_and_imports_s"] = above
                        print(f"{name}-torch_compile: warm = floor + Dynamo/Inductor import + {above:.3f} s")
                    results["compile"][f"{name}/{backend}"] = figures
        finally:
            server.stop()

    if not args.quick and "engine" not in skip:
        root = str(work / "store-engine")
        cold_s, c = timed(me("--child", "engine", "--root", root))
        warm_runs = [timed(me("--child", "engine", "--root", root)) for _ in range(repeat)]
        warm_s = statistics.median(s for s, _ in warm_runs)
        results["engine"] = {
            "cold_s": cold_s,
            "warm_s": warm_s,
            "warm_runs": [s for s, _ in warm_runs],
            "events": [c["event"]] + [w["event"] for _, w in warm_runs],
            "outputs_equal": len({c["sum"], *(w["sum"] for _, w in warm_runs)}) == 1,
            "warm_above_floor_s": warm_s - floor,
            "speedup": cold_s / warm_s,
        }
        print(f"engine: cold {cold_s:.3f} s, warm {warm_s:.3f} s (floor + {warm_s - floor:.3f} s)")

    out = write_results("restart.json", results, partial=bool(skip) or not backends or bool(args.models))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
