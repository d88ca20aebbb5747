"""Every architecture the factory builds runs the whole reference pipeline.

For each one: the factory accepts it by name (and by its transformers
``model_type``), the pattern rewrites report how often they matched (a rewrite
that does not apply to an architecture says so instead of silently doing
nothing), and the pipeline with ``compile`` on ``torch_compile`` runs cold
(miss + save) and warm (restore) against the same store, both within float
tolerance of the eager ``transformers`` model.  The heavy compile runs are
marked slow except for Llama.
"""

from __future__ import annotations

import logging

import pytest
import torch

from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference.checkpoint import read_checkpoint, write_random_checkpoint
from adstore.integration.reference.models import ARCHITECTURES, MODEL_TYPES, ModelFactory
from adstore.integration.reference.pipeline import default_transforms
from adstore.store.errors import ConfigError

#: Matches per rewrite for a 2-layer model.  Zeros are architectures whose variant the
#: rewrite does not cover, bit for bit: Gemma's GeGLU is not SwiGLU, Gemma-4's RMSNorm
#: uses pow(-0.5) rather than rsqrt, and MLA models rotate interleaved pairs.
MATCHES = {
    "llama": (5, 2, 4),
    "qwen2": (5, 2, 4),
    "gemma": (5, 0, 4),
    "mixtral": (5, 2, 4),
    "qwen3_moe": (9, 2, 4),
    "qwen3_5_moe": (8, 5, 2),
    "glm4_moe": (5, 3, 4),
    "gemma4": (0, 0, 4),
    "gemma4_moe": (0, 0, 4),
    "glm4_moe_lite": (9, 3, 0),
    "deepseek_v3": (9, 3, 0),
}
REWRITES = ("match_rms_norm", "match_swiglu", "match_rope")
DEFAULT = {"llama", "gemma4"}


def _arch_params(default=DEFAULT):
    return [a if a in default else pytest.param(a, marks=pytest.mark.slow) for a in sorted(ARCHITECTURES)]


def test_every_architecture_is_accepted_by_name_and_model_type():
    assert set(MATCHES) == set(ARCHITECTURES)
    for arch in ARCHITECTURES:
        assert ModelFactory.from_config({"arch": arch}).config["model_type"]
    for model_type, arch in MODEL_TYPES.items():
        assert ModelFactory.from_config({"arch": model_type}).config == ModelFactory.from_config({"arch": arch}).config
    with pytest.raises(ConfigError, match="not surveyed"):
        ModelFactory.from_config({"arch": "no_such_model"})


def _checkpoint(factory, tmp_path):
    return write_random_checkpoint(factory.build(), tmp_path / "checkpoint", seed=0)


@pytest.mark.parametrize("arch", _arch_params())
def test_pattern_match_counts_are_reported(arch, tmp_path, caplog):
    factory = ModelFactory.from_config({"arch": arch})
    opt = InferenceOptimizer(
        factory, _checkpoint(factory, tmp_path), default_transforms(pipeline_cache={"enabled": False})
    )
    with caplog.at_level(logging.WARNING, logger="adstore.integration.reference.patterns"):
        opt()
    counts = tuple(opt.info[name]["matches"] for name in REWRITES)
    assert counts == MATCHES[arch]
    for name, count in zip(REWRITES, counts, strict=True):
        assert opt.info[name]["applied"] is (count > 0)
        said = [r for r in caplog.records if name in r.getMessage() and "matched nothing" in r.getMessage()]
        assert bool(said) is (count == 0), (name, count, [r.getMessage() for r in caplog.records])


@pytest.mark.parametrize("arch", _arch_params({"llama"}))
def test_torch_compile_pipeline_cold_and_warm_match_eager(arch, tmp_path):
    factory = ModelFactory.from_config({"arch": arch})
    checkpoint = _checkpoint(factory, tmp_path)
    transforms = default_transforms(
        pipeline_cache={"root": str(tmp_path / "store")}, compile={"backend": "torch_compile"}
    )
    inputs = factory.example_inputs(batch=2, seq=8)
    with torch.no_grad():
        expected = factory.eager_model(read_checkpoint(checkpoint))(*inputs).logits
    outputs = []
    for want in ("miss", "hit"):
        torch._dynamo.reset()
        opt = InferenceOptimizer(factory, checkpoint, transforms)
        module = opt()
        assert opt.events[0].kind == want, opt.events
        with torch.no_grad():
            outputs.append(module(*inputs))
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(outputs[0], outputs[1])
