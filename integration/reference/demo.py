"""``adstore demo``: the reference pipeline twice against a store, cold then warm.

Each run happens in fresh processes (one per rank, spawned; gloo between
ranks for ``world_size > 1``), like two separate launches of a real job: the
first is a miss that runs the whole pipeline and saves at the cache point, the
second restores and resumes after it.  Outputs of the two runs are compared
bit for bit.

Two figures come out (docs/cli.md, "adstore demo"):

* the **restart**: wall time from starting the process to its first output,
  what a user restarting a job feels, next to the floor of a process that only
  imports torch, started the same way;
* the **in-process** call: the pipeline alone, called a second time in the
  same process once every library is imported (the cold process removes its
  entry and runs the miss again; the warm one restores again).

The weights are random (seeded) and written to a temporary safetensors
checkpoint; nothing is downloaded.  A previous demo entry with the same key is
removed first (planned, then executed) so the cold run really is cold.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from adstore.store import ConfigError, human_size

__all__ = ["forget", "format_demo", "free_port", "run_demo", "run_ranks"]

log = logging.getLogger(__name__)

_PHASE_TIMEOUT = 900.0


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _floor_main(rank: int, world_size: int, port: int, job: dict[str, Any], queue: Any) -> None:
    """The restart floor: a fresh process that imports torch and reports."""
    import torch  # noqa: F401

    queue.put({"rank": rank, "first_output_at": time.monotonic()})


def _rank_main(rank: int, world_size: int, port: int, job: dict[str, Any], queue: Any) -> None:
    """One rank of one pipeline run (spawned process).

    ``job["prepay"]`` (default true) imports transformers and dynamo and builds
    the config before the clock, for figures of the pipeline alone;
    ``job["again"]`` runs the pipeline a second time in this process (removing
    the entry first when ``job["again"] == "cold"``) and reports that call.
    """
    job_t0 = time.perf_counter()
    os.environ.update(job.get("env") or {})  # before anything imports Inductor (its cache directory)
    try:
        import torch
        import torch.distributed as dist

        from adstore.integration.pipeline.optimizer import InferenceOptimizer
        from adstore.integration.reference.models import ModelFactory

        if world_size > 1:
            from datetime import timedelta

            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(port)
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        factory = ModelFactory.from_config(job["model"])
        if job.get("prepay", True):
            # Library set-up both runs need (config classes, dynamo) is paid before the clock.
            import torch._dynamo  # noqa: F401
            import transformers  # noqa: F401

            factory.hf_config()
        setup_s = time.perf_counter() - job_t0
        inputs = factory.example_inputs(batch=job.get("batch", 2), seq=job.get("seq", 8))

        def run() -> tuple[Any, Any, float]:
            opt = InferenceOptimizer(factory, job["checkpoint"], job["transforms"])
            t0 = time.perf_counter()
            module = opt()
            seconds = time.perf_counter() - t0
            with torch.no_grad():
                return opt, module(*inputs), seconds

        opt, out, seconds = run()
        first_output_at = time.monotonic()
        events = [e.to_dict() for e in opt.events]
        if job.get("again"):
            if job["again"] == "cold":
                if rank == 0:
                    from adstore.store import Store

                    with Store.open(job["root"]) as store:
                        forget(store, opt.events[0].key)
                if world_size > 1:
                    dist.barrier()
            opt, _, seconds = run()
        result = {
            "rank": rank,
            "seconds": seconds,
            "setup_seconds": setup_s,
            "first_output_at": first_output_at,
            "timings": dict(opt.timings),
            "events": events,
            "again_events": [e.to_dict() for e in opt.events] if job.get("again") else None,
            "resumed_at": opt.resumed_at,
            "output": out.detach().contiguous().numpy().tobytes() if rank == 0 else None,
            "shape": list(out.shape),
        }
        if world_size > 1:
            dist.barrier()
            dist.destroy_process_group()
        queue.put(result)
    except BaseException:  # reported to the parent, which raises
        queue.put({"rank": rank, "error": traceback.format_exc()})


def forget(store: Any, key: str | None) -> int:
    """Remove the entry ``key`` and what its compile stage cached (index entries and their engines, Inductor
    files); the number of entries removed."""
    from adstore.integration.engine import inductor
    from adstore.integration.engine.index import EngineIndex, StageEntries

    if key is None:
        return 0
    keys = [key] if store.entry(key) is not None else []
    for index_key, engine in EngineIndex(store).entries_for(key):
        keys.append(index_key)
        if engine is not None and store.entry(engine) is not None:
            keys.append(engine)
    keys += [k for k, _ in StageEntries(store, inductor.NAMESPACE, inductor.ARTIFACT).keyed_by(key)]
    if not keys:
        return 0
    plan = store.plan_remove(sorted(set(keys)))
    log.info(
        "removing %d earlier demo entr%s (%d bytes)", len(keys), "y" if len(keys) == 1 else "ies", plan.bytes_to_free
    )
    plan.execute()
    return len(keys)


def run_ranks(
    job: dict[str, Any],
    world_size: int,
    *,
    target: Any = _rank_main,
    timeout: float = _PHASE_TIMEOUT,
    allow_dead: bool = False,
) -> list[dict[str, Any]]:
    """Run ``target(rank, world_size, port, job, queue)`` in ``world_size`` spawned processes.

    Each rank puts one result dict (with its ``rank``) on the queue.  A rank
    that dies without reporting raises, or with ``allow_dead`` is reported as
    ``{"rank": r, "exitcode": code}``.  A result carrying ``first_output_at``
    (``time.monotonic()``, one clock for every process) gets ``restart_s``:
    seconds from just before its process started to that moment.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(r, world_size, port, job, queue), daemon=False) for r in range(world_size)
    ]
    started = time.monotonic()
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks did not finish within {timeout:.0f}s")
            try:
                results.append(queue.get(timeout=min(remaining, 1.0)))
            except Exception:
                reported = {r["rank"] for r in results}
                dead = [(i, p) for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in reported]
                if dead and queue.empty():
                    if not allow_dead:
                        codes = {i: p.exitcode for i, p in dead}
                        raise RuntimeError(f"rank process(es) died: {codes}") from None
                    if len(dead) + len(results) == world_size:
                        results.extend({"rank": i, "exitcode": p.exitcode} for i, p in dead)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    for r in results:
        if "first_output_at" in r:
            r["restart_s"] = r["first_output_at"] - started
    return sorted(results, key=lambda r: r["rank"])


def _phase(job: dict[str, Any], world_size: int, *, target: Any = _rank_main) -> list[dict[str, Any]]:
    results = run_ranks(job, world_size, target=target)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError("demo rank failed:\n" + errors[0])
    return results


def run_demo(
    *,
    arch: str = "llama",
    layers: int = 4,
    hidden: int = 256,
    world_size: int = 1,
    root: str | os.PathLike[str] | None = None,
    compile: str = "eager",
) -> dict[str, Any]:
    """Cold then warm run of the reference pipeline; a JSON-safe result dict.

    ``compile`` is the compile stage's backend (``eager``, ``aoti``,
    ``torch_compile``).  Every phase uses a private Inductor cache directory,
    empty for the cold run, as on a new host.
    """
    from adstore.integration.pipeline.optimizer import InferenceOptimizer
    from adstore.integration.reference.checkpoint import write_random_checkpoint
    from adstore.integration.reference.models import ModelFactory, tiny_config
    from adstore.integration.reference.pipeline import default_transforms
    from adstore.integration.reference.stages import BACKENDS
    from adstore.store import Store

    if world_size < 1 or world_size > 8:
        raise ConfigError("world_size", f"must be 1..8, got {world_size}")
    if compile not in BACKENDS:
        raise ConfigError("compile", f"unknown backend {compile!r} ({', '.join(BACKENDS)})")
    tiny_config(arch, layers=layers, hidden=hidden)  # validates arch and sizes early
    store = Store.open(root)
    root_path = Path(store.root)
    model = {"arch": arch, "layers": layers, "hidden": hidden}
    factory = ModelFactory.from_config(model)
    heads = factory.attention_shape()
    if heads["num_key_value_heads"] % world_size:
        raise ConfigError("world_size", f"{heads['num_key_value_heads']} KV heads do not split over {world_size} ranks")
    tmp = Path(tempfile.mkdtemp(prefix="adstore-demo-"))
    try:
        checkpoint = write_random_checkpoint(factory.build(), tmp / "checkpoint", seed=0)
        transforms = default_transforms(pipeline_cache={"root": str(root_path)}, compile={"backend": compile})
        probe = InferenceOptimizer(factory, checkpoint, transforms, rank=0, world_size=world_size)
        key = probe.cache_key().key  # type: ignore[union-attr]
        replaced = forget(store, key) > 0
        started = time.time()  # entries created from here on are what this demo stored
        job = {
            "model": model,
            "checkpoint": str(checkpoint),
            "transforms": transforms,
            "root": str(root_path),
            "prepay": False,
            "env": {"TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")},
        }
        # three floor processes, the median: the warm restart is within a fraction of a second of the
        # floor, so one noisy floor would swing the above-the-floor ratio by orders of magnitude
        floors = [_phase({}, 1, target=_floor_main)[0]["restart_s"] for _ in range(3)]
        cold = _phase({**job, "again": "cold"}, world_size)
        warm = _phase({**job, "again": "warm"}, world_size)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    store.flush()
    stats = store.stats(unreferenced=True)
    stored: dict[str, dict[str, int]] = {}
    for e in store.entries():
        if e.created >= started:
            ns = stored.setdefault(e.namespace, {"entries": 0, "bytes": 0})
            ns["entries"] += 1
            ns["bytes"] += e.bytes
    cold_s = max(r["seconds"] for r in cold)
    warm_s = max(r["seconds"] for r in warm)
    floor_s = statistics.median(floors)
    restart_cold = max(r["restart_s"] for r in cold)
    restart_warm = max(r["restart_s"] for r in warm)
    prefix_s = max(sum(v for k, v in r["timings"].items() if k in _prefix_names(r)) for r in cold)
    restore_s = max(r["timings"].get("restore", 0.0) for r in warm)
    cold_kinds = sorted({e["kind"] for r in cold for e in r["events"]})
    warm_kinds = sorted({e["kind"] for r in warm for e in r["events"] + r["again_events"]})
    return {
        "arch": arch,
        "layers": layers,
        "hidden": hidden,
        "world_size": world_size,
        "compile": compile,
        "compile_cold_s": round(max(r["timings"].get("compile", 0.0) for r in cold), 4),
        "compile_warm_s": round(max(r["timings"].get("compile", 0.0) for r in warm), 4),
        "root": str(root_path),
        "key": key,
        "replaced_previous_entry": replaced,
        "restart_cold_s": round(restart_cold, 4),
        "restart_warm_s": round(restart_warm, 4),
        "restart_floor_s": round(floor_s, 4),
        "restart_speedup": round(restart_cold / restart_warm, 2) if restart_warm > 0 else None,
        "restart_above_floor_ratio": (
            round((restart_cold - floor_s) / (restart_warm - floor_s), 2) if restart_warm > floor_s else None
        ),
        "cold_s": round(cold_s, 4),
        "warm_s": round(warm_s, 4),
        "speedup": round(cold_s / warm_s, 2) if warm_s > 0 else None,
        "prefix_s": round(prefix_s, 4),
        "process_setup_s": round(max(r["setup_seconds"] for r in cold + warm), 4),
        "restore_s": round(restore_s, 4),
        "cold_events": cold_kinds,
        "warm_events": warm_kinds,
        "warm_hit": warm_kinds == ["hit"],
        "stored": dict(sorted(stored.items())),
        "dedup_ratio": round(float(stats.dedup_ratio), 3),
        "outputs_match": cold[0]["output"] == warm[0]["output"],
        "output_shape": cold[0]["shape"],
    }


def _prefix_names(result: dict[str, Any]) -> set[str]:
    names = []
    for name in result["timings"]:
        if name == "pipeline_cache":
            break
        if name not in ("restore", "total"):
            names.append(name)
    return set(names)


def format_demo(result: dict[str, Any]) -> str:
    """A short human table of :func:`run_demo`'s result.

    The floor is the median of three processes that only import torch; a warm
    restart can come out below it by the noise of one start, which is said,
    not left to read as a restart faster than importing torch.
    """
    above = result.get("restart_above_floor_ratio")
    below = result["restart_warm_s"] < result["restart_floor_s"]
    rows = [
        ("restart, cold (miss + save)", f"{result['restart_cold_s']:.3f} s"),
        (
            "restart, warm (hit)",
            f"{result['restart_warm_s']:.3f} s"
            + (" (below the floor: noise, the warm restart costs about the floor)" if below else ""),
        ),
        ("restart floor (import torch)", f"{result['restart_floor_s']:.3f} s (median of three)"),
        (
            "restart speedup",
            f"{result['restart_speedup']:.2f}x" + (f" ({above:.1f}x less time above the floor)" if above else ""),
        ),
        (
            "in-process call, cold / warm",
            f"{result['cold_s']:.3f} s / {result['warm_s']:.3f} s"
            + (f" ({result['speedup']:.1f}x)" if result.get("speedup") else ""),
        ),
        ("cached prefix / restore", f"{result['prefix_s']:.3f} s / {result['restore_s']:.3f} s"),
        (
            f"compile stage ({result['compile']}), cold / warm",
            f"{result['compile_cold_s']:.3f} s / {result['compile_warm_s']:.3f} s",
        ),
        *(
            (f"stored, {ns}", f"{human_size(v['bytes'])} ({v['entries']} entr{'y' if v['entries'] == 1 else 'ies'})")
            for ns, v in result["stored"].items()
        ),
        ("store dedup ratio", f"{result['dedup_ratio']:.2f}"),
        ("outputs match", "yes (bit for bit)" if result["outputs_match"] else "NO"),
        ("warm run was a hit", "yes" if result["warm_hit"] else f"no ({', '.join(result['warm_events'])})"),
    ]
    width = max(len(k) for k, _ in rows)
    head = (
        f"adstore demo: {result['arch']}, {result['layers']} layers, hidden {result['hidden']}, "
        f"world size {result['world_size']}, compile {result['compile']}\n"
        f"store: {result['root']}  key {result['key'][:16]}"
    )
    return head + "\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
