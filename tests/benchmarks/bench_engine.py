"""Engine cache benchmark: compile vs hit+refit, and engine bytes with vs without weights.

Run: ``python tests/benchmarks/bench_engine.py [--hidden 1024]``

All in one process, on a fresh store and a fresh inductor cache directory (so
the "compile" figure is a cold AOTInductor compile, not inductor's own cache):

* baseline: ``compile()`` on an empty store (export + hash + AOTInductor compile
  + save + refit), and a plain ``aoti_compile_and_package`` with the default
  options (weights baked into the package);
* hit from the store: a new EngineCache (empty in-process layer), another model
  of the same architecture: lookup + verified copy + load + refit;
* hit from memory: the same EngineCache again: load + refit.

Prints ratios and writes them to ``bench-results/engine.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="adstore-bench-engine-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")  # cold compiles, set before torch loads

    import torch

    from adstore.integration.engine_backends import AdstoreEngineCache
    from adstore.integration.engine_cache import EngineCache
    from adstore.store import Store

    class MLP(torch.nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(256, hidden)
            self.fc2 = torch.nn.Linear(hidden, hidden)
            self.fc3 = torch.nn.Linear(hidden, 10)
            self.norm = torch.nn.LayerNorm(hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc1(x))
            h = self.norm(torch.nn.functional.gelu(self.fc2(h)) + h)
            return self.fc3(h)

    def model(seed: int) -> MLP:
        torch.manual_seed(seed)
        return MLP(args.hidden).eval()

    x = torch.randn(args.batch, 256)
    weight_bytes = sum(t.numel() * t.element_size() for t in model(0).state_dict().values())

    store = Store.open(work / "store", grace_period=0.0)
    backend = AdstoreEngineCache(store)

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
        err = max(
            (from_store(x) - m2(x)).abs().max().item(),
            (from_memory(x) - m3(x)).abs().max().item(),
        )

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
    meta_bytes = len(store.read_artifact(store.lookup(cold.hash, record=False).manifest, "engine.json"))

    results = {
        "model": f"MLP 256-{args.hidden}-{args.hidden}-10 + LayerNorm, batch {args.batch}",
        "weights_bytes": weight_bytes,
        "torch": torch.__version__,
        "seconds": {
            "compile_miss_total": round(t_compile, 4),
            "compile_miss_breakdown": {k: round(v, 4) for k, v in cold.timings.items()},
            "compile_miss_warm_total": round(t_warm, 4),
            "compile_miss_warm_breakdown": {k: round(v, 4) for k, v in warm.timings.items()},
            "plain_aoti_compile_with_weights_warm": round(t_plain, 4),
            "hit_from_store_total": round(t_store, 4),
            "hit_from_store_breakdown": {k: round(v, 4) for k, v in from_store.timings.items()},
            "hit_from_memory_total": round(t_memory, 4),
            "hit_from_memory_breakdown": {k: round(v, 4) for k, v in from_memory.timings.items()},
        },
        "ratios": {
            "compile_over_store_hit": round(t_compile / t_store, 1),
            "compile_over_memory_hit": round(t_compile / t_memory, 1),
            "warm_compile_over_store_hit": round(t_warm / t_store, 1),
            "bytes_with_weights_over_without": round(bytes_with / bytes_without, 2),
        },
        "bytes": {
            "package_with_weights": bytes_with,
            "package_without_weights": bytes_without,
            "record_metadata": meta_bytes,
            "store_physical": store.size(),
        },
        "max_abs_error_vs_eager": err,
    }
    store.close()
    out_dir = Path(__file__).resolve().parents[2] / "bench-results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "engine.json").write_text(json.dumps(results, indent=2) + "\n")
    s, r, b = results["seconds"], results["ratios"], results["bytes"]
    print(f"model: {results['model']}, weights {weight_bytes / 1e6:.1f} MB")
    print(f"compile (miss, cold):      {s['compile_miss_total']:8.3f} s")
    print(f"compile (miss, warm):      {t_warm:8.3f} s   (plain AOTI with weights, warm: {t_plain:.3f} s)")
    print(f"hit from store + refit:    {s['hit_from_store_total']:8.3f} s   -> {r['compile_over_store_hit']}x faster "
          f"than cold, {r['warm_compile_over_store_hit']}x than warm")
    print(f"hit from memory + refit:   {s['hit_from_memory_total']:8.3f} s   -> {r['compile_over_memory_hit']}x faster")
    print(f"package with weights:      {b['package_with_weights']:10d} B")
    print(f"package without weights:   {b['package_without_weights']:10d} B   -> "
          f"{r['bytes_with_weights_over_without']}x smaller (+{meta_bytes} B metadata)")
    print(f"max |engine - eager|:      {err:.2e}")
    print(f"wrote {out_dir / 'engine.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
