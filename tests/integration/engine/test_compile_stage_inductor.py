"""The compile stage with ``backend="torch_compile"``: a standalone artifact and its kernels travel with the entry.

A cold run compiles the stage's graph with ``standalone_compile(aot=True)``
in a private Inductor cache directory and stores the serialized artifact and
the shared objects Inductor built; a restart with an empty Inductor cache of
its own (a new host) places them and loads the artifact without tracing
(Dynamo traces no frame) and without building a kernel, with bit-identical
outputs.  A damaged, missing or foreign artifact is a miss with its reason,
a compile, and is replaced.  The interpreter and venv bind-mounted at another
path (a mount namespace) load it too without building a kernel.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from stage_child import MODEL, kinds, run_child

from adstore.integration.engine.inductor import NAMESPACE, STANDALONE
from adstore.integration.reference.checkpoint import write_random_checkpoint
from adstore.integration.reference.demo import forget
from adstore.integration.reference.models import ModelFactory
from adstore.store import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("inductor-stage")
    ckpt = write_random_checkpoint(ModelFactory.from_config(MODEL).build(), work / "ckpt", seed=0)
    return {
        "model": MODEL,
        "checkpoint": str(ckpt),
        "root": str(work / "store"),
        "compile": {"backend": "torch_compile"},
        "work": str(work),
    }


def run(job: dict, name: str) -> dict:
    """A restart with an Inductor cache directory of its own, empty: as on a new host."""
    return run_child(job, env={"TORCHINDUCTOR_CACHE_DIR": os.path.join(job["work"], f"inductor-{name}")})


@pytest.fixture(scope="module")
def cold(job) -> dict:
    report = run(job, "cold")
    assert kinds(report) == [("miss", "absent"), ("save", None), ("miss", "absent"), ("save", None)]
    assert "standalone_compile" in report["events"][3]["detail"], report["events"][3]["detail"]
    return report


def bundle_path(job: dict):
    with Store.open(job["root"]) as store:
        (key,) = [e.key for e in store.entries(namespace=NAMESPACE)]
        return store.blob_path(store.manifests(key)[0].artifacts[STANDALONE].digest)


def hits_again(job: dict, cold: dict, name: str) -> None:
    again = run(job, name)
    assert kinds(again) == [("hit", None), ("hit", None)], kinds(again)
    assert "0 shared objects built" in again["events"][1]["detail"] and again["output"] == cold["output"]


def test_a_restart_with_an_empty_inductor_cache_loads_the_artifact_without_tracing(job, cold):
    warm = run(job, "warm")
    assert kinds(warm) == [("hit", None), ("hit", None)], kinds(warm)
    assert warm["events"][1]["source"] == "local"
    detail = warm["events"][1]["detail"]
    assert detail.startswith("standalone artifact") and "0 shared objects built" in detail, detail
    assert warm["output"] == cold["output"] and warm["module"] == "StandaloneModule"
    # torch's loader lives in torch._dynamo, so it is imported; it traces nothing
    assert warm["dynamo_frames"] == 0 and cold["dynamo_frames"] == 0, (warm["dynamo_frames"], cold["dynamo_frames"])


def test_a_restart_with_the_interpreter_at_another_path_builds_no_kernel(job, cold, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the mount-namespace helpers
    from other_users import moved_argv

    moved = moved_argv(tmp_path / "moved")
    if moved is None:
        pytest.skip("needs root and mount namespaces (unshare -m)")
    prefix, python = moved
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(job["work"], "inductor-moved")}
    again = run_child(job, env=env, python=python, prefix=prefix)
    assert kinds(again) == [("hit", None), ("hit", None)], kinds(again)
    detail = again["events"][1]["detail"]
    assert "0 shared objects built" in detail and again["output"] == cold["output"], detail


def test_a_corrupted_artifact_is_a_miss_and_is_replaced(job, cold):
    path = bundle_path(job)
    os.chmod(path, 0o600)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x20
    path.write_bytes(bytes(data))
    damaged = run(job, "corrupt")
    assert kinds(damaged)[1:] == [("miss", "corrupt_engine"), ("save", None)], kinds(damaged)
    assert damaged["output"] == cold["output"]
    hits_again(job, cold, "corrupt-again")


def test_a_missing_artifact_is_a_miss_and_is_replaced(job, cold):
    bundle_path(job).unlink()
    missing = run(job, "missing")
    assert kinds(missing)[1:] == [("miss", "engine_unavailable"), ("save", None)], kinds(missing)
    hits_again(job, cold, "missing-again")


def test_an_artifact_written_by_another_user_is_never_loaded(job, cold):
    if os.geteuid() != 0:
        pytest.xfail("needs root to create a blob owned by another uid")  # CI runs as root
    os.chown(bundle_path(job), 54321, -1)
    foreign = run(job, "foreign")
    assert kinds(foreign)[1:] == [("miss", "untrusted_engine"), ("save", None)], kinds(foreign)
    assert "uid 54321" in foreign["events"][1]["detail"]


def test_files_stored_by_a_process_that_compiled_before_are_complete(job, cold):
    """Inductor probes the CPU's vector ISA once per process, compiling small programs into its cache;
    a second compile in one process must still store them, or every restart from its files builds
    them again (seconds).  The process is a fresh one: what an earlier compile of another kind
    left in a process (the test runner's) is not what this checks."""
    with Store.open(job["root"]) as store:
        forget(store, cold["events"][0]["key"])
    twice = run_child({**job, "runs": 2}, env={"TORCHINDUCTOR_CACHE_DIR": os.path.join(job["work"], "inductor-twice")})
    assert kinds(twice)[-2:] == [("miss", "absent"), ("save", None)], kinds(twice)
    restart = run(job, "after-two")
    assert kinds(restart) == [("hit", None), ("hit", None)]
    assert "0 shared objects built" in restart["events"][1]["detail"], restart["events"][1]["detail"]
