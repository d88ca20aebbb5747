"""Scale benchmark: the reference pipeline on published model configurations, at real size.

Llama-3-8B, Qwen3-30B-A3B, Mixtral-8x7B, Llama-3-70B (one rank and two over
gloo) and DeepSeek-V3 (:mod:`adstore.integration.reference.published`), in
bfloat16, built on the meta device, each with a header-only checkpoint of its
real layout (sparse files: no weights, no download).  The pipeline stops at
the cache point (nothing after it can run without weights).  Every phase is a
fresh process, timed from just before it starts to the moment it holds the
module at the cache point:

* ``floor``: a process that imports torch;
* ``cold``: empty store: the prefix (build, export, rewrites, sharding) and
  the save;
* ``warm``: the same job again: the restore.

Per configuration: graph nodes, snapshot bytes and distinct blobs stored, the
prefix against the restore that replaces it (in process), both runs' time
above the floor, and each phase's peak RSS (target: the cold run well under
4 GiB).  A last phase runs a one-layer Mixtral-8x7B forward on 2x8 tokens with
random weights (in the process, no checkpoint) and compares its peak RSS with
the weights it holds (target: within 1.5x); ``--moe-baseline`` runs it again
with transformers' ``batched_mm`` experts (memory: about 3x the weights more).

    python tests/benchmarks/bench_scale.py [--only llama-3-8b,deepseek-v3] [--quick] [--no-moe]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_results import write_results

#: (label, published config, world size).
CASES = (
    ("llama-3-8b", "llama-3-8b", 1),
    ("qwen3-30b-a3b", "qwen3-30b-a3b", 1),
    ("mixtral-8x7b", "mixtral-8x7b", 1),
    ("llama-3-70b", "llama-3-70b", 1),
    ("llama-3-70b-ws2", "llama-3-70b", 2),
    ("deepseek-v3", "deepseek-v3", 1),
)
#: ``--quick``: two cases cut to two layers of the real shapes, and a small MoE forward.
QUICK = {
    "layers": 2,
    "cases": ("llama-3-8b", "llama-3-70b-ws2"),
    "moe": {"intermediate_size": 1024, "vocab_size": 4096},
}
_AFTER_CACHE = ("load_weights", "fuse_linears", "init_cache", "compile")


def _peak_rss() -> int:
    """This process's peak resident set size in bytes (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _init_dist(rank: int, world_size: int, port: int) -> None:
    if world_size > 1:
        from datetime import timedelta

        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=600))


def child_floor(rank: int, world_size: int, port: int, job: dict[str, Any], queue: Any) -> None:
    import torch  # noqa: F401

    queue.put({"rank": rank, "first_output_at": time.monotonic()})


def child_prefix(rank: int, world_size: int, port: int, job: dict[str, Any], queue: Any) -> None:
    """One rank of one run up to the cache point; reports what it did."""
    import traceback

    try:
        _init_dist(rank, world_size, port)
        from adstore.integration.pipeline.graphs import graph_modules
        from adstore.integration.pipeline.optimizer import InferenceOptimizer
        from adstore.integration.reference.pipeline import default_transforms
        from adstore.integration.reference.published import published_factory
        from adstore.store import Store

        factory = published_factory(job["config"], layers=job.get("layers"))
        transforms = default_transforms(
            pipeline_cache={"root": job["root"]}, **{name: {"enabled": False} for name in _AFTER_CACHE}
        )
        opt = InferenceOptimizer(factory, job["checkpoint"], transforms)
        module = opt()
        first_output_at = time.monotonic()
        events = [e.to_dict() for e in opt.events]
        key = events[0]["key"]
        manifests = Store.open(job["root"]).manifests(key) if key else []
        mine = [m for m in manifests if m.rank == rank]
        prefix = [name for name in opt.timings if name not in ("restore", "total", "pipeline_cache")]
        queue.put(
            {
                "rank": rank,
                "first_output_at": first_output_at,
                "events": [(e["kind"], e["reason"]) for e in events],
                "nodes": sum(len(gm.graph.nodes) for _, gm in graph_modules(module)),
                "prefix_s": sum(opt.timings[n] for n in prefix) if events[0]["kind"] == "miss" else None,
                "save_s": opt.timings.get("pipeline_cache"),
                "restore_s": opt.timings.get("restore"),
                "snapshot_bytes": sum(r.size for m in mine for r in m.artifacts.values()),
                "digests": {n: r.digest for m in mine for n, r in m.artifacts.items()},
                "peak_rss": _peak_rss(),
                "imports": {"transformers": "transformers" in sys.modules, "dynamo": "torch._dynamo" in sys.modules},
            }
        )
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def child_moe(rank: int, world_size: int, port: int, job: dict[str, Any], queue: Any) -> None:
    """A one-layer Mixtral-8x7B graph from the pipeline, random weights in place, fused, one forward."""
    import traceback

    try:
        import torch

        from adstore.integration.pipeline.graphs import graph_modules
        from adstore.integration.pipeline.optimizer import InferenceOptimizer
        from adstore.integration.reference.fusion import fuse_parallel_linears
        from adstore.integration.reference.pipeline import default_transforms
        from adstore.integration.reference.published import published_factory

        factory = published_factory(
            "mixtral-8x7b", layers=1, experts_implementation=job.get("experts"), **job.get("overrides", {})
        )
        transforms = default_transforms(
            pipeline_cache={"enabled": False}, **{name: {"enabled": False} for name in _AFTER_CACHE}
        )
        module = InferenceOptimizer(factory, job["checkpoint"], transforms)()
        ((_, gm),) = graph_modules(module)
        rss_graph = _status("VmRSS")
        gen = torch.Generator().manual_seed(0)
        state: dict[str, torch.Tensor] = {}
        for name, t in gm.state_dict(keep_vars=True).items():
            if not t.is_meta:
                continue
            value = torch.empty(t.shape, dtype=t.dtype)  # filled in place: no transient copy
            if t.dim() >= 2:
                value.normal_(0.0, t.shape[-1] ** -0.5, generator=gen)
            else:
                value.normal_(1.0, 0.1, generator=gen)
            state[name] = value
        gm.load_state_dict(state, strict=False, assign=True)
        del state
        fuse_parallel_linears(gm)  # what load_weights is followed by: q/k/v become one linear
        weights = sum(t.numel() * t.element_size() for t in gm.state_dict().values())
        rss_loaded = _status("VmRSS")
        try:  # restart the high-water mark, so the peak is the forward's
            Path("/proc/self/clear_refs").write_text("5")
            reset = True
        except OSError:
            reset = False
        x = factory.example_inputs(batch=2, seq=8)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = gm(*x)
        seconds = time.perf_counter() - t0
        peak = _status("VmHWM") if reset else _peak_rss()
        queue.put(
            {
                "rank": rank,
                "weights_bytes": weights,
                "rss_graph": rss_graph,
                "rss_loaded": rss_loaded,
                "forward_peak_rss": peak,
                "peak_reset": reset,
                "process_peak_rss": _peak_rss(),
                "forward_s": seconds,
                "finite": bool(torch.isfinite(out.float()).all()),
            }
        )
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _ranks(target: Any, job: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    from adstore.integration.reference.demo import run_ranks

    results = run_ranks(job, world_size, target=target, timeout=3600)
    for r in results:
        if "error" in r:
            raise SystemExit(f"{target.__name__} rank {r['rank']} failed:\n{r['error']}")
    return results


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.1f}x"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def measure_floor() -> tuple[float, list[float]]:
    """Median of three fresh processes that import torch (started the way the ranks are)."""
    floors = sorted(_ranks(child_floor, {}, 1)[0]["restart_s"] for _ in range(3))
    return floors[1], floors


def measure_case(label: str, config: str, world_size: int, work: Path, layers: int | None) -> dict[str, Any]:
    from adstore.integration.reference.checkpoint import write_header_checkpoint
    from adstore.integration.reference.published import published_factory

    factory = published_factory(config, layers=layers)
    t0 = time.perf_counter()
    checkpoint = write_header_checkpoint(factory.build(), work / f"ckpt-{label}")
    ckpt_s = time.perf_counter() - t0
    ckpt_bytes = sum(f.stat().st_size for f in checkpoint.iterdir())
    ckpt_disk = sum(f.stat().st_blocks * 512 for f in checkpoint.iterdir())
    job = {"config": config, "layers": layers, "checkpoint": str(checkpoint), "root": str(work / f"store-{label}")}
    cold = _ranks(child_prefix, job, world_size)
    floor, floors = measure_floor()  # beside the runs it is the baseline of, so load drift hits both alike
    warm = _ranks(child_prefix, job, world_size)
    for runs, want in ((cold, "miss"), (warm, "hit")):
        got = {r["events"][0][0] for r in runs}
        if got != {want}:
            raise SystemExit(f"{label}: expected {want} on every rank, got {[r['events'] for r in runs]}")
    slow_cold = max(cold, key=lambda r: r["restart_s"])
    slow_warm = max(warm, key=lambda r: r["restart_s"])
    prefix = max(r["prefix_s"] for r in cold)
    restore = max(r["restore_s"] for r in warm)
    digests = {d for r in cold for d in r["digests"].values()}
    cold_above, warm_above = slow_cold["restart_s"] - floor, slow_warm["restart_s"] - floor
    out = {
        "config": config,
        "world_size": world_size,
        "layers": layers or factory.config["num_hidden_layers"],
        "parameters_billion": round(sum(p.numel() for p in factory.build().parameters()) / 1e9, 1),
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_disk_bytes": ckpt_disk,
        "checkpoint_write_s": ckpt_s,
        "nodes": cold[0]["nodes"],
        "nodes_equal_warm": [r["nodes"] for r in cold] == [r["nodes"] for r in warm],
        "snapshot_bytes": sum(r["snapshot_bytes"] for r in cold),
        "distinct_blobs": len(digests),
        "prefix_s": prefix,
        "save_s": max(r["save_s"] for r in cold),
        "restore_s": restore,
        "prefix_over_restore": prefix / restore,
        "floor_s": floor,
        "floor_runs": floors,
        "cold_s": slow_cold["restart_s"],
        "warm_s": slow_warm["restart_s"],
        "cold_above_floor_s": cold_above,
        "warm_above_floor_s": warm_above,
        "above_floor_ratio": cold_above / warm_above if warm_above > 0 else None,
        "cold_peak_rss": max(r["peak_rss"] for r in cold),
        "warm_peak_rss": max(r["peak_rss"] for r in warm),
        "warm_imports": slow_warm["imports"],
    }
    out["meets_cold_rss_under_4gib"] = out["cold_peak_rss"] < 4 << 30
    print(
        f"{label}: {out['parameters_billion']}B params, {out['nodes']} nodes, snapshot {out['snapshot_bytes']:,} B "
        f"in {len(digests)} blobs; prefix {prefix:.2f} s vs restore {restore:.3f} s "
        f"({out['prefix_over_restore']:.0f}x); restart cold {out['cold_s']:.2f} s, warm {out['warm_s']:.2f} s, "
        f"floor {floor:.2f} s "
        f"(above floor {_ratio(out['above_floor_ratio'])} less); peak RSS cold {_gib(out['cold_peak_rss'])}, "
        f"warm {_gib(out['warm_peak_rss'])}; warm imports {out['warm_imports']}",
        flush=True,
    )
    return out


def measure_moe(work: Path, experts: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    from adstore.integration.reference.checkpoint import write_header_checkpoint
    from adstore.integration.reference.published import published_factory

    factory = published_factory("mixtral-8x7b", layers=1, **overrides)
    checkpoint = write_header_checkpoint(factory.build(), work / f"ckpt-moe-{bool(overrides)}")
    job = {"checkpoint": str(checkpoint), "experts": experts, "overrides": overrides}
    (r,) = _ranks(child_moe, job, 1)
    r["peak_over_weights"] = r["forward_peak_rss"] / r["weights_bytes"]
    r["meets_within_1_5x_weights"] = r["peak_over_weights"] <= 1.5 and r["finite"]
    print(
        f"mixtral-8x7b 1 layer, 2x8 tokens, experts {experts or 'adstore_grouped'}: weights "
        f"{_gib(r['weights_bytes'])}, forward peak RSS {_gib(r['forward_peak_rss'])} "
        f"({r['peak_over_weights']:.2f}x the weights), forward {r['forward_s']:.2f} s",
        flush=True,
    )
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case labels (default: all)")
    ap.add_argument("--quick", action="store_true", help="two cases at two layers, a small MoE forward")
    ap.add_argument("--no-moe", action="store_true", help="skip the Mixtral forward")
    ap.add_argument(
        "--moe-baseline",
        action="store_true",
        help="also run the forward with transformers' batched_mm experts (about 4x the weights in RSS)",
    )
    args = ap.parse_args()
    layers = QUICK["layers"] if args.quick else None
    only = {x.strip() for x in args.only.split(",") if x.strip()} or (set(QUICK["cases"]) if args.quick else None)
    cases = [c for c in CASES if only is None or c[0] in only]
    if only and len(cases) != len(only):
        raise SystemExit(f"unknown case(s) {sorted(only - {c[0] for c in CASES})}; known: {[c[0] for c in CASES]}")

    results: dict[str, Any] = {"load_average": [round(x, 2) for x in os.getloadavg()], "quick": args.quick, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="adstore-bench-scale-") as tmp:
        work = Path(tmp)
        for label, config, world_size in cases:
            results["cases"][label] = measure_case(label, config, world_size, work, layers)
        if not args.no_moe:
            overrides = QUICK["moe"] if args.quick else {}
            results["moe_forward"] = measure_moe(work, None, overrides)
            if args.moe_baseline:
                base = measure_moe(work, "batched_mm", overrides)
                results["moe_forward_batched_mm"] = base
                results["moe_forward"]["batched_mm_over_grouped_peak"] = (
                    base["forward_peak_rss"] / results["moe_forward"]["forward_peak_rss"]
                )
    path = write_results("scale.json", results, partial=bool(args.only) or args.no_moe)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
