"""Engine cache benchmark: compile vs hit+refit, and engine bytes with vs without weights.

Run: ``python tests/benchmarks/bench_engine.py [--hidden 1024]``

All against one fresh store and a fresh inductor cache directory (so the first
compile is a cold AOTInductor compile, not a hit in inductor's own caches):

* baseline: ``compile()`` on an empty store (export + hash + AOTInductor compile
  + save + refit); again with inductor's caches warm (``ignore_engine_cache``);
  and a plain ``aoti_compile_and_package`` with its defaults (weights inside);
* hit from the store: a new EngineCache (empty in-process layer), another model
  of the same architecture: lookup + verified copy + load + refit;
* hit from memory: the same EngineCache again: load + refit;
* the next run: a fresh Python process that builds the model and gets its engine
  from the store, against a fresh process that recompiles (``ignore_engine_cache``,
  inductor's disk caches warm: the best case without this cache) and one that
  only builds the model (imports, construction).

Prints ratios and writes them to ``bench-results/engine.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_results import results_dir


def build(hidden: int, seed: int) -> Any:
    import torch

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(256, hidden)
            self.fc2 = torch.nn.Linear(hidden, hidden)
            self.fc3 = torch.nn.Linear(hidden, 10)
            self.norm = torch.nn.LayerNorm(hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc1(x))
            h = self.norm(torch.nn.functional.gelu(self.fc2(h)) + h)
            return self.fc3(h)

    torch.manual_seed(seed)
    return MLP().eval()


def child(args: argparse.Namespace) -> int:
    """One 'next run': build the model, and (unless --child-baseline) get its engine from the store."""
    start = time.perf_counter()
    import torch

    from adstore.integration.engine.cache import EngineCache
    from adstore.integration.engine.storage import StoreEngineStorage
    from adstore.store import Store

    model = build(args.hidden, 5)
    x = torch.randn(args.batch, 256)
    out: dict[str, Any] = {"startup": time.perf_counter() - start}
    if not args.child_baseline:
        with Store.open(args.child) as store:
            t = time.perf_counter()
            engine = EngineCache(StoreEngineStorage(store)).compile(
                model, (x,), ignore_engine_cache=args.child_recompile
            )
            out["compile_call"] = time.perf_counter() - t
            out["event"] = engine.event.kind + "/" + engine.event.source
            out["timings"] = engine.timings
            with torch.no_grad():
                out["error"] = (engine(x) - model(x)).abs().max().item()
    out["total"] = time.perf_counter() - start
    print(json.dumps(out))
    return 0


def run_child(extra: list[str], hidden: int, batch: int) -> tuple[float, dict[str, Any]]:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--hidden", str(hidden), "--batch", str(batch), *extra],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    wall = time.perf_counter() - t
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-recompile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.child_baseline:
        return child(args)

    work = Path(tempfile.mkdtemp(prefix="adstore-bench-engine-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")  # cold compiles, set before torch loads

    import torch

    from adstore.integration.engine.cache import EngineCache
    from adstore.integration.engine.storage import StoreEngineStorage
    from adstore.store import Store

    def model(seed: int) -> Any:
        return build(args.hidden, seed)

    x = torch.randn(args.batch, 256)
    weight_bytes = sum(t.numel() * t.element_size() for t in model(0).state_dict().values())

    store = Store.open(work / "store", grace_period=0.0)
    backend = StoreEngineStorage(store)

    t = time.perf_counter()
    cold = EngineCache(backend).compile(model(1), (x,))
    t_compile = time.perf_counter() - t
    assert cold.event.kind == "miss", cold.event

    front = EngineCache(backend)
    m2 = model(2)
    t = time.perf_counter()
    from_store = front.compile(m2, (x,))
    t_store = time.perf_counter() - t
    assert from_store.event.source == "backend", from_store.event

    m3 = model(3)
    t = time.perf_counter()
    from_memory = front.compile(m3, (x,))
    t_memory = time.perf_counter() - t
    assert from_memory.event.source == "memory", from_memory.event

    with torch.no_grad():
        err = max((from_store(x) - m2(x)).abs().max().item(), (from_memory(x) - m3(x)).abs().max().item())

    t = time.perf_counter()  # same graph again, inductor's own caches now warm
    warm = EngineCache(backend).compile(model(4), (x,), ignore_engine_cache=True)
    t_warm = time.perf_counter() - t
    assert warm.event.reason == "ignored", warm.event

    t = time.perf_counter()
    plain_pkg = torch._inductor.aoti_compile_and_package(
        torch.export.export(model(1), (x,)), package_path=str(work / "with_weights.pt2")
    )
    t_plain = time.perf_counter() - t
    bytes_with = os.path.getsize(plain_pkg)
    record = backend.load_record(cold.hash)
    assert record is not None
    bytes_without = record.payload_size
    record.release()
    meta_bytes = len(store.read_artifact(store.lookup(cold.hash, count=False).manifest, "engine.json"))
    store.close()

    base_wall, base = run_child(["--child-baseline"], args.hidden, args.batch)
    _, nxt = run_child(["--child", str(work / "store")], args.hidden, args.batch)
    assert nxt["event"] == "hit/backend", nxt
    _, nxt_miss = run_child(["--child", str(work / "store"), "--child-recompile"], args.hidden, args.batch)
    assert nxt_miss["event"] == "miss/compiled", nxt_miss
    err = max(err, nxt["error"], nxt_miss["error"])
    next_cost = nxt["total"] - base["total"]

    def r4(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v, 4) for k, v in d.items()}

    results = {
        "model": f"MLP 256-{args.hidden}-{args.hidden}-10 + LayerNorm, batch {args.batch}",
        "weights_bytes": weight_bytes,
        "torch": torch.__version__,
        "seconds": {
            "compile_miss_cold_total": round(t_compile, 4),
            "compile_miss_cold_breakdown": r4(cold.timings),
            "compile_miss_warm_total": round(t_warm, 4),
            "compile_miss_warm_breakdown": r4(warm.timings),
            "plain_aoti_compile_with_weights_warm": round(t_plain, 4),
            "hit_from_store_total": round(t_store, 4),
            "hit_from_store_breakdown": r4(from_store.timings),
            "hit_from_memory_total": round(t_memory, 4),
            "hit_from_memory_breakdown": r4(from_memory.timings),
            "next_process_baseline_total": round(base["total"], 4),
            "next_process_hit_total": round(nxt["total"], 4),
            "next_process_hit_compile_call": round(nxt["compile_call"], 4),
            "next_process_hit_breakdown": r4(nxt["timings"]),
            "next_process_hit_extra_over_baseline": round(next_cost, 4),
            "next_process_recompile_total": round(nxt_miss["total"], 4),
            "next_process_recompile_compile_call": round(nxt_miss["compile_call"], 4),
            "next_process_recompile_breakdown": r4(nxt_miss["timings"]),
        },
        "ratios": {
            "cold_compile_over_store_hit": round(t_compile / t_store, 1),
            "warm_compile_over_store_hit": round(t_warm / t_store, 1),
            "cold_compile_over_memory_hit": round(t_compile / t_memory, 1),
            "next_process_recompile_over_hit_call": round(nxt_miss["compile_call"] / nxt["compile_call"], 1),
            "next_process_total_without_over_with_cache": round(nxt_miss["total"] / nxt["total"], 2),
            "bytes_with_weights_over_without": round(bytes_with / bytes_without, 2),
        },
        "bytes": {
            "package_with_weights": bytes_with,
            "package_without_weights": bytes_without,
            "record_metadata": meta_bytes,
        },
        "max_abs_error_vs_eager": err,
    }
    shutil.rmtree(work, ignore_errors=True)  # store, packages and the private inductor cache
    (results_dir() / "engine.json").write_text(json.dumps(results, indent=2) + "\n")
    r, b = results["ratios"], results["bytes"]
    print(f"model: {results['model']}, weights {weight_bytes / 1e6:.1f} MB")
    print(f"compile (miss, cold):        {t_compile:8.3f} s")
    print(f"compile (miss, warm):        {t_warm:8.3f} s   (plain AOTI with weights, warm: {t_plain:.3f} s)")
    print(
        f"hit from store + refit:      {t_store:8.3f} s   -> {r['cold_compile_over_store_hit']}x faster "
        f"than cold, {r['warm_compile_over_store_hit']}x than warm"
    )
    print(f"hit from memory + refit:     {t_memory:8.3f} s   -> {r['cold_compile_over_memory_hit']}x faster")
    print(
        f"next process, compile() hit: {nxt['compile_call']:8.3f} s   vs recompile {nxt_miss['compile_call']:.3f} s "
        f"-> {r['next_process_recompile_over_hit_call']}x faster (first export + inductor import included)"
    )
    print(
        f"next process, whole run:     {nxt['total']:8.3f} s   vs {nxt_miss['total']:.3f} s recompiling "
        f"({r['next_process_total_without_over_with_cache']}x); {base['total']:.3f} s with no engine at all"
    )
    print(f"package with weights:        {b['package_with_weights']:10d} B")
    print(
        f"package without weights:     {b['package_without_weights']:10d} B   -> "
        f"{r['bytes_with_weights_over_without']}x smaller (+{meta_bytes} B metadata)"
    )
    print(f"max |engine - eager|:        {err:.2e}")
    print(f"wrote {results_dir() / 'engine.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
