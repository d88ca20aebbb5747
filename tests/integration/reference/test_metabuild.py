"""The meta build: no parameter is materialised, and the same model and graph come out.

The reference is the previous build (constructed on the CPU, every parameter
moved to meta as it is registered): same parameters, the same non-persistent
buffer values, the same exported graph code.  Published configurations are
checked cut down to one layer (their rotary settings, which decide the buffer
values, stay real), and at full size, on the meta device, in the slow tier.
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference import metabuild, models
from adstore.integration.reference.models import ARCHITECTURES, ModelFactory
from adstore.integration.reference.pipeline import default_transforms
from adstore.integration.reference.published import PUBLISHED, published_factory

DEFAULT = {"llama", "mixtral", "deepseek_v3"}


def _previous_build(cls, config):
    with metabuild.meta_parameters():
        return cls(copy.deepcopy(config))


def _export(factory):
    transforms = default_transforms(pipeline_cache={"enabled": False})
    for name in list(transforms)[3:]:  # build, export, cleanup
        transforms[name]["enabled"] = False
    return InferenceOptimizer(factory, "unused", transforms)()


def _assert_same_model(new, old):
    specs = lambda m: {n: (p.shape, p.dtype, p.device.type) for n, p in m.named_parameters()}  # noqa: E731
    assert specs(new) == specs(old)
    assert all(p.is_meta for p in new.parameters())
    for path, mod in new.named_modules():
        for name, buf in mod._buffers.items():
            ref = old.get_submodule(path)._buffers[name]
            assert (buf.shape, buf.dtype) == (ref.shape, ref.dtype), f"{path}.{name}"
            if name in mod._non_persistent_buffers_set:
                assert buf.device.type == "cpu" and torch.equal(buf, ref), f"{path}.{name}"
            else:
                assert buf.is_meta, f"{path}.{name} is persistent: it comes from the checkpoint"


@pytest.mark.parametrize(
    "arch", [a if a in DEFAULT else pytest.param(a, marks=pytest.mark.slow) for a in sorted(ARCHITECTURES)]
)
def test_meta_build_gives_the_previous_model_and_graph(arch, monkeypatch):
    factory = ModelFactory.from_config({"arch": arch})
    new, gm_new = factory.build(), _export(factory)
    monkeypatch.setattr(models, "build_on_meta", _previous_build)
    old, gm_old = factory.build(), _export(factory)
    _assert_same_model(new, old)
    assert gm_new.code == gm_old.code


_SMALL = {  # every published config at one layer and a small width; the rotary settings stay as published
    "llama-3-8b": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "vocab_size": 512},
    "llama-3-70b": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "vocab_size": 512},
    "mixtral-8x7b": {"hidden_size": 256, "intermediate_size": 128, "num_attention_heads": 2, "vocab_size": 512},
    "qwen3-30b-a3b": {
        "hidden_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 16,
        "num_attention_heads": 8,
        "vocab_size": 512,
    },
    "deepseek-v3": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "n_routed_experts": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "vocab_size": 512,
    },
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_cut_down_build_the_previous_model(name, monkeypatch):
    assert set(_SMALL) == set(PUBLISHED)
    factory = published_factory(name, layers=1, **_SMALL[name])
    new = factory.build()
    monkeypatch.setattr(models, "build_on_meta", _previous_build)
    _assert_same_model(new, factory.build())


# -------------------------------------------------------------- the fallback, on models made to need it
def _tiny_model_class(init_rebuilds: str, constructor_needs_values: bool = False):
    from transformers import PretrainedConfig, PreTrainedModel

    class Config(PretrainedConfig):
        model_type = "adstore_metabuild_test"

    class Model(PreTrainedModel):
        config_class = Config

        def __init__(self, config):
            super().__init__(config)
            self.proj = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.normal(0.0, 1.0, size=(8,)))  # ignores the device context
            self.register_buffer("table", torch.arange(8.0) * 3, persistent=False)
            if constructor_needs_values:
                self.steps = [float(x) for x in torch.linspace(0, 1, 3)]
            self.post_init()

        def _init_weights(self, module):
            if module is self and init_rebuilds != "none":
                end = 8 if init_rebuilds == "all" else 4
                module.table[:end] = (torch.arange(8.0) * 3)[:end]

    return Model, Config


@pytest.mark.parametrize("case", ["rebuilt", "half_written", "not_rebuilt", "constructor_needs_values"])
def test_a_value_the_meta_build_would_lose_falls_back_to_the_previous_build(case, caplog):
    rebuilds = {"rebuilt": "all", "half_written": "half", "not_rebuilt": "none"}.get(case, "all")
    cls, config = _tiny_model_class(rebuilds, constructor_needs_values=case == "constructor_needs_values")
    with caplog.at_level(logging.INFO, logger=metabuild.__name__):
        model = metabuild.build_on_meta(cls, config())
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(model.table, torch.arange(8.0) * 3)
    fell_back = [r.getMessage() for r in caplog.records if "built on the CPU" in r.getMessage()]
    if case == "rebuilt":
        assert not fell_back
    else:
        assert len(fell_back) == 1
        assert ("does not run on the meta device" if case == "constructor_needs_values" else "table") in fell_back[0]


def test_a_tied_parameter_stays_tied():
    cls, config = _tiny_model_class("all")

    class Tied(cls):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.twin = nn.Linear(8, 8, bias=False)
            self.twin.weight = nn.Parameter(torch.normal(0.0, 1.0, size=(8, 8)))  # created on the CPU
            self.proj.weight = self.twin.weight

    model = metabuild.build_on_meta(Tied, config())
    assert model.proj.weight is model.twin.weight and model.twin.weight.is_meta


@pytest.mark.slow
def test_published_configs_build_at_full_size_in_little_memory():
    """Every published config, at its real size, on meta: 826 billion parameters in a few hundred MiB."""
    code = (
        "import resource\n"
        "from adstore.integration.reference.published import PUBLISHED, published_factory\n"
        "for name in PUBLISHED:\n"
        "    m = published_factory(name).build()\n"
        "    assert all(p.is_meta for p in m.parameters())\n"
        "    print(name, round(sum(p.numel() for p in m.parameters()) / 1e9, 1))\n"
        "print('rss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=600)
    lines = dict(line.rsplit(" ", 1) for line in out.stdout.strip().splitlines())
    assert {k: float(v) for k, v in lines.items() if k != "rss"} == {
        "llama-3-8b": 8.0,
        "llama-3-70b": 70.6,
        "mixtral-8x7b": 46.7,
        "qwen3-30b-a3b": 30.5,
        "deepseek-v3": 671.0,
    }
    assert int(lines["rss"]) < 1 << 30
