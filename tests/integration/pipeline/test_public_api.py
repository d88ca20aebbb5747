"""The public API caches pipelines adstore did not write (docs/pipeline-cache.md, "Public API").

Only ``adstore.integration``'s exports and ``adstore.store`` are used; the
user's side (a ``transformers`` model, ``torch.export``, an FX pass, a wrapper
class) is in ``public_api_user.py``.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import public_api_user as user
import pytest
import torch
import torch.multiprocessing as mp

from adstore.integration import (
    CachedPrefix,
    PipelineCache,
    PipelineContext,
    cached_prefix,
    checkpoint_fingerprint,
    environment_fingerprint,
)
from adstore.store import Store

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return user.write_checkpoint(tmp_path_factory.mktemp("ckpt"))


def kinds(result: CachedPrefix) -> list[tuple[str, str | None]]:
    return [(e.kind, e.reason) for e in result.events]


def fresh_process(
    checkpoint: Path, root: Path, out: Path, *extra: str
) -> tuple[torch.Tensor, list[tuple[str, str | None]]]:
    """Run the user's cached pipeline in a new interpreter; its output and events."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    code = "import sys, public_api_user as u; sys.exit(u.main(sys.argv[1:]))"
    subprocess.run(
        [sys.executable, "-c", code, str(checkpoint), str(root), str(out), *extra], env=env, check=True, timeout=600
    )
    events = json.loads(out.read_text())
    return torch.load(out.with_suffix(".pt")), [(e["kind"], e["reason"]) for e in events]


def test_a_transformers_export_pipeline_restarts_from_the_cache(checkpoint, tmp_path):
    root = tmp_path / "store"
    cold, cold_events = fresh_process(checkpoint, root, tmp_path / "cold.json")
    warm, warm_events = fresh_process(checkpoint, root, tmp_path / "warm.json")
    assert cold_events == [("miss", "absent"), ("save", None)]
    assert warm_events == [("hit", None)]
    with torch.no_grad():
        uncached = user.load_weights(user.build(), checkpoint)(user.example_ids())
    assert torch.equal(cold, warm) and torch.equal(warm, uncached)
    store = Store.open(root)
    (listed,) = store.entries()
    entry = store.entry(listed.key)
    assert entry.namespace == "pipeline" and {"model", "checkpoint", "prefix", "env", "dist"} <= set(entry.components)


@pytest.mark.slow
def test_the_compile_step_of_a_cached_prefix_restores_its_engine_on_a_restart(checkpoint, tmp_path):
    root = tmp_path / "store"
    cold, cold_events = fresh_process(checkpoint, root, tmp_path / "cold.json", "compile")
    warm, warm_events = fresh_process(checkpoint, root, tmp_path / "warm.json", "compile")
    assert cold_events == [("miss", "absent"), ("save", None), ("miss", "absent"), ("save", None)]
    assert warm_events == [("hit", None), ("hit", None)]
    assert json.loads((tmp_path / "warm.imports").read_text()) == {
        "torch._dynamo": False,
        "torch._inductor": False,
        "transformers": False,
    }
    assert torch.equal(cold, warm)
    with torch.no_grad():
        eager = user.load_weights(user.build(), checkpoint)(user.example_ids())
    torch.testing.assert_close(warm, eager, rtol=0, atol=1e-4)


def test_the_key_holds_checkpoint_and_environment(checkpoint):
    fp = checkpoint_fingerprint(checkpoint)
    assert [f["name"] for f in fp["files"]] == ["model.safetensors"]
    env = environment_fingerprint([user.fuse_swiglu])
    assert env["torch"] == torch.__version__ and f"{user.__name__}.fuse_swiglu" in env["code"]


def test_a_user_wrapper_is_cached_under_its_prefix(tmp_path):
    built = []

    def build():
        built.append(1)
        return user.scaled_linear()

    key = {"model": "scaled-linear"}
    cold = cached_prefix(key, build, root=tmp_path, allowed_prefixes=[user.PREFIX])
    warm = cached_prefix(key, build, root=tmp_path, allowed_prefixes=[user.PREFIX])
    assert kinds(cold) == [("miss", "absent"), ("save", None)] and not cold.hit
    assert kinds(warm) == [("hit", None)] and warm.hit and warm.key == cold.key and len(built) == 1
    assert isinstance(warm.module, user.Scaled) and warm.module.scale == 2.0
    assert warm.module.inner.weight.device.type == "meta"
    untrusted = cached_prefix(key, build, root=tmp_path)  # fail open: build runs
    assert kinds(untrusted)[0] == ("miss", "untrusted_target") and len(built) == 2
    assert isinstance(untrusted.module, user.Scaled)


def test_restore_and_save_switch_off_as_bypasses(tmp_path):
    key = {"model": "scaled-linear"}
    unsaved = cached_prefix(key, user.scaled_linear, root=tmp_path, save=False)
    assert kinds(unsaved) == [("miss", "absent"), ("bypass", "save_disabled")] and unsaved.key is not None
    fresh = cached_prefix(key, user.scaled_linear, root=tmp_path, restore=False, allowed_prefixes=[user.PREFIX])
    assert kinds(fresh) == [("bypass", "restore_disabled"), ("save", None)] and fresh.key == unsaved.key


def test_a_refused_root_is_a_bypass_and_build_runs(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # world-writable: a store the cache refuses
    result = cached_prefix({"model": "scaled-linear"}, user.scaled_linear, root=shared)
    assert kinds(result) == [("miss", "unsafe_root"), ("bypass", "unsafe_root")]
    assert isinstance(result.module, user.Scaled) and result.event.kind == "bypass"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = cached_prefix({"model": "scaled-linear"}, user.scaled_linear, root=not_a_dir)
    assert result.event.kind == "bypass" and result.event.reason is not None


def test_an_error_of_build_propagates(tmp_path):
    def build():
        raise ValueError("the user's bug")

    with pytest.raises(ValueError, match="the user's bug"):
        cached_prefix({"model": "x"}, build, root=tmp_path)


@pytest.mark.parametrize("key", [{"model": object()}, {"model": {1.5: "x"}}, {"env": {}}, ["model"]])
def test_a_key_that_cannot_be_hashed_is_a_bypass(tmp_path, key):
    result = cached_prefix(key, user.scaled_linear, root=tmp_path)
    assert kinds(result) == [("miss", "key_error"), ("bypass", "key_error")] and result.key is None
    assert isinstance(result.module, user.Scaled)


def test_a_third_party_optimizer_drives_the_cache_point(checkpoint, tmp_path):
    """The ``CachePoint`` protocol alone: bind the prefix, ask to restore, save at the point."""

    class Source:
        def identity(self):
            return {"arch": "LlamaForCausalLM", "config": user.CONFIG}

    prefix = [("export", {"seq": user.SEQ}), ("fuse_swiglu", {})]

    def optimize():
        cache = PipelineCache(
            PipelineCache.config_cls.from_dict({"root": str(tmp_path), "allowed_prefixes": [user.PREFIX]})
        )
        ctx = PipelineContext(factory=Source(), checkpoint=checkpoint)
        cache.bind(copy.deepcopy(prefix), [user.fuse_swiglu])
        module = cache.restore(ctx)
        if module is None:
            t0 = time.perf_counter()
            module = cache.save(user.build(), ctx, prefix_seconds=time.perf_counter() - t0)
        with torch.no_grad():
            return user.load_weights(module, checkpoint)(user.example_ids()), cache.events

    cold, cold_events = optimize()
    warm, warm_events = optimize()
    assert [(e.kind, e.reason) for e in cold_events] == [("miss", "absent"), ("save", None)]
    assert [(e.kind, e.reason) for e in warm_events] == [("hit", None)]
    assert torch.equal(cold, warm)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_agree_over_gloo(tmp_path):
    root = tmp_path / "store"
    outcomes = []
    for run in ("cold", "warm"):
        out = tmp_path / run
        out.mkdir()
        mp.spawn(user.rank_main, args=(2, _free_port(), str(root), str(out)), nprocs=2, join=True)
        events = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
        outcomes.append([[(e["kind"], e["reason"], e["rank"], e["world_size"]) for e in ev] for ev in events])
    cold, warm = outcomes
    assert cold == [[("miss", "absent", r, 2), ("save", None, r, 2)] for r in range(2)]
    assert warm == [[("hit", None, r, 2)] for r in range(2)]
