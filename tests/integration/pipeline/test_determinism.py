"""Equal inputs give byte-identical snapshots: across processes, hash seeds, runs and ranks.

Each run is a fresh spawned process per rank (gloo between two ranks) with its
own ``PYTHONHASHSEED``, so set or dict order that follows hashes or memory
addresses (in the pipeline, or in the model's own forward, which export
records as it runs) shows up as different bytes.  The second cold run of a key (restore
off, so it runs the whole prefix again) saves into the same store: its blobs
must be the first run's, so the store still holds one copy of each.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from adstore.integration.reference.checkpoint import write_random_checkpoint
from adstore.integration.reference.demo import run_ranks
from adstore.integration.reference.models import ModelFactory
from adstore.store import Store

_AFTER_CACHE = ("load_weights", "fuse_linears", "init_cache", "compile")


def _cold(rank, world_size, port, job, queue):
    """One rank's cold prefix (no restore) up to the cache point; reports the blobs it saved."""
    import traceback

    try:
        if world_size > 1:
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        from adstore.integration.pipeline.optimizer import InferenceOptimizer
        from adstore.integration.reference.pipeline import default_transforms

        transforms = default_transforms(
            pipeline_cache={"root": job["root"], "restore": False},
            export_to_gm=job.get("export", {}),
            **{name: {"enabled": False} for name in _AFTER_CACHE},
        )
        opt = InferenceOptimizer(ModelFactory.from_config(job["model"]), job["checkpoint"], transforms)
        opt()
        key = opt.events[-1].key
        (manifest,) = [m for m in Store.open(job["root"]).manifests(key) if m.rank == rank and m.committed]
        queue.put(
            {
                "rank": rank,
                "events": [e.kind for e in opt.events],
                "key": key,
                "hash_seed": os.environ.get("PYTHONHASHSEED"),
                "digests": {name: ref.digest for name, ref in manifest.artifacts.items()},
            }
        )
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def _two_cold_runs(model, world_size, tmp_path, monkeypatch, export=None):
    factory = ModelFactory.from_config(model)
    ckpt = write_random_checkpoint(factory.build(), tmp_path / "ckpt", seed=1)
    job = {"model": model, "checkpoint": str(ckpt), "root": str(tmp_path / "store"), "export": export or {}}
    runs, blobs = [], []
    for seed in ("1", "2"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)  # spawned ranks start with this environment
        ranks = run_ranks(job, world_size, target=_cold, timeout=600)
        for r in ranks:
            assert "error" not in r, r["error"]
            assert r["events"] == ["bypass", "save"] and r["hash_seed"] == seed
        runs.append(ranks)
        with Store.open(job["root"]) as store:
            blobs.append(store.stats().blobs)
    return runs, blobs


# Gemma-4 MoE: its forward computes the rotary tables in ``set(layer_types)`` order, which follows the
# hash seed.  Mixtral at two ranks: experts, and the sharded attention with its inserted collectives.
@pytest.mark.parametrize(("arch", "world_size"), [("gemma4_moe", 1), ("mixtral", 2)])
def test_two_cold_runs_save_identical_blobs_once(arch, world_size, tmp_path, monkeypatch):
    runs, blobs = _two_cold_runs({"arch": arch, "layers": 2, "hidden": 128}, world_size, tmp_path, monkeypatch)
    first, second = runs
    assert [r["key"] for r in first] == [r["key"] for r in second]
    assert [r["digests"] for r in first] == [r["digests"] for r in second]
    assert blobs[0] == blobs[1]  # the second run's save stored nothing new
    if world_size == 2:
        # The ranks' graphs have equal shapes here: only the shard hooks (which rank) differ.
        assert first[0]["digests"]["module.pt"] == first[1]["digests"]["module.pt"]
        assert first[0]["digests"]["hooks.json"] != first[1]["digests"]["hooks.json"]
        assert blobs[0] == 3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_5_moe", "gemma4_moe", "glm4_moe", "llama-dynamic"])
def test_two_cold_runs_are_identical_on_more_architectures(arch, tmp_path, monkeypatch):
    arch, _, dynamic = arch.partition("-")  # a dynamic export: symbolic batch and sequence
    runs, blobs = _two_cold_runs(
        {"arch": arch, "layers": 2, "hidden": 128 if arch != "deepseek_v3" else 64},
        2,
        tmp_path,
        monkeypatch,
        export={"dynamic": True} if dynamic else None,
    )
    assert [r["digests"] for r in runs[0]] == [r["digests"] for r in runs[1]] and blobs[0] == blobs[1]
