"""Any transformers causal-LM model type by name: the survey's verdicts, and the factory that follows them.

The survey (``python -m adstore.integration.reference.survey``) runs the whole
reference pipeline on each model type; these tests hold its recorded verdicts
to what the pipeline does now (falcon's, without compile, in the default run;
a sample of both verdicts, compiled, in the slow tier), and check that the factory accepts exactly
the handled types and refuses the others with the survey's reason.
"""

from __future__ import annotations

import pytest
import transformers
from packaging.version import Version

from adstore.integration.errors import IntegrationError
from adstore.integration.pipeline.optimizer import InferenceOptimizer
from adstore.integration.reference import survey, survey_results
from adstore.integration.reference.checkpoint import write_random_checkpoint
from adstore.integration.reference.model_types import RUNTIME_CHECKED, installed_transformers
from adstore.integration.reference.models import ARCHITECTURES, ModelFactory, tiny_config
from adstore.integration.reference.pipeline import default_transforms
from adstore.store.errors import ConfigError

HANDLED, REFUSED = survey_results.HANDLED, survey_results.REFUSED


def test_every_causal_lm_type_has_a_verdict():
    assert not set(HANDLED) & set(REFUSED)
    assert all(len(m) == len(survey.REWRITES) for m in HANDLED.values())
    assert all(
        why.split(":", 1)[0] in ("config", "build", "eager", "pipeline", "torch_compile")
        or why.startswith(("no verdict", "the check died"))
        for why in REFUSED.values()
    )
    installed = set(survey.model_types())
    surveyed = set(HANDLED) | set(REFUSED)
    measured = [t for types in survey_results.MEASURED_WITH.values() for t in types]
    assert sorted(measured) == sorted(surveyed)  # every verdict names the one release it was measured on
    assert survey_results.TRANSFORMERS in survey_results.MEASURED_WITH
    if transformers.__version__ == survey_results.TRANSFORMERS:
        assert installed == surveyed
    # Another transformers may add types: those are refused until surveyed, and say so.
    for model_type in sorted(installed - surveyed)[:3]:
        with pytest.raises(ConfigError, match="not surveyed"):
            ModelFactory.from_config({"arch": model_type})
    # The seed design's models and the rest of the tuned set are handled under their transformers names.
    for model_type in (
        "qwen3_5_moe_text",
        "gemma4_text",
        "glm4_moe_lite",
        "deepseek_v3",
        "mixtral",
        "qwen3_moe",
        "llama",
        "qwen2",
    ):
        assert model_type in HANDLED, REFUSED.get(model_type)


def test_the_factory_accepts_handled_types_and_refuses_the_rest_with_the_reason():
    handled = sorted(t for t in HANDLED if t not in ARCHITECTURES)
    assert len(handled) > 100
    for model_type in handled[:5]:
        factory = ModelFactory.from_config({"arch": model_type})
        assert factory.config["model_type"] == model_type
    for model_type, why in sorted(REFUSED.items())[:5]:
        with pytest.raises(ConfigError) as err:
            ModelFactory.from_config({"arch": model_type})
        assert why[:60] in str(err.value) and "does not handle" in str(err.value)
    with pytest.raises(ConfigError, match="not surveyed"):
        ModelFactory.from_config({"arch": "no_such_model"})


@pytest.mark.parametrize("arch", [["llama"], 7, None, "", "../../etc/passwd", "llama\n"])
def test_hostile_architecture_names_are_config_errors(arch):
    with pytest.raises(ConfigError):
        ModelFactory.from_config({"arch": arch})


def test_layers_and_hidden_size_any_type():
    cfg = tiny_config("gemma3_text", layers=3, hidden=96)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (96, 3)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]  # every kind
    assert tiny_config("llama4_text")["moe_layers"] == [0, 1]  # layer indices stay below the layer count
    assert tiny_config("llama4_text")["no_rope_layers"] == [1, 0]  # a flag per layer: one per layer, every kind
    assert tiny_config("laguna", layers=3)["num_attention_heads_per_layer"] == [48, 48, 48]  # a value per layer
    assert cfg["num_attention_heads"] * cfg["head_dim"] == 96
    hf = ModelFactory(config=cfg).hf_config()
    assert hf.num_hidden_layers == 3 and hf.use_cache is False
    for bad in ({"layers": 0}, {"hidden": 48}, {"layers": "2"}, {"hidden": 64.0}, {"layers": True}):
        with pytest.raises(ConfigError):
            ModelFactory.from_config({"arch": "mistral", **bad})


def test_every_handled_type_has_a_small_config_this_transformers_accepts():
    """Every surveyed type the factory accepts gets a config its config class validates (a per-layer
    list keeps one entry per layer), so an accepted ``--arch`` never fails in transformers' checks."""
    for model_type in sorted(HANDLED):
        ModelFactory.from_config({"arch": model_type, "layers": 2, "hidden": 64}).hf_config()


def test_recorded_recipes_give_the_config_transformers_defaults_give():
    """A restart sizes a surveyed type's config from the survey's record, without importing transformers."""
    from transformers import AutoConfig

    from adstore.integration.reference.model_types import _shrink

    assert set(survey_results.RECIPES) == {t for t in HANDLED if t not in ARCHITECTURES}
    # A verdict measured on the installed release must match its defaults; under another, the record holds.
    same = set(survey_results.MEASURED_WITH.get(transformers.__version__, ()))
    for model_type in _sample(survey_results.RECIPES, 40) + ["gemma3", "qwen3_5", "deepseek_v2"]:
        recorded = tiny_config(model_type, layers=3, hidden=96)
        assert recorded["num_hidden_layers" if "num_hidden_layers" in recorded else "model_type"]
        if model_type in same:
            live = {"model_type": model_type, **_shrink(AutoConfig.for_model(model_type).to_dict(), 3, 96)}
            assert recorded == live, model_type


@pytest.mark.slow  # the default run checks a verdict without compile (falcon) and torch_compile on llama
def test_a_handled_type_runs_cold_warm_and_compiled_as_surveyed():
    verdict = survey.check("phi3")
    assert verdict["handled"], verdict
    assert verdict["matches"] == HANDLED["phi3"]


#: Falcon's attention indexes its fused QKV projection with a Python list inside ``forward``.  Up to
#: transformers 5.24 that list became a tensor on the parameters' device: on the meta device a constant
#: whose values export loses.  From 5.25 on falcon exports on the meta device and runs exactly.
FALCON_LOSES_VALUES = Version(transformers.__version__) < Version("5.25")


def test_falcon_is_refused_exactly_where_its_export_loses_values():
    verdict = survey.check("falcon", compile=False)
    if FALCON_LOSES_VALUES:
        assert not verdict["handled"] and RUNTIME_CHECKED in verdict["why"], verdict
    else:
        assert verdict["handled"], verdict


def test_export_refuses_tensor_constants_whose_values_are_lost(tmp_path):
    """GPT-Neo builds its causal mask's fill value inside forward: on the meta device it has no values,
    so the pipeline refuses it with a clear error instead of running with uninitialised memory."""
    factory = ModelFactory(config=tiny_config("gpt_neo", surveyed=False))
    checkpoint = write_random_checkpoint(factory.build(), tmp_path / "checkpoint", seed=0)
    opt = InferenceOptimizer(factory, checkpoint, default_transforms(pipeline_cache={"root": str(tmp_path / "s")}))
    with pytest.raises(IntegrationError, match=f"meta device, {RUNTIME_CHECKED}"):
        opt()


def _record(monkeypatch, model_type, why, measured):
    """A survey record that refused ``model_type`` for ``why`` under transformers ``measured``."""
    monkeypatch.delitem(survey_results.HANDLED, model_type, raising=False)
    monkeypatch.setitem(survey_results.REFUSED, model_type, why)
    releases = {r: tuple(t for t in types if t != model_type) for r, types in survey_results.MEASURED_WITH.items()}
    releases[measured] = (*releases.get(measured, ()), model_type)
    monkeypatch.setattr(survey_results, "MEASURED_WITH", releases)


def test_a_refusal_for_lost_values_is_trusted_only_under_the_release_it_was_measured_on(monkeypatch, tmp_path):
    lost = f"pipeline: IntegrationError: export made 4 tensor constant(s) on the meta device, {RUNTIME_CHECKED}"
    installed = installed_transformers()
    _record(monkeypatch, "falcon", lost, installed)
    with pytest.raises(ConfigError, match=f"does not handle 'falcon' \\(transformers {installed}\\)"):
        ModelFactory.from_config({"arch": "falcon"})
    # Recorded under an older release: the export check decides, and falcon is built.
    _record(monkeypatch, "falcon", lost, "5.24.0")
    assert ModelFactory.from_config({"arch": "falcon"}).config["model_type"] == "falcon"
    # ... and a model type whose export does lose values is still refused, by that check, with the same error.
    _record(monkeypatch, "gpt_neo", lost, "5.24.0")
    factory = ModelFactory.from_config({"arch": "gpt_neo"})
    checkpoint = write_random_checkpoint(factory.build(), tmp_path / "checkpoint", seed=0)
    opt = InferenceOptimizer(factory, checkpoint, default_transforms(pipeline_cache={"root": str(tmp_path / "s")}))
    with pytest.raises(IntegrationError, match=RUNTIME_CHECKED):
        opt()
    # Any other refusal is the survey's verdict whatever the release: the pipeline has no check that re-decides it.
    _record(monkeypatch, "falcon", "build: RuntimeError: its constructor does not run on the meta device", "5.24.0")
    with pytest.raises(ConfigError, match="does not handle 'falcon'"):
        ModelFactory.from_config({"arch": "falcon"})


def _sample(names, n):
    """Every k-th name: a fixed sample that spreads over the alphabet."""
    names = sorted(names)
    return names[:: max(1, len(names) // n)][:n]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type", _sample([t for t in HANDLED if t not in ARCHITECTURES], 12) + _sample(REFUSED, 6)
)
def test_recorded_verdicts_still_hold(model_type):
    verdict = survey._check_in_child(model_type, compile=True, timeout=900)
    if model_type in HANDLED:
        assert verdict["handled"], verdict
        assert verdict["matches"] == HANDLED[model_type]
    else:
        assert not verdict["handled"]
        assert verdict["why"].split(":", 1)[0] == REFUSED[model_type].split(":", 1)[0], verdict
