"""Simulated hosts of the two-tier tests: each runs in its own spawned process with its own store root.

Test modules import from here (never from ``conftest``).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from typing import Any

__all__ = [
    "ARTIFACTS",
    "on_host",
    "save_and_push",
    "restore",
    "digests",
    "pipeline_host",
    "dist_rank_host",
    "cold_start_race",
    "dist_hosts_race",
]

#: name -> size of the artifacts a host saves (one file-sized, one inline-sized).
ARTIFACTS = {"weights.bin": 3 << 20, "graph.json": 300}


def digests(blobs: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()}


def save_and_push(root: str, url: str, private_pem: bytes, key: str, seed: int) -> dict[str, Any]:
    """Host A: commit ``key`` locally, then push it (inline); what it saved and what the push sent."""
    import random

    from adstore.store import Store
    from adstore.store.remote import Signer, open_remote
    from adstore.store.tiered import remote_save

    rnd = random.Random(seed)
    blobs = {name: rnd.randbytes(size) for name, size in ARTIFACTS.items()}
    with Store.open(root) as store:
        refs = {name: store.put_bytes(data) for name, data in blobs.items()}
        gen = store.new_generation()
        store.publish(key, generation=gen, artifacts=refs, components={"seed": seed})
        store.commit(key, generation=gen, components={"seed": seed})
        remote = open_remote(url, mode="read-write", signer=Signer.from_pem(private_pem))
        out = remote_save(store, remote, key)
        again = remote_save(store, remote, key)
        return {
            "reason": out.reason,
            "sent": out.value,
            "again_sent": again.value,
            "generation": gen,
            "digests": digests(blobs),
            "counters": store.stats().counters,
        }


def restore(root: str, url: str, public_pem: bytes, key: str) -> dict[str, Any]:
    """Host B: local miss, remote restore, then a local lookup; what it read back."""
    from adstore.store import Store
    from adstore.store.remote import TrustedKeys, open_remote
    from adstore.store.tiered import remote_restore

    with Store.open(root) as store:
        before = store.lookup(key)
        remote = open_remote(url, trusted=TrustedKeys.from_pem(public_pem))
        out = remote_restore(store, remote, key, 0, 1)
        after = store.lookup(key)
        read = {n: store.read_artifact(after.manifest, n) for n in after.manifest.artifacts} if after.hit else {}
        return {
            "before": str(before.reason),
            "reason": out.reason,
            "nbytes": out.nbytes,
            "hit": after.hit,
            "generation": after.generation,
            "digests": digests(read),
            "counters": store.stats().counters,
            "components": store.entry(key).components if after.hit else None,
        }


def on_host(fn, *args: Any) -> Any:
    """Run ``fn(*args)`` in a fresh spawned process (another "host"), inheriting the environment."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


def pipeline_host(
    root: str, ckpt: str, env: dict[str, str], model: dict[str, Any], compile: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One host running the reference pipeline with a remote tier; its events and a digest of its outputs.

    ``compile``: the compile stage's options (default: the reference pipeline's, eager).
    """
    os.environ.update(env)
    import torch

    from adstore.integration.pipeline.optimizer import InferenceOptimizer
    from adstore.integration.reference.models import ModelFactory
    from adstore.integration.reference.pipeline import default_transforms
    from adstore.store import Store

    factory = ModelFactory.from_config(model)
    opt = InferenceOptimizer(
        factory, ckpt, default_transforms(pipeline_cache={"root": root}, **({"compile": compile} if compile else {}))
    )
    module = opt()
    with torch.no_grad():
        out = module(*factory.example_inputs())
    tensor = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if tensor is None:
        tensor = out[0]
    with Store.open(root) as store:
        counters = {k: v for k, v in store.stats().counters.items() if k.startswith("remote.")}
    return {
        "events": [e.to_dict() for e in opt.events],
        "output": hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest(),
        "counters": counters,
    }


def dist_rank_host(rank: int, world_size: int, port: int, job: dict[str, Any], queue: Any) -> None:
    """One rank of a gloo group, on its own "host": its own store root, the job's environment.

    With ``job["start"]`` (an event) every rank of every host starts the pipeline at the same moment;
    ``job["rank_env"][rank]`` is what only this rank sees.
    """
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(job["env"], MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(job.get("rank_env", {}).get(rank, {}))
    start = job.get("start")
    try:
        from adstore.integration.pipeline.optimizer import InferenceOptimizer  # noqa: F401  (imports before the start)

        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300 if start is not None else 120)
        )
        if start is not None:
            start.wait(300)
        result = pipeline_host(job["roots"][rank], job["checkpoint"], {}, job["model"])
        queue.put({"rank": rank, **result})
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _flight_host(
    barrier: Any,
    out: Any,
    root: str,
    ckpt: str,
    env: dict[str, str],
    model: dict[str, Any],
    compile: dict[str, Any] | None = None,
) -> None:
    import traceback

    try:
        os.environ.update(env)
        from adstore.integration.pipeline.optimizer import InferenceOptimizer  # noqa: F401  (imports before the start)

        barrier.wait(120)
        out.put(pipeline_host(root, ckpt, {}, model, compile))
    except BaseException:
        out.put({"error": traceback.format_exc()})


def cold_start_race(
    roots: list[str], ckpt: str, env: dict[str, str], model: dict[str, Any], compile: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """``len(roots)`` spawned hosts start the same cold pipeline at once; each one's :func:`pipeline_host` result."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(len(roots)), ctx.Queue()
    procs = [ctx.Process(target=_flight_host, args=(barrier, out, root, ckpt, env, model, compile)) for root in roots]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=600) for _ in roots]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def dist_hosts_race(jobs: list[dict[str, Any]], world_size: int, timeout: float = 900) -> list[list[dict[str, Any]]]:
    """Each job is one host of ``world_size`` gloo ranks; all hosts start the pipeline at once; results per host."""
    from concurrent.futures import ThreadPoolExecutor

    from adstore.integration.reference.demo import run_ranks

    start = multiprocessing.get_context("spawn").Barrier(len(jobs) * world_size)
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(run_ranks, {**job, "start": start}, world_size, target=dist_rank_host, timeout=timeout)
            for job in jobs
        ]
        return [sorted(f.result(), key=lambda r: r["rank"]) for f in futures]
