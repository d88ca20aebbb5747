"""The grouped experts implementation: transformers' eager loop bit for bit, without per-pair weight copies."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from adstore.integration.pipeline.graphs import graph_modules
from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference import experts
from adstore.integration.reference.checkpoint import read_checkpoint, write_random_checkpoint
from adstore.integration.reference.models import ModelFactory
from adstore.integration.reference.pipeline import default_transforms

#: The tuned architectures with mixture-of-experts blocks (hidden 64: the MLA ones' tiny attention needs it).
MOE = ["mixtral", "qwen3_moe", "qwen3_5_moe", "glm4_moe", "glm4_moe_lite", "deepseek_v3", "gemma4_moe"]
#: Pipelines within float rounding of eager, whatever the experts: Qwen3.5's exported gated-delta-rule
#: (linear attention) rounds differently from its eager run, with batched_mm experts too.
NOT_EXACT = {"qwen3_5_moe"}


def _factories(arch):
    model = {"arch": arch, "layers": 2, "hidden": 64}
    ours = ModelFactory.from_config(model)
    assert ours.hf_config()._experts_implementation == experts.EXPERTS_IMPLEMENTATION
    eager = ModelFactory.from_config({**model, "model_kwargs": {"experts_implementation": "eager"}})
    return ours, eager


@pytest.mark.parametrize("arch", MOE)
def test_equals_transformers_eager_experts_bit_for_bit(arch, tmp_path):
    ours, eager = _factories(arch)
    ckpt = write_random_checkpoint(ours.build(), tmp_path / "ckpt", seed=7)
    state = read_checkpoint(ckpt)
    x = ours.example_inputs(batch=3, seq=8)  # 24 tokens over 4 experts: every expert gets several
    with torch.no_grad():
        ref = eager.eager_model(state)(*x).logits
        assert torch.equal(ours.eager_model(state)(*x).logits, ref)  # transformers running our implementation
        module = InferenceOptimizer(
            ours, ckpt, default_transforms(pipeline_cache={"enabled": False}, export_to_gm={"batch": 3})
        )()
        if arch in NOT_EXACT:
            torch.testing.assert_close(module(*x), ref, rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(module(*x), ref)  # the exported, rewritten, fused graph


def test_expert_weights_are_only_read_by_the_grouped_linears():
    """No gather of expert weights per token–expert pair: memory stays the routed activations."""
    factory = ModelFactory.from_config({"arch": "mixtral", "layers": 2, "hidden": 64})
    transforms = default_transforms(
        pipeline_cache={"enabled": False},
        **{n: {"enabled": False} for n in ("load_weights", "fuse_linears", "init_cache", "compile")},
    )
    ((_, gm),) = graph_modules(InferenceOptimizer(factory, "unused", transforms)())
    weights = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith(("gate_up_proj", "down_proj"))]
    assert len(weights) == 4
    for node in weights:
        assert {u.target for u in node.users} == {torch.ops.adstore.grouped_linear.default}
    sorts = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sort.stable]
    assert len(sorts) == 2  # one routing sort per MoE layer


def test_other_implementations_stay_selectable_and_expert_parallel_is_refused():
    factory = ModelFactory.from_config({"arch": "mixtral", "model_kwargs": {"experts_implementation": "batched_mm"}})
    assert factory.hf_config()._experts_implementation == "batched_mm"
    block = ModelFactory.from_config({"arch": "mixtral"}).build(device="cpu").model.layers[0].mlp.experts
    block._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert-parallel"):
        block(torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2))


def test_naming_the_grouped_implementation_in_a_fresh_process_works():
    code = (
        "from adstore.integration.reference.models import ModelFactory\n"
        "f = ModelFactory.from_config({'arch': 'mixtral', 'model_kwargs': {'experts_implementation': "
        "'adstore_grouped'}})\n"
        "assert f.build().config._experts_implementation == 'adstore_grouped'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
