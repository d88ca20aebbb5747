"""The pipeline cache in one process: real transformers model, real store, real snapshots."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import pytest
import torch
from torch import fx, nn

from adstore.integration.pipeline import optimizer
from adstore.integration.pipeline.graphs import graph_modules
from adstore.integration.pipeline.optimizer import InferenceOptimizer, register_transform
from adstore.integration.pipeline.transforms import Stage, Transform, TransformConfig
from adstore.integration.reference.checkpoint import read_checkpoint, write_random_checkpoint
from adstore.integration.reference.models import ModelFactory
from adstore.integration.reference.pipeline import default_transforms, reference_registry
from adstore.integration.validity.keys import diff_components
from adstore.store import Store
from adstore.store.errors import ConfigError
from adstore.store.records.sync import RecordWriter

MODEL = {"arch": "llama", "layers": 2, "hidden": 64}


@pytest.fixture(scope="module")
def factory() -> ModelFactory:
    return ModelFactory.from_config(MODEL)


@pytest.fixture(scope="module")
def checkpoint(factory, tmp_path_factory):
    return write_random_checkpoint(factory.build(), tmp_path_factory.mktemp("ckpt"), seed=1)


@pytest.fixture
def root(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def registry_guard(monkeypatch):
    """A fresh default registry for the test: what it registers is gone afterwards."""
    monkeypatch.setattr(optimizer, "_default_registry", reference_registry())


def run(factory, checkpoint, transforms, **kw):
    opt = InferenceOptimizer(factory, checkpoint, transforms, **kw)
    module = opt()
    with torch.no_grad():
        out = module(*factory.example_inputs())
    return opt, module, out


def kinds(opt):
    return [(e.kind, e.reason) for e in opt.events]


def test_cold_equals_eager_and_warm_is_bit_identical(factory, checkpoint, root):
    tr = default_transforms(pipeline_cache={"root": str(root)})
    cold, _, out_cold = run(factory, checkpoint, tr)
    assert kinds(cold) == [("miss", "absent"), ("save", None)]
    assert cold.info["match_rms_norm"]["matches"] == 5 and cold.info["match_swiglu"]["matches"] == 2
    assert cold.info["match_rope"]["matches"] == 4  # q and k of each layer
    assert cold.info["fuse_linears"]["groups"] == 4  # q/k/v and gate/up per layer
    ref = factory.eager_model(read_checkpoint(checkpoint))(*factory.example_inputs()).logits
    torch.testing.assert_close(out_cold, ref, rtol=1e-5, atol=1e-5)

    warm, module, out_warm = run(factory, checkpoint, tr)
    assert kinds(warm) == [("hit", None)]
    assert warm.resumed_at == "load_weights"
    assert "export_to_gm" not in warm.timings and "build_model" not in warm.timings
    assert torch.equal(out_cold, out_warm)
    assert isinstance(module, fx.GraphModule)
    hit = warm.events[0]
    assert hit.bytes > 0 and hit.key == cold.events[1].key
    store = Store.open(root)
    store.flush()
    counters = store.stats().counters
    assert counters.get("hits", 0) >= 1 and counters.get("saves", 0) >= 1
    entry = store.entry(hit.key)
    assert entry is not None and entry.namespace == "pipeline" and entry.world_size == 1
    assert set(entry.components) >= {"model", "checkpoint", "prefix", "env", "extra"}


def test_post_cache_changes_reuse_the_entry(factory, checkpoint, root):
    run(factory, checkpoint, default_transforms(pipeline_cache={"root": str(root)}))
    changed = default_transforms(
        pipeline_cache={"root": str(root)},
        init_cache={"max_batch_size": 2, "max_seq_len": 64},
        fuse_linears={"enabled": False},
        load_weights={"strict": False},
    )
    opt, module, _ = run(factory, checkpoint, changed)
    assert kinds(opt) == [("hit", None)]
    assert module.kv_cache_0.shape[1] == 2 and module.kv_cache_0.shape[3] == 64
    opt2 = InferenceOptimizer(
        factory,
        checkpoint,
        default_transforms(pipeline_cache={"root": str(root)}, compile={"backend": "torch_compile"}),
    )
    assert opt2.cache_key().key == opt.events[0].key


def test_prefix_model_checkpoint_and_topology_changes_miss(factory, checkpoint, root, tmp_path):
    base_tr = default_transforms(pipeline_cache={"root": str(root)})
    base = InferenceOptimizer(factory, checkpoint, base_tr).cache_key()

    def key(f=factory, ck=checkpoint, tr=base_tr, **kw):
        return InferenceOptimizer(f, ck, tr, **kw).cache_key()

    prefix = key(tr=default_transforms(pipeline_cache={"root": str(root)}, export_to_gm={"seq": 16}))
    disabled = key(tr=default_transforms(pipeline_cache={"root": str(root)}, match_swiglu={"enabled": False}))
    kwargs = key(f=ModelFactory.from_config({**MODEL, "model_kwargs": {"attn_implementation": "eager"}}))
    overrides = key(f=ModelFactory.from_config({**MODEL, "overrides": {"rms_norm_eps": 1e-5}}))
    resharded = write_random_checkpoint(factory.build(), tmp_path / "sharded", seed=1, max_shard_bytes=64 * 1024)
    ckpt = key(ck=resharded)
    topo = key(rank=0, world_size=2)
    assert diff_components(base.components, prefix.components) == ["prefix"]
    assert diff_components(base.components, disabled.components) == ["prefix", "env"]  # its code leaves too
    assert diff_components(base.components, kwargs.components) == ["model"]
    assert diff_components(base.components, overrides.components) == ["model"]
    assert diff_components(base.components, ckpt.components) == ["checkpoint"]
    assert diff_components(base.components, topo.components) == ["dist"]
    assert len({k.key for k in (base, prefix, disabled, kwargs, overrides, ckpt, topo)}) == 7
    # Without sharding in the prefix the topology is not part of the key.
    early = default_transforms(pipeline_cache={"root": str(root), "stage": "pattern_matching"})
    assert key(tr=early).components["dist"] is None
    assert key(tr=early).key == key(tr=early, rank=0, world_size=2).key
    # A real run with a changed prefix is a miss, then saves its own entry.
    run(factory, checkpoint, base_tr)
    opt, _, _ = run(
        factory, checkpoint, default_transforms(pipeline_cache={"root": str(root)}, match_swiglu={"enabled": False})
    )
    assert kinds(opt) == [("miss", "absent"), ("save", None)]


def _write_transform_module(path, modname, body):
    path.joinpath(f"{modname}.py").write_text(
        "from adstore.integration.pipeline.optimizer import register_transform\n"
        "from adstore.integration.pipeline.transforms import Stage, Transform\n\n"
        "@register_transform\n"
        "class Custom(Transform):\n"
        "    name = 'custom_step'\n"
        "    stage = Stage.PATTERN_MATCHING\n\n"
        "    def apply(self, module, ctx):\n"
        f"        {body}\n"
        "        return module\n"
    )


def test_code_change_to_a_prefix_transform_misses(factory, checkpoint, root, tmp_path, monkeypatch, registry_guard):
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    tr = default_transforms(pipeline_cache={"root": str(root)})
    tr = {
        **{k: v for k, v in tr.items() if k != "pipeline_cache"},
        "custom_step": {},
        "pipeline_cache": tr["pipeline_cache"],
    }
    _write_transform_module(tmp_path, "adstore_custom_v1", "ctx.info['custom'] = 1")
    importlib.import_module("adstore_custom_v1")
    first, _, _ = run(factory, checkpoint, tr)
    assert kinds(first) == [("miss", "absent"), ("save", None)]
    again, _, _ = run(factory, checkpoint, tr)
    assert kinds(again) == [("hit", None)]
    _write_transform_module(tmp_path, "adstore_custom_v2", "ctx.info['custom'] = 2  # changed")
    importlib.import_module("adstore_custom_v2")  # re-registers 'custom_step' with new code
    changed, _, _ = run(factory, checkpoint, tr)
    assert kinds(changed) == [("miss", "absent"), ("save", None)]
    assert diff_components(first.cache.key(first.ctx).components, changed.cache.key(changed.ctx).components) == ["env"]


@dataclass(kw_only=True)
class _CountingConfig(TransformConfig):
    calls: int = 0
    seen: list = None  # type: ignore[assignment]


class _MutatesConfig(Transform):
    """A prefix transform that writes into its own config while running."""

    name = "mutating_step"
    stage = Stage.POST_EXPORT
    config_cls = _CountingConfig

    def apply(self, module, ctx):
        self.config.calls += 1
        self.config.seen = ["mutated", len(list(module.graph.nodes))]
        return module


def test_config_mutated_by_a_prefix_transform_still_hits(factory, checkpoint, root, registry_guard):
    register_transform(_MutatesConfig)
    tr = {"mutating_step": {}, **default_transforms(pipeline_cache={"root": str(root)})}
    first = InferenceOptimizer(factory, checkpoint, tr)
    key_before = first.cache_key().key
    first()
    assert first.transforms[[t.name for t in first.transforms].index("mutating_step")].config.calls == 1
    assert kinds(first) == [("miss", "absent"), ("save", None)]
    assert first.events[1].key == key_before
    second, _, _ = run(factory, checkpoint, tr)
    assert kinds(second) == [("hit", None)]


def _forward_hook(module, args, output):
    return output


class _AddsForwardHook(Transform):
    name = "adds_forward_hook"
    stage = Stage.PATTERN_MATCHING

    def apply(self, module, ctx):
        module.register_forward_hook(_forward_hook)
        return module


class _Materializes(Transform):
    name = "materializes"
    stage = Stage.PATTERN_MATCHING

    def apply(self, module, ctx):
        for _, gm in graph_modules(module):
            for qual, p in list(gm.named_parameters()):
                owner, _, leaf = qual.rpartition(".")
                gm.get_submodule(owner)._parameters[leaf] = nn.Parameter(
                    torch.zeros(p.shape, dtype=p.dtype), requires_grad=False
                )
        return module


@pytest.mark.parametrize("cls,reason", [(_AddsForwardHook, "forward_hook"), (_Materializes, "materialized_parameters")])
def test_unsupported_modules_bypass_and_leave_no_entry(factory, checkpoint, root, registry_guard, cls, reason):
    register_transform(cls)
    tr = {cls.name: {}, **default_transforms(pipeline_cache={"root": str(root)})}
    opt, _, out = run(factory, checkpoint, tr)
    assert kinds(opt) == [("miss", "absent"), ("bypass", reason)]
    assert out.shape == (2, 8, 512)
    store = Store.open(root)
    assert store.entry(opt.events[0].key) is None
    assert list(store.entries()) == []
    store.flush()
    assert store.stats().counters.get(f"bypasses.{reason}", 0) == 1


def test_publish_failure_fails_open_and_leaves_no_temp_files(factory, checkpoint, root, monkeypatch):
    def full_disk(self, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    # The disk fills after the manifest's index row, at its record: the one publish path aborts the row.
    monkeypatch.setattr(RecordWriter, "published", full_disk)
    opt, _, out = run(factory, checkpoint, default_transforms(pipeline_cache={"root": str(root)}))
    assert kinds(opt) == [("miss", "absent"), ("bypass", "io_error")]
    monkeypatch.undo()
    leftovers = [p for p in (root / "tmp").rglob("*") if p.is_file()] if (root / "tmp").exists() else []
    assert leftovers == []
    store = Store.open(root)
    assert not store.lookup(opt.events[0].key).hit
    assert store.entry(opt.events[0].key) is None and store.manifests(opt.events[0].key) == []
    assert list(store.entries()) == []
    again, _, out2 = run(factory, checkpoint, default_transforms(pipeline_cache={"root": str(root)}))
    assert kinds(again) == [("miss", "absent"), ("save", None)]
    assert torch.equal(out, out2)


def test_corrupt_blob_is_a_miss_and_the_pipeline_runs(factory, checkpoint, root):
    tr = default_transforms(pipeline_cache={"root": str(root)})
    cold, _, out = run(factory, checkpoint, tr)
    store = Store.open(root)
    manifest = store.lookup(cold.events[1].key).manifest
    path = store.blob_path(manifest.artifacts["module.pt"].digest)
    assert path is not None, "module.pt should be large enough to be a blob file"
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    warm, _, out2 = run(factory, checkpoint, tr)
    assert warm.events[0].kind == "miss" and warm.events[0].reason == "checksum"
    assert warm.events[-1].kind == "save"
    assert torch.equal(out, out2)


def test_unusable_root_fails_open(factory, checkpoint, tmp_path):
    bad = tmp_path / "not-a-dir"
    bad.write_text("a file where the store root should be")
    opt, _, out = run(factory, checkpoint, default_transforms(pipeline_cache={"root": str(bad)}))
    assert [e.kind for e in opt.events] == ["miss", "bypass"]
    assert all(e.reason for e in opt.events)
    assert out.shape == (2, 8, 512)


class Wrapper(nn.Module):
    """A non-graph wrapper holding the exported GraphModule as a child."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        return self.inner(input_ids)


class _Wrap(Transform):
    name = "wrap_graph"
    stage = Stage.POST_EXPORT

    def apply(self, module, ctx):
        return Wrapper(module)


def test_wrapper_with_graph_children_restores_with_types(factory, checkpoint, root, registry_guard):
    register_transform(_Wrap)
    tr = {
        "wrap_graph": {},
        **default_transforms(pipeline_cache={"root": str(root), "allowed_prefixes": [Wrapper.__module__ + "."]}),
    }
    cold, m1, out1 = run(factory, checkpoint, tr)
    assert kinds(cold) == [("miss", "absent"), ("save", None)]
    warm, m2, out2 = run(factory, checkpoint, tr)
    assert kinds(warm) == [("hit", None)]
    assert type(m2) is Wrapper and isinstance(m2.inner, fx.GraphModule)
    assert torch.equal(out1, out2)


def test_config_errors(factory, checkpoint, root):
    with pytest.raises(ConfigError, match="unknown option"):
        InferenceOptimizer(factory, checkpoint, default_transforms(export_to_gm={"sequence": 8}))
    with pytest.raises(ConfigError, match="expected an integer"):
        InferenceOptimizer(factory, checkpoint, default_transforms(export_to_gm={"seq": "8"}))
    with pytest.raises(ConfigError, match="before weight loading"):
        InferenceOptimizer(factory, checkpoint, default_transforms(pipeline_cache={"stage": "weight_loading"}))
    with pytest.raises(ConfigError, match="unknown transform"):
        InferenceOptimizer(factory, checkpoint, {"no_such_step": {}})
    with pytest.raises(ConfigError, match="backend"):
        InferenceOptimizer(factory, checkpoint, default_transforms(compile={"backend": "tensorrt"}))
    with pytest.raises(ConfigError):
        InferenceOptimizer.from_config({"model": {"arch": "nope"}, "checkpoint": str(checkpoint)})


def test_cache_point_is_ordered_at_the_end_of_its_stage(factory, checkpoint, root):
    tr = default_transforms(pipeline_cache={"root": str(root)})
    cache_first = {"pipeline_cache": tr["pipeline_cache"], **{k: v for k, v in tr.items() if k != "pipeline_cache"}}
    opt = InferenceOptimizer(factory, checkpoint, cache_first)
    assert [t.name for t in opt.transforms] == list(default_transforms())
    reversed_order = InferenceOptimizer(factory, checkpoint, dict(reversed(list(tr.items()))))
    names = [t.name for t in reversed_order.transforms]
    stages = [t.cache_stage if t.name == "pipeline_cache" else t.stage for t in reversed_order.transforms]
    assert stages == sorted(stages)
    assert names.index("pipeline_cache") == names.index("tp_sharding") + 1
    assert names.index("match_swiglu") < names.index("match_rms_norm")  # user order kept within a stage


def test_key_failure_fails_open(factory, checkpoint, root):
    tr = default_transforms(pipeline_cache={"root": str(root), "extra": {"not_json": object()}})
    opt, _, out = run(factory, checkpoint, tr)
    assert kinds(opt) == [("miss", "key_error"), ("bypass", "key_error")]
    assert out.shape == (2, 8, 512)
    assert list(Store.open(root).entries()) == []


def test_dynamic_shapes_restore_and_run_at_other_sizes(factory, checkpoint, root):
    tr = default_transforms(pipeline_cache={"root": str(root)}, export_to_gm={"dynamic": True, "max_seq": 64})
    eager = factory.eager_model(read_checkpoint(checkpoint))
    cold = InferenceOptimizer(factory, checkpoint, tr)
    m1 = cold()
    warm = InferenceOptimizer(factory, checkpoint, tr)
    m2 = warm()
    assert kinds(cold) == [("miss", "absent"), ("save", None)] and kinds(warm) == [("hit", None)]
    with torch.no_grad():
        for batch, seq in [(2, 8), (3, 5), (1, 17)]:
            x = factory.example_inputs(batch=batch, seq=seq)
            a, b = m1(*x), m2(*x)
            assert torch.equal(a, b)
            torch.testing.assert_close(a, eager(*x).logits, rtol=1e-5, atol=1e-5)
