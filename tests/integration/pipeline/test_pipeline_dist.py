"""The pipeline cache across 2 ranks: spawned processes, gloo on 127.0.0.1, one real store.

Failures are injected inside the rank processes (a snapshot or load that
raises, a rank that SIGKILLs itself right after publishing its manifest); the
store, the snapshots and the collectives are the real ones.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import numpy as np
import pytest
import torch

from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference.checkpoint import read_checkpoint, write_random_checkpoint
from adstore.integration.reference.demo import run_ranks
from adstore.integration.reference.models import ModelFactory
from adstore.integration.reference.pipeline import default_transforms
from adstore.store import Store

# hidden 128 -> 4 query heads, 2 KV heads: GQA, so sharding rewrites head counts.
MODEL = {"arch": "llama", "layers": 2, "hidden": 128}


def _inject(fault):
    """Patch one failure into this process; returns an undo callable."""
    import adstore.integration.snapshot as snap
    from adstore.integration.errors import CorruptSnapshot

    if fault == "save_fail":
        original = snap.dump_module

        def dump_module(module):
            raise OSError(5, "injected write failure")

        snap.dump_module = dump_module
        return lambda: setattr(snap, "dump_module", original)
    if fault == "restore_fail":
        original = snap.load_module

        def load_module(artifacts, **kw):
            raise CorruptSnapshot("injected corrupt payload")

        snap.load_module = load_module
        return lambda: setattr(snap, "load_module", original)
    if fault == "kill_after_publish":  # the manifest's row and record written, then dead before agreeing
        from adstore.store.records.sync import RecordWriter

        original = RecordWriter.published

        def published(self, *a, **kw):
            original(self, *a, **kw)
            os.kill(os.getpid(), signal.SIGKILL)

        RecordWriter.published = published
        return lambda: setattr(RecordWriter, "published", original)
    raise ValueError(fault)


def _worker(rank, world_size, port, job, queue):
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=job["timeout"]))
    runs = []
    try:
        factory = ModelFactory.from_config(job["model"])
        for spec in job["runs"]:
            undo = _inject(spec["fault"]) if spec.get("fault") and spec.get("fault_rank") == rank else None
            try:
                tr = default_transforms(
                    pipeline_cache={"root": job["root"], "extra": spec.get("extra", {})},
                    export_to_gm=spec.get("export", {}),
                )
                opt = InferenceOptimizer(factory, job["checkpoint"], tr)
                module = opt()
                with torch.no_grad():
                    out = module(*factory.example_inputs(**spec.get("inputs", {})))
            finally:
                if undo:
                    undo()
            runs.append(
                {
                    "events": [(e.kind, e.reason) for e in opt.events],
                    "key": opt.cache.key(opt.ctx).key,
                    "resumed_at": opt.resumed_at,
                    "sharding": opt.info.get("tp_sharding"),
                    "output": out.numpy().tobytes(),
                    "shape": list(out.shape),
                }
            )
        queue.put({"rank": rank, "runs": runs})
    except BaseException:
        queue.put({"rank": rank, "runs": runs, "error": traceback.format_exc()})
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    factory = ModelFactory.from_config(MODEL)
    ckpt = write_random_checkpoint(factory.build(), tmp_path_factory.mktemp("ckpt2"), seed=3)
    return factory, ckpt


def _job(root, ckpt, runs, timeout=120, model=MODEL):
    return {"model": model, "checkpoint": str(ckpt), "root": str(root), "runs": runs, "timeout": timeout}


def _out(run):
    return torch.from_numpy(np.frombuffer(run["output"], dtype=np.float32).copy()).reshape(run["shape"])


def _key(factory, ckpt, root, extra=None):
    tr = default_transforms(pipeline_cache={"root": str(root), "extra": extra or {}})
    return InferenceOptimizer(factory, ckpt, tr, rank=0, world_size=2).cache_key().key


def test_two_ranks_cold_warm_and_failures(setup, tmp_path):
    factory, ckpt = setup
    root = tmp_path / "store"
    runs = [
        {},  # 0 cold: miss + save
        {},  # 1 warm: hit
        {"extra": {"case": "f"}, "fault": "save_fail", "fault_rank": 1},  # 2 save fails on rank 1
        {"extra": {"case": "f"}},  # 3 clean miss + save
        {"extra": {"case": "f"}, "fault": "restore_fail", "fault_rank": 1},  # 4 restore fails on rank 1
        {"extra": {"case": "f"}},  # 5 hit again
    ]
    results = run_ranks(_job(root, ckpt, runs), 2, target=_worker, timeout=600)
    for r in results:
        assert "error" not in r, r["error"]
    r0, r1 = results[0]["runs"], results[1]["runs"]
    for runs_of_rank in (r0, r1):
        assert runs_of_rank[0]["events"] == [("miss", "absent"), ("save", None)]
        assert runs_of_rank[1]["events"] == [("hit", None)]
        assert runs_of_rank[1]["resumed_at"] == "load_weights"
        assert runs_of_rank[0]["sharding"]["colwise"] == 10 and runs_of_rank[0]["sharding"]["rowwise"] == 4
        # injected save failure on rank 1: every rank bypasses, nothing committed
        assert runs_of_rank[2]["events"][0] == ("miss", "absent")
        assert runs_of_rank[2]["events"][1][0] == "bypass"
        assert runs_of_rank[3]["events"] == [("miss", "absent"), ("save", None)]
        # injected restore failure on rank 1: every rank runs the full pipeline (and re-saves)
        assert runs_of_rank[4]["events"][0][0] == "miss"
        assert runs_of_rank[4]["events"][1] == ("save", None)
        assert runs_of_rank[4]["resumed_at"] is None
        assert runs_of_rank[5]["events"] == [("hit", None)]
        # bit-identical outputs whether restored or not
        assert all(run["output"] == runs_of_rank[0]["output"] for run in runs_of_rank)
    assert r1[2]["events"][1] == ("bypass", "io_error")
    assert r0[2]["events"][1] == ("bypass", "peer_save_failed")
    assert r1[4]["events"][0] == ("miss", "corrupt_snapshot")
    assert r0[4]["events"][0] == ("miss", "peer_restore_failed")
    # sharded output equals the unsharded eager model within float tolerance
    ref = factory.eager_model(read_checkpoint(ckpt))(*factory.example_inputs()).logits
    torch.testing.assert_close(_out(r0[0]), ref, rtol=1e-4, atol=1e-5)
    assert r0[0]["key"] == r1[0]["key"] == _key(factory, ckpt, root)
    store = Store.open(root)
    hit = store.lookup(r0[0]["key"])
    assert hit.hit and set(hit.manifests) == {0, 1}
    assert len({m.generation for m in hit.manifests.values()}) == 1


@pytest.mark.slow  # three 2-rank launches and a gloo timeout on the survivor
def test_rank_killed_mid_save_leaves_nothing_restorable(setup, tmp_path):
    factory, ckpt = setup
    root = tmp_path / "store"
    key = _key(factory, ckpt, root)
    killed = run_ranks(
        _job(root, ckpt, [{"fault": "kill_after_publish", "fault_rank": 1}], timeout=30),
        2,
        target=_worker,
        timeout=600,
        allow_dead=True,
    )
    assert killed[1].get("exitcode") == -signal.SIGKILL
    store = Store.open(root)
    res = store.lookup(key, count=False)
    assert not res.hit
    assert not store.lookup(key, rank=0, count=False).hit
    assert not store.lookup(key, rank=1, count=False).hit
    assert all(not m.committed for m in store.manifests(key))
    # the next run is a clean miss on both ranks, then a save that is restorable
    again = run_ranks(_job(root, ckpt, [{}, {}]), 2, target=_worker, timeout=600)
    for r in again:
        assert "error" not in r, r["error"]
        assert r["runs"][0]["events"][0][0] == "miss"
        assert r["runs"][0]["events"][1] == ("save", None)
        assert r["runs"][1]["events"] == [("hit", None)]
    assert store.lookup(key, count=False).hit


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "gemma", "mixtral", "glm4_moe", "qwen3_moe", "qwen3_5_moe"])
def test_more_architectures_shard_and_restore(arch, tmp_path):
    model = {"arch": arch, "layers": 2, "hidden": 128}
    factory = ModelFactory.from_config(model)
    ckpt = write_random_checkpoint(factory.build(), tmp_path / "ckpt", seed=4)
    results = run_ranks(_job(tmp_path / "store", ckpt, [{}, {}], model=model), 2, target=_worker, timeout=900)
    for r in results:
        assert "error" not in r, r["error"]
        cold, warm = r["runs"]
        assert cold["events"] == [("miss", "absent"), ("save", None)] and warm["events"] == [("hit", None)]
        assert cold["output"] == warm["output"]
        assert cold["sharding"]["rowwise"] >= 2
        # Qwen3.5's gated full attention (q_proj also emits the gate, then chunk) is not
        # followed by the tracker: that region stays replicated, the rest is sharded.
        assert (cold["sharding"]["replicated_regions"] > 0) == (arch == "qwen3_5_moe")
    ref = factory.eager_model(read_checkpoint(ckpt))(*factory.example_inputs()).logits
    torch.testing.assert_close(_out(results[0]["runs"][0]), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_dynamic_shapes_shard_and_restore(setup, tmp_path):
    factory, ckpt = setup
    spec = {"export": {"dynamic": True}, "inputs": {"batch": 3, "seq": 5}}
    results = run_ranks(_job(tmp_path / "store", ckpt, [spec, spec]), 2, target=_worker, timeout=900)
    for r in results:
        assert "error" not in r, r["error"]
        cold, warm = r["runs"]
        assert cold["events"] == [("miss", "absent"), ("save", None)] and warm["events"] == [("hit", None)]
        assert cold["output"] == warm["output"] and cold["shape"] == [3, 5, 512]
    x = factory.example_inputs(batch=3, seq=5)
    ref = factory.eager_model(read_checkpoint(ckpt))(*x).logits
    torch.testing.assert_close(_out(results[0]["runs"][0]), ref, rtol=1e-4, atol=1e-5)
