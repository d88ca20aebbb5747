"""Pipeline cache benchmark: a deep transformer, cold vs warm, in fresh processes.

One run measures, each phase in a freshly spawned process (imports of torch,
transformers and their config machinery happen before the clock in every
phase):

* ``baseline``: the reference pipeline with the cache disabled;
* ``cold``: cache enabled, empty store: a miss, the full pipeline, a save;
* ``warm``: same config: a hit, restore, resume at weight loading.

Figures: the cached prefix alone (build → sharding, from the cold run), the
restore that replaces it (key + lookup + validate + load + reattach), the
save overhead on a miss (failed lookup + save, against the cold run and against
the no-cache baseline), cold and warm totals.  Targets: restore >= 20x faster
than the prefix; save overhead < 10% of the cold run.

    python tests/benchmarks/bench_pipeline.py [--layers 24] [--hidden 128] [--arch llama]
                                              [--world-size 2] [--dynamic]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench_results import results_dir


def prefix_names(timings: dict) -> list[str]:
    """Transforms timed before the cache point (the optimizer records them in run order)."""
    names = []
    for name in timings:
        if name == "pipeline_cache":
            return names
        if name not in ("restore", "total"):
            names.append(name)
    raise SystemExit("the cold run never reached pipeline_cache")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--world-size", type=int, default=1, help="ranks over gloo (figures: the slowest rank)")
    ap.add_argument("--dynamic", action="store_true", help="export with symbolic batch/seq")
    ap.add_argument("--out", help="JSON file (default: bench_pipeline.json in the results directory)")
    args = ap.parse_args()

    from adstore.integration.reference.checkpoint import write_random_checkpoint
    from adstore.integration.reference.demo import run_ranks
    from adstore.integration.reference.models import ModelFactory
    from adstore.integration.reference.pipeline import default_transforms

    model = {"arch": args.arch, "layers": args.layers, "hidden": args.hidden}
    factory = ModelFactory.from_config(model)
    with tempfile.TemporaryDirectory(prefix="adstore-bench-") as tmp:
        ckpt = write_random_checkpoint(factory.build(), Path(tmp) / "ckpt", seed=0)
        root = Path(tmp) / "store"

        def phase(cache: bool) -> dict:
            tr = default_transforms(
                pipeline_cache={"root": str(root), "enabled": cache}, export_to_gm={"dynamic": args.dynamic}
            )
            ranks = run_ranks({"model": model, "checkpoint": str(ckpt), "transforms": tr}, args.world_size)
            for res in ranks:
                if "error" in res:
                    raise SystemExit(res["error"])
            slowest = max(ranks, key=lambda r: r["timings"]["total"])
            return {**slowest, "output": ranks[0]["output"], "events": [e for r in ranks for e in r["events"]]}

        t0 = time.perf_counter()
        baseline = phase(False)
        cold = phase(True)
        warm = phase(True)
        wall = time.perf_counter() - t0
        from adstore.store import Store

        store = Store.open(root)
        entry = next(iter(store.entries()), None)
        stored = entry.bytes if entry else 0

    ct, wt, bt = cold["timings"], warm["timings"], baseline["timings"]
    prefix = prefix_names(ct)
    prefix_s = sum(ct[n] for n in prefix)
    restore_s = wt["restore"]
    miss_lookup_s = ct["restore"]
    save_s = ct["pipeline_cache"]
    overhead_s = miss_lookup_s + save_s
    figures = {
        "model": model,
        "world_size": args.world_size,
        "dynamic": args.dynamic,
        "cold_events": sorted({e["kind"] for e in cold["events"]}),
        "warm_events": sorted({e["kind"] for e in warm["events"]}),
        "outputs_match": cold["output"] == warm["output"] == baseline["output"],
        "baseline_nocache_s": round(bt["total"], 4),
        "cold_s": round(ct["total"], 4),
        "warm_s": round(wt["total"], 4),
        "prefix_s": round(prefix_s, 4),
        "prefix_breakdown_s": {n: round(ct[n], 4) for n in prefix},
        "restore_s": round(restore_s, 4),
        "warm_breakdown_s": {n: round(v, 4) for n, v in wt.items()},
        "miss_lookup_s": round(miss_lookup_s, 4),
        "save_s": round(save_s, 4),
        "bytes_stored": stored,
        "ratios": {
            "restore_speedup_vs_prefix": round(prefix_s / restore_s, 2),
            "warm_speedup_vs_cold": round(ct["total"] / wt["total"], 2),
            "save_overhead_fraction_of_cold": round(overhead_s / ct["total"], 4),
            "cold_vs_nocache_baseline": round(ct["total"] / bt["total"], 4),
        },
        "targets": {"restore_speedup_vs_prefix": ">= 20", "save_overhead_fraction_of_cold": "< 0.10"},
        "bench_wall_s": round(wall, 1),
        "cpu_count": os.cpu_count(),
    }
    figures["targets_met"] = (
        figures["ratios"]["restore_speedup_vs_prefix"] >= 20
        and figures["ratios"]["save_overhead_fraction_of_cold"] < 0.10
    )
    out = Path(args.out) if args.out else results_dir() / "bench_pipeline.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2))
    r = figures["ratios"]
    print(
        f"pipeline cache, {args.arch} {args.layers} layers hidden {args.hidden}, world size {args.world_size}"
        f"{', dynamic shapes' if args.dynamic else ''} ({stored} bytes stored per entry)"
    )
    print(f"  no-cache baseline  {bt['total']:8.3f} s")
    print(f"  cold (miss+save)   {ct['total']:8.3f} s   x{r['cold_vs_nocache_baseline']:.3f} of baseline")
    print(f"  warm (hit)         {wt['total']:8.3f} s   {r['warm_speedup_vs_cold']:.1f}x faster than cold")
    print(f"  cached prefix      {prefix_s:8.3f} s")
    print(f"  restore            {restore_s:8.3f} s   {r['restore_speedup_vs_prefix']:.1f}x faster (target >= 20x)")
    print(
        f"  miss lookup + save {overhead_s:8.3f} s   {100 * r['save_overhead_fraction_of_cold']:.2f}% of cold "
        "(target < 10%)"
    )
    print(f"  outputs match: {figures['outputs_match']}; targets met: {figures['targets_met']}; -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
