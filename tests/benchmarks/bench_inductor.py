"""Plain ``torch.compile`` restarts with Inductor's caches in adstore: fresh processes, start to first output.

Each figure is the wall time from ``Popen`` to the first line the child
prints, right after its first compiled output exists (as in
``bench_restart``).  Measured in one run, in fresh processes:

* ``floor``: ``import torch`` and print — nothing adstore can remove;
* ``imports``: ``import torch, torch._dynamo, torch._inductor.compile_fx`` —
  the floor of any ``torch.compile`` restart, reported as its cost above the
  floor;
* for a small conv + attention block built here (not the reference
  pipeline) and the reference Llama (4 layers, hidden 256, random weights,
  ``model(ids, use_cache=False).logits``):

  - ``eager``: the same child without ``torch.compile`` (import torch and
    the model's libraries, build, one forward);
  - ``compiled floor`` = eager + the Dynamo/Inductor import above: what a
    compiled start cannot go below without skipping Dynamo (issue 37);

  then, each under plain ``torch.compile(model)``, five runs on simulated hosts
  (``tests/integration/inductor/inductor_hosts.py``: a store root, an Inductor
  cache directory and a ``TMPDIR`` of their own):

  - ``cold``: everything empty, ``adstore.integration.inductor.enable()``,
    pushing to an HTTP remote (WebDAV on 127.0.0.1, the Bazel HTTP cache
    protocol) with a signing key;
  - ``warm, adstore``: the cold host again with ``enable()`` (a local hit);
  - ``local warm``: the cold host again, adstore off (Inductor's own
    directories are warm);
  - ``new host, no adstore``: empty Inductor directory and ``TMPDIR``;
  - ``new host, adstore``: empty store, Inductor directory and ``TMPDIR``,
    entries from the HTTP remote (trusting the writer's key).

Kernels compiled: every ``CppBuilder.build`` of the child is counted
(``inductor_hosts.count_builds``), so every host runs with
``TORCHINDUCTOR_COMPILE_THREADS=1`` (builds in compile workers would not be
seen; the cold and no-adstore runs therefore compile serially).  A build is a
``kernel`` (a ``.so`` from Inductor's code cache), a ``probe`` (the ``.so``
of an ISA check: its ``.cpp`` is ``VecISA``'s ``__avx_chk_kernel``), the
``header`` (the precompiled header, ``.gch``), ``preprocess`` (the header's
``g++ -E``, ``.i``: Inductor runs it in every process that loads a kernel;
with adstore only in one that builds one).  Outputs are compared bit
for bit with the cold run.

Targets (issue 30): a new host with adstore ≤ 1.2× the local warm time above
the floor; no kernel compiled on it; outputs bit-identical.  Issue 37: warm
with adstore ≤ compiled floor + 0.7 s; a new host ≤ warm with adstore + 0.5 s.

    python tests/benchmarks/bench_inductor.py [--repeat 3] [--quick] [--only llama-4x256]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HOSTS = HERE.parent / "integration" / "inductor"  # inductor_hosts.py

#: name -> reference-model config (None: the conv + attention block built here).
MODELS: dict[str, dict[str, Any] | None] = {
    "conv-attention": None,
    "llama-4x256": {"arch": "llama", "layers": 4, "hidden": 256},
}
#: (key, label, adstore on in the child) of the four runs, in the order they run.
RUNS = (
    ("cold", "cold (adstore, pushes)", True),
    ("warm_adstore", "warm, adstore (local hit)", True),
    ("local_warm", "local warm (adstore off)", False),
    ("new_host_plain", "new host, no adstore", False),
    ("new_host_adstore", "new host, adstore", True),
)
TARGET_RATIO = 1.2
#: Issue 37: warm with adstore at most this far above the compiled floor; a new host this far above that warm.
WARM_OVER_COMPILED_FLOOR = 0.7
NEW_HOST_OVER_WARM = 0.5


# --------------------------------------------------------------------------- the child (timed)


def conv_attention() -> tuple[Any, tuple[Any, ...]]:
    """A small conv + self-attention block (channels 32, 4 heads) on a 2x3x16x16 input, seeded weights."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, channels: int = 32, heads: int = 4) -> None:
            super().__init__()
            self.heads = heads
            self.conv = nn.Conv2d(3, channels, 3, padding=1)
            self.norm = nn.GroupNorm(4, channels)
            self.qkv = nn.Linear(channels, 3 * channels)
            self.proj = nn.Linear(channels, channels)
            self.mlp = nn.Sequential(
                nn.LayerNorm(channels), nn.Linear(channels, 4 * channels), nn.GELU(), nn.Linear(4 * channels, channels)
            )
            self.head = nn.Linear(channels, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.gelu(self.norm(self.conv(x)))
            t = h.flatten(2).transpose(1, 2)  # (batch, tokens, channels)
            b, n, c = t.shape
            q, k, v = self.qkv(t).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v)
            t = t + self.proj(a.transpose(1, 2).reshape(b, n, c))
            t = t + self.mlp(t)
            return self.head(t.mean(1))

    torch.manual_seed(0)
    model = Block().eval()
    return model, (torch.randn(2, 3, 16, 16),)


def classify(builds: list[str]) -> dict[str, int]:
    """Counts of the C++ builds by kind (see the module's docstring); ``.i`` preprocessing is left out."""
    kinds = {"kernel": 0, "probe": 0, "header": 0, "preprocess": 0}
    for target in builds:
        if target.endswith(".i"):
            kinds["preprocess"] += 1
            continue
        if target.endswith(".gch") or "precompiled_headers" in target:
            kinds["header"] += 1
            continue
        source = Path(target).with_suffix(".cpp")
        try:
            probe = "__avx_chk_kernel" in source.read_text(errors="replace")
        except OSError:
            probe = False
        kinds["probe" if probe else "kernel"] += 1
    return kinds


def child(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    import torch

    sys.path.insert(0, str(HOSTS))
    from inductor_hosts import count_builds

    builds = [] if args.eager else count_builds()  # imports torch._inductor.cpp_builder (and Dynamo)
    t_imports = time.perf_counter()
    enabled = None
    if args.adstore:
        from adstore.integration import inductor

        enabled = inductor.enable()
    t_enable = time.perf_counter()
    config = MODELS[args.model]
    if config is None:
        model, inputs = conv_attention()
    else:
        from adstore.integration.reference.checkpoint import read_checkpoint
        from adstore.integration.reference.models import ModelFactory

        factory = ModelFactory.from_config(config)
        model = factory.eager_model(read_checkpoint(args.checkpoint))
        inputs = factory.example_inputs(batch=2, seq=8)
    t_model = time.perf_counter()
    if args.eager:  # the floor of this model: no Dynamo, no Inductor
        with torch.no_grad():
            out = model(*inputs) if config is None else model(*inputs, use_cache=False).logits
        data = out.detach().contiguous().numpy().tobytes()
        print("FIRST " + json.dumps({"sha": hashlib.sha256(data).hexdigest()}), flush=True)
        return
    compiled = torch.compile(model)
    with torch.no_grad():
        out = compiled(*inputs) if config is None else compiled(*inputs, use_cache=False).logits
    data = out.detach().contiguous().numpy().tobytes()
    t_first = time.perf_counter()
    print("FIRST " + json.dumps({"sha": hashlib.sha256(data).hexdigest()}), flush=True)

    from torch._dynamo.utils import counters

    info: dict[str, Any] = {
        "enabled": enabled,
        "builds": classify(builds),
        "build_targets": [b for b in builds if not b.endswith(".i")],
        "phases": {
            "imports": t_imports - t0,
            "enable": t_enable - t_imports,
            "model": t_model - t_enable,
            "compile_and_call": t_first - t_model,
        },
        "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
        "aot_autograd": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    }
    if args.adstore:
        from adstore.integration import inductor

        info["failopen"] = dict(inductor.FAILOPEN)
        entries = inductor.active()
        if entries is not None:
            entries.store.flush()
            info["store"] = {
                k: v for k, v in entries.store.stats().counters.items() if k.startswith(("inductor.", "remote."))
            }
    print(json.dumps(info), flush=True)  # the store closes (and the pushes finish) at exit, as in a user's process


# --------------------------------------------------------------------------- the parent


def me(*args: str) -> list[str]:
    return [sys.executable, __file__, *args]


def measure_model(
    name: str,
    checkpoint: Path | None,
    work: Path,
    floor: float,
    dynamo_import: float,
    repeat: int,
    remote: dict[str, dict[str, str]],
    clean: dict[str, str],
) -> dict[str, Any]:
    """Eager, then the five runs of ``name``, ``repeat`` times (each on its own hosts and remote prefix); medians.

    ``dynamo_import``: the Dynamo/Inductor import's cost above the floor (the compiled floor's second part).
    """
    from bench_restart import timed
    from inductor_hosts import host_env

    base = me("--child", "--model", name, *(["--checkpoint", str(checkpoint)] if checkpoint else []))
    eager = [timed([*base, "--eager"], clean)[0] for _ in range(max(repeat, 3))]
    compiled_floor = statistics.median(eager) + dynamo_import
    print(
        f"  {name} eager: {statistics.median(eager):.2f} s {[round(e, 2) for e in eager]}; "
        f"compiled floor (eager + Dynamo/Inductor import): {compiled_floor:.2f} s",
        flush=True,
    )
    runs: dict[str, list[tuple[float, dict[str, Any]]]] = {key: [] for key, _, _ in RUNS}
    for i in range(repeat):
        prefix = f"{remote['writer']['ADSTORE_REMOTE']}/{name}-{i}"  # each cold run pushes to an empty prefix
        writer = {**remote["writer"], "ADSTORE_REMOTE": prefix}
        reader = {**remote["reader"], "ADSTORE_REMOTE": prefix}
        hosts = {
            "cold": host_env(work, f"{name}-{i}-a", **writer),
            "warm_adstore": host_env(work, f"{name}-{i}-a", **writer),  # the remote is configured; a local hit
            "local_warm": host_env(work, f"{name}-{i}-a"),
            "new_host_plain": host_env(work, f"{name}-{i}-b"),
            "new_host_adstore": host_env(work, f"{name}-{i}-c", **reader),
        }
        for key, label, adstore in RUNS:
            argv = [*base, *(["--adstore"] if adstore else [])]
            seconds, first = timed(argv, {**clean, **hosts[key]})
            runs[key].append((seconds, first))
            print(
                f"  {name} #{i} {label}: {seconds:.2f} s, builds {first['builds']}, phases {_phases(first['phases'])}",
                flush=True,
            )
        for host in ("a", "b", "c"):  # headers are ~150 MB a host
            shutil.rmtree(work / f"{name}-{i}-{host}", ignore_errors=True)

    reference = runs["cold"][0][1]["sha"]
    result: dict[str, Any] = {
        "config": MODELS[name] or "conv + attention block (bench_inductor.conv_attention)",
        "eager_s": statistics.median(eager),
        "eager_runs": eager,
        "compiled_floor_s": compiled_floor,
    }
    for key, _, _ in RUNS:
        secs = [s for s, _ in runs[key]]
        med = statistics.median(secs)
        firsts = [f for _, f in runs[key]]
        result[key] = {
            "seconds": med,
            "above_floor_s": med - floor,
            "above_compiled_floor_s": med - compiled_floor,
            "runs": secs,
            "kernels_compiled": max(f["builds"]["kernel"] for f in firsts),
            "builds": firsts[0]["builds"],
            "build_targets": firsts[0]["build_targets"],
            "phases": {p: statistics.median(f["phases"][p] for f in firsts) for p in firsts[0]["phases"]},
            "outputs_bit_identical": all(f["sha"] == reference for f in firsts),
            "inductor_counters": firsts[0]["inductor"],
            "aot_autograd_counters": firsts[0]["aot_autograd"],
        }
        if firsts[0]["enabled"] is not None:  # adstore on: did enable() work, what the store counted
            result[key].update(
                enabled=all(f["enabled"] for f in firsts), failopen=firsts[0]["failopen"], store=firsts[0].get("store")
            )
    warm_above = result["local_warm"]["above_floor_s"]
    host_above = result["new_host_adstore"]["above_floor_s"]
    ratio = host_above / warm_above if warm_above > 0 else None
    warm = result["warm_adstore"]["seconds"]
    host_over_warm = result["new_host_adstore"]["seconds"] - warm
    result.update(
        {
            "warm_adstore_over_compiled_floor_s": warm - compiled_floor,
            "warm_adstore_over_compiled_floor_ratio": warm / compiled_floor,
            "meets_warm_within_0_7s": warm - compiled_floor <= WARM_OVER_COMPILED_FLOOR,
            "new_host_over_warm_adstore_s": host_over_warm,
            "new_host_over_compiled_floor_s": result["new_host_adstore"]["seconds"] - compiled_floor,
            "meets_new_host_within_0_5s_of_warm": host_over_warm <= NEW_HOST_OVER_WARM,
            "new_host_over_local_warm_above_floor": ratio,
            "meets_1_2x_local_warm": ratio is not None and ratio <= TARGET_RATIO,
            "new_host_kernels_compiled": result["new_host_adstore"]["kernels_compiled"],
            "meets_no_kernels_on_new_host": result["new_host_adstore"]["kernels_compiled"] == 0,
            "outputs_bit_identical": all(result[key]["outputs_bit_identical"] for key, _, _ in RUNS),
            "new_host_plain_over_adstore": result["new_host_plain"]["seconds"] / result["new_host_adstore"]["seconds"],
        }
    )
    return result


def _phases(p: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in p.items())


def print_table(name: str, r: dict[str, Any], floor: float, repeat: int) -> None:
    cf = r["compiled_floor_s"]
    print(
        f"\n{name} (plain torch.compile; median of {repeat}; floor {floor:.2f} s; eager {r['eager_s']:.2f} s; "
        f"compiled floor {cf:.2f} s)"
    )
    head = (
        f"  {'run':<26} {'seconds':>8} {'above floor':>12} {'vs compiled floor':>18} {'kernels':>8} "
        f"{'probes':>7} {'header':>7} {'g++ -E':>7} {'identical':>10}   "
        f"{'imports':>7} {'enable':>7} {'model':>6} {'compile+call':>12}"
    )
    print(head)
    for key, label, _ in RUNS:
        x = r[key]
        b, p = x["builds"], x["phases"]
        vs_cf = f"{x['above_compiled_floor_s']:+.2f} s {x['seconds'] / cf:.2f}x"
        print(
            f"  {label:<26} {x['seconds']:>8.2f} {x['above_floor_s']:>12.2f} {vs_cf:>18} {x['kernels_compiled']:>8} "
            f"{b['probe']:>7} {b['header']:>7} {b['preprocess']:>7} "
            f"{('yes' if x['outputs_bit_identical'] else 'NO'):>10}   "
            f"{p['imports']:>7.2f} {p['enable']:>7.2f} {p['model']:>6.2f} {p['compile_and_call']:>12.2f}"
        )
    print(
        f"  warm with adstore: compiled floor + {r['warm_adstore_over_compiled_floor_s']:.2f} s "
        f"(target <= + {WARM_OVER_COMPILED_FLOOR} s: {'met' if r['meets_warm_within_0_7s'] else 'NOT met'}); "
        f"new host: warm + {r['new_host_over_warm_adstore_s']:.2f} s (target <= + {NEW_HOST_OVER_WARM} s: "
        f"{'met' if r['meets_new_host_within_0_5s_of_warm'] else 'NOT met'})"
    )
    ratio = r["new_host_over_local_warm_above_floor"]
    print(
        f"  new host with adstore / local warm, above the floor: "
        f"{'n/a' if ratio is None else f'{ratio:.2f}x'} (target <= {TARGET_RATIO}x: "
        f"{'met' if r['meets_1_2x_local_warm'] else 'NOT met'})"
    )
    print(
        f"  kernels compiled on the new host with adstore: {r['new_host_kernels_compiled']} (target 0: "
        f"{'met' if r['meets_no_kernels_on_new_host'] else 'NOT met'}); without adstore: "
        f"{r['new_host_plain']['kernels_compiled']}; new host without / with adstore: "
        f"{r['new_host_plain_over_adstore']:.2f}x"
    )
    host = r["new_host_adstore"]
    print(
        f"  new host with adstore: enabled {host.get('enabled')}, store {host.get('store')}, "
        f"fail-open {host.get('failopen') or 'none'}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each figure (median reported)")
    ap.add_argument("--quick", action="store_true", help="the conv + attention block only, one repeat")
    ap.add_argument("--only", choices=sorted(MODELS), help="this model only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=sorted(MODELS), help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--adstore", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0

    from bench_restart import http_remote, timed
    from bench_results import write_results  # also: bytecode for adstore's sources, kept by the children

    sys.path.insert(0, str(HOSTS))
    repeat = 1 if args.quick else args.repeat
    models = [args.only] if args.only else list(MODELS)[:1] if args.quick else list(MODELS)
    # The children's environment: no store, remote or Inductor setting of this shell (each host sets its own).
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ADSTORE_", "TORCHINDUCTOR_"))}
    results: dict[str, Any] = {
        "repeat": repeat,
        "compile_threads": 1,
        "models": {},
        "load_average_start": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory(prefix="adstore-bench-inductor-", dir=os.environ.get("ADSTORE_BENCH_DIR")) as tmp:
        work = Path(tmp)
        floor_argv = [sys.executable, "-c", "import torch; print('FIRST {}', flush=True)"]
        imports_argv = [
            sys.executable,
            "-c",
            "import torch, torch._dynamo, torch._inductor.compile_fx; print('FIRST {}', flush=True)",
        ]
        timed(imports_argv, clean)  # not counted: the page cache gets torch's files once
        floors, imports = [], []
        for _ in range(max(repeat, 3)):
            floors.append(timed(floor_argv, clean)[0])
            imports.append(timed(imports_argv, clean)[0])
        floor, imported = statistics.median(floors), statistics.median(imports)
        results.update(
            {
                "floor_s": floor,
                "floor_runs": floors,
                "dynamo_inductor_import_s": imported,
                "dynamo_inductor_import_runs": imports,
                "dynamo_inductor_import_above_floor_s": imported - floor,
            }
        )
        print(
            f"floor (import torch): {floor:.2f} s {[round(f, 2) for f in floors]}; "
            f"+ torch._dynamo, torch._inductor.compile_fx: {imported:.2f} s "
            f"(Dynamo + Inductor import: floor + {imported - floor:.2f} s)",
            flush=True,
        )
        server, remote = http_remote(work)
        try:
            for name in models:
                checkpoint = None
                if MODELS[name] is not None:
                    from adstore.integration.reference.checkpoint import write_random_checkpoint
                    from adstore.integration.reference.models import ModelFactory

                    checkpoint = work / f"ckpt-{name}"
                    factory = ModelFactory.from_config(MODELS[name])
                    write_random_checkpoint(factory.build(), checkpoint, seed=0)
                print(f"{name}:", flush=True)
                results["models"][name] = measure_model(
                    name, checkpoint, work, floor, imported - floor, repeat, remote, clean
                )
        finally:
            server.stop()
    results["load_average_end"] = list(os.getloadavg())
    for name, r in results["models"].items():
        print_table(name, r, floor, repeat)
    print(f"\nload average: start {results['load_average_start']}, end {results['load_average_end']}")
    out = write_results("inductor.json", results, partial=args.only is not None)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
