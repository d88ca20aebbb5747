"""Model factory: real transformers architectures on meta, through the reference pipeline."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from test_architectures import MATCHES

from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference.checkpoint import read_checkpoint, write_random_checkpoint
from adstore.integration.reference.models import ARCHITECTURES, ModelFactory, tiny_config
from adstore.integration.reference.pipeline import default_transforms
from adstore.store.errors import ConfigError

FAST = ["llama", "mixtral"]
SLOW = [a for a in ARCHITECTURES if a not in FAST]


def _pipeline_matches_eager(arch, tmp_path, hidden=64):
    factory = ModelFactory.from_config({"arch": arch, "layers": 2, "hidden": hidden})
    meta = factory.build()
    assert all(p.device.type == "meta" for p in meta.parameters())
    ckpt = write_random_checkpoint(meta, tmp_path / arch, seed=2)
    opt = InferenceOptimizer(factory, ckpt, default_transforms(pipeline_cache={"enabled": False}))
    module = opt()
    x = factory.example_inputs()
    with torch.no_grad():
        out = module(*x)
        ref = factory.eager_model(read_checkpoint(ckpt))(*x).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert opt.info["match_rms_norm"]["matches"] == MATCHES[arch][0]  # 0 where the rewrite does not apply
    return opt


@pytest.mark.parametrize("arch", FAST)
def test_pipeline_output_equals_eager(arch, tmp_path):
    opt = _pipeline_matches_eager(arch, tmp_path)
    if arch != "gemma":  # gemma's MLP is GeGLU, not SwiGLU
        assert opt.info["match_swiglu"]["matches"] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("arch", SLOW)
def test_pipeline_output_equals_eager_more_architectures(arch, tmp_path):
    _pipeline_matches_eager(arch, tmp_path)


def test_identity_covers_config_and_kwargs():
    a = ModelFactory.from_config({"arch": "llama"})
    assert a.identity() == ModelFactory(config=tiny_config("llama")).identity()
    # Computed from the mapping: spelling out a default is another key (a miss, never a wrong hit).
    spelled = ModelFactory(config={**tiny_config("llama"), "rms_norm_eps": a.hf_config().rms_norm_eps})
    assert a.identity() != spelled.identity()
    assert a.identity()["model_type"] == "llama"
    assert a.identity() != ModelFactory.from_config({"arch": "llama", "layers": 3}).identity()
    eager = ModelFactory.from_config({"arch": "llama", "model_kwargs": {"attn_implementation": "eager"}})
    assert a.identity()["config"] == eager.identity()["config"]
    assert a.identity() != eager.identity()


def test_identity_and_example_inputs_do_not_import_transformers():
    code = (
        "import sys; from adstore.integration.reference.models import ModelFactory\n"
        "for arch in ('llama', 'phi3', 'gemma3'):  # tuned, surveyed, surveyed composite\n"
        "    f = ModelFactory.from_config({'arch': arch}); f.identity(); f.example_inputs()\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_factory_rejects_bad_input():
    with pytest.raises(ConfigError, match="not surveyed"):
        ModelFactory.from_config({"arch": "gpt9"})
    with pytest.raises(ConfigError, match="unknown option"):
        ModelFactory.from_config({"arch": "llama", "layer": 2})
    with pytest.raises(ConfigError, match="unsupported kwargs"):
        ModelFactory.from_config({"arch": "llama", "model_kwargs": {"trust_remote_code": True}})
    with pytest.raises(ConfigError):
        ModelFactory.from_config({"arch": "llama", "hidden": 33})


def test_tp_plan_and_heads():
    f = ModelFactory.from_config({"arch": "llama", "hidden": 128})
    plan = f.tp_plan()
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    assert f.attention_shape() == {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
