"""The aoti compile stage at world size 2: spawned ranks over gloo on 127.0.0.1, one real store.

Each rank compiles its sharded graph, with the all-reduce and all-gather ops
inside the engine, and finds it again on a restart; the ranks agree: when
one rank has no engine, every rank compiles.  The sharded engines' output
equals the single-process eager model's within float tolerance (it could
not without the collectives running inside the engines).
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pytest
import torch

from adstore.integration.engine.index import EngineIndex
from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference.checkpoint import write_random_checkpoint
from adstore.integration.reference.demo import run_ranks
from adstore.integration.reference.models import ModelFactory
from adstore.integration.reference.pipeline import default_transforms
from adstore.store import Store

pytestmark = pytest.mark.slow

# hidden 128 -> 4 query heads, 2 KV heads: both split over 2 ranks.
MODEL = {"arch": "llama", "layers": 2, "hidden": 128}


def _worker(rank, world_size, port, job, queue):
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        factory = ModelFactory.from_config(job["model"])
        transforms = default_transforms(pipeline_cache={"root": job["root"]}, compile={"backend": "aoti"})
        opt = InferenceOptimizer(factory, job["checkpoint"], transforms)
        module = opt()
        with torch.no_grad():
            out = module(*factory.example_inputs(batch=2, seq=8))
        queue.put(
            {
                "rank": rank,
                "events": [(str(e.kind), e.reason and str(e.reason)) for e in opt.events],
                "sources": [str(e.source) for e in opt.events],
                "module": type(module).__name__,
                "output": out.detach().contiguous().numpy().tobytes(),
            }
        )
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        dist.destroy_process_group()


def _phase(job):
    results = run_ranks(job, 2, target=_worker, timeout=600)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return results


def test_each_rank_restores_its_engine_with_the_collectives_inside(tmp_path):
    factory = ModelFactory.from_config(MODEL)
    ckpt = write_random_checkpoint(factory.build(), tmp_path / "ckpt", seed=0)
    job = {"model": MODEL, "checkpoint": str(ckpt), "root": str(tmp_path / "store")}
    eager = InferenceOptimizer(factory, ckpt, default_transforms(pipeline_cache={"enabled": False}))()
    with torch.no_grad():
        expected = eager(*factory.example_inputs(batch=2, seq=8)).numpy().reshape(-1)

    cold = _phase(job)
    for r in cold:
        assert r["events"] == [("miss", "absent"), ("save", None), ("miss", "absent"), ("save", None)], r["events"]
        assert r["module"] == "EngineModule"
    warm = _phase(job)
    for r, c in zip(warm, cold, strict=True):
        assert r["events"] == [("hit", None), ("hit", None)] and r["sources"][1] == "local", r["events"]
        assert r["output"] == c["output"]
    np.testing.assert_allclose(np.frombuffer(warm[0]["output"], dtype=np.float32), expected, rtol=0, atol=1e-4)

    # rank 1 loses its index entry: rank 0 would hit, but every rank compiles (and indexes) again
    with Store.open(job["root"]) as store:
        entries = EngineIndex(store).entries_for(store_prefix_key(store))
        assert len(entries) == 2, entries
        rank1 = [k for k, _ in entries if store.entry(k).components["rank"]["rank"] == 1]
        store.plan_remove(rank1).execute()
    again = _phase(job)
    assert again[0]["events"] == [("hit", None), ("miss", "peer_miss"), ("save", None)], again[0]["events"]
    assert again[1]["events"] == [("hit", None), ("miss", "absent"), ("save", None)], again[1]["events"]
    np.testing.assert_allclose(np.frombuffer(again[0]["output"], dtype=np.float32), expected, rtol=0, atol=1e-4)
    last = _phase(job)
    assert [r["events"] for r in last] == [[("hit", None), ("hit", None)]] * 2


def store_prefix_key(store) -> str:
    (key,) = [e.key for e in store.entries(namespace="pipeline")]
    return key
