"""The compile stage with ``backend="aoti"``: cold then warm restarts in fresh processes, and a damaged engine.

A cold run compiles the module after the cache point into an AOTInductor
engine and indexes it under the pipeline's key; a warm restart finds it
through the index, without exporting, hashing or importing dynamo, Inductor
or transformers, and its output is bit-identical.  A corrupted engine is a
miss with its reason, a recompile, and is replaced.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from stage_child import HEAVY, MODEL, UNUSED, kinds, run_child

from adstore.integration.engine.storage import StoreEngineStorage
from adstore.integration.reference.checkpoint import write_random_checkpoint
from adstore.integration.reference.models import ModelFactory
from adstore.store import Store


def as_array(report: dict) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(report["output"]), dtype=np.float32)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("compile-stage")
    ckpt = write_random_checkpoint(ModelFactory.from_config(MODEL).build(), work / "ckpt", seed=0)
    return {"model": MODEL, "checkpoint": str(ckpt), "root": str(work / "store"), "compile": {"backend": "aoti"}}


@pytest.fixture(scope="module")
def cold_warm(job) -> tuple[dict, dict]:
    return run_child(job), run_child(job)


def test_cold_compiles_and_indexes_then_a_warm_restart_restores_bit_identical(job, cold_warm):
    cold, warm = cold_warm
    assert kinds(cold) == [("miss", "absent"), ("save", None), ("miss", "absent"), ("save", None)]
    assert cold["events"][3]["source"] == "compiled" and cold["module"] == "EngineModule"
    assert kinds(warm) == [("hit", None), ("hit", None)]
    assert warm["events"][1]["source"] == "local" and warm["module"] == "EngineModule"
    assert warm["output"] == cold["output"]
    # a warm restart neither exports nor hashes nor compiles: none of the libraries that would are imported,
    # nor, with no remote configured, the remote tier or the store's maintenance passes
    assert warm["imported"] == dict.fromkeys((*HEAVY, *UNUSED), False)
    eager = run_child({**job, "compile": {"backend": "eager"}})
    assert kinds(eager) == [("hit", None)] and eager["module"] == "GraphModule"
    np.testing.assert_allclose(as_array(warm), as_array(eager), rtol=0, atol=1e-4)


def test_a_corrupted_engine_is_a_miss_is_compiled_again_and_replaced(job, cold_warm):
    cold, _ = cold_warm
    with Store.open(job["root"]) as store:
        (engine,) = [e.key for e in store.entries(namespace=StoreEngineStorage.NAMESPACE)]
        pkg = store.manifests(engine)[0].artifacts[StoreEngineStorage.PACKAGE_ARTIFACT]
        path = store.blob_path(pkg.digest)
    os.chmod(path, 0o600)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    damaged = run_child(job)
    assert kinds(damaged) == [("hit", None), ("miss", "corrupt_engine"), ("save", None)]
    assert damaged["module"] == "EngineModule"
    np.testing.assert_allclose(as_array(damaged), as_array(cold), rtol=0, atol=1e-6)
    again = run_child(job)  # the engine was replaced: a hit again
    assert kinds(again) == [("hit", None), ("hit", None)]
    assert again["output"] == damaged["output"]
