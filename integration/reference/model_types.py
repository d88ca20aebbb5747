"""Small configs for any ``transformers`` causal-LM model type, and which ones the pipeline handles.

The eleven architectures of :data:`~adstore.integration.reference.models.ARCHITECTURES`
have hand-written configs (the seed design's models first) that need no
transformers import.  Every other model type is sized down from its own config
class's defaults by :func:`small_config`, and the factory accepts it only if
the survey (``python -m adstore.integration.reference.survey``) found that the
whole reference pipeline runs it: cold and warm against a store, within float
tolerance of eager ``transformers``, and again with ``compile`` on
``torch_compile``.  The survey's verdicts are in
:mod:`~adstore.integration.reference.survey_results`; a refused type is
refused with the survey's reason.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

from adstore.store import ConfigError

__all__ = ["RUNTIME_CHECKED", "installed_transformers", "lookup", "recipe", "small_config"]

_log = logging.getLogger(__name__)

_HIDDEN = ("hidden_size", "n_embd", "d_model", "n_embed", "dim")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
_N_HEADS = 4  # attention heads of every small config (head dim ``hidden // 4``), half as many KV heads
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "encoder_attention_heads")


def _rules(layers: int, hidden: int) -> dict[tuple[str, ...], Any]:
    """Config field names (as the config classes spell them) -> small value.

    Four heads of ``hidden // 4`` with two KV heads (grouped-query attention
    stays exercised); MoE with four experts, two per token and one shared;
    multi-head latent attention sized like ``models._mla``.
    """
    heads = _N_HEADS
    return {
        _HIDDEN: hidden,
        _LAYERS: layers,
        _HEADS: heads,
        ("num_key_value_heads", "multi_query_group_num", "n_kv_heads", "num_kv_heads"): heads // 2,
        ("head_dim", "attention_head_dim", "rotary_dim"): hidden // heads,
        (
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "ffn_hidden_size",
            "d_ff",
            "decoder_ffn_dim",
            "encoder_ffn_dim",
        ): hidden * 2,
        (
            "moe_intermediate_size",
            "expert_intermediate_size",
            "shared_expert_intermediate_size",
            "moe_ffn_hidden_size",
        ): hidden // 2,
        ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"): 4,
        ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k"): 2,
        ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"): 1,
        ("first_k_dense_replace", "n_group", "topk_group"): 1,
        ("vocab_size",): 512,
        ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"): 256,
        ("kv_lora_rank",): hidden // 2,
        ("q_lora_rank",): hidden * 3 // 4,
        ("qk_nope_head_dim", "v_head_dim"): hidden // 2,
        ("qk_rope_head_dim",): hidden // 4,
        ("linear_key_head_dim", "linear_value_head_dim"): hidden // 4,
        ("linear_num_key_heads", "linear_num_value_heads"): 2,
        ("tie_word_embeddings",): False,
    }


def _per_layer(value: list[Any], layers: int, n: int) -> list[Any]:
    """A per-layer list of ``n`` layers cut to ``layers``: every kind it names, in order of first use,
    while room lasts.

    A strictly increasing list of ints below ``n`` names layers (``moe_layers``, ``full_attn_idxs``):
    the ones below ``layers`` stay.  Any other list of ints holds a value per layer (heads per
    layer, an intermediate size per layer, ``no_rope_layers`` flags) and keeps one per layer.
    """
    if all(type(v) is int for v in value) and value == sorted(set(value)) and all(0 <= v < n for v in value):
        return [v for v in value if v < layers]
    try:
        kinds = list(dict.fromkeys(value))
    except TypeError:  # unhashable entries: plain truncation
        return value[:layers]
    return kinds[:layers] + value[len(kinds) :][: max(0, layers - len(kinds))]


def _shrink(defaults: dict[str, Any], layers: int, hidden: int) -> dict[str, Any]:
    """The small overrides for one config (sub-configs of a composite model shrunk alike)."""
    out: dict[str, Any] = {}
    for names, value in _rules(layers, hidden).items():
        for name in names:
            if name in defaults and not isinstance(defaults[name], (dict, list)):
                out[name] = value
    if "kv_lora_rank" in defaults:  # multi-head latent attention: no grouped KV heads
        out.update({k: _N_HEADS for k in ("num_key_value_heads",) if k in defaults})
        out.update({k: hidden // 4 for k in ("head_dim",) if k in defaults})  # the rotary tables' dim
    n = next((defaults[k] for k in _LAYERS if isinstance(defaults.get(k), int)), None)
    for key, value in defaults.items():
        if isinstance(value, list) and n and len(value) == n and key not in out:
            out[key] = _per_layer(value, layers, n)
        elif isinstance(value, dict) and "model_type" in value:
            out[key] = {**value, **_shrink(value, layers, hidden)}
    if defaults.get("sliding_window"):
        out["sliding_window"] = 16
    vocab = out.get("vocab_size", defaults.get("vocab_size"))
    spare = (vocab or 512) - 1
    for key in sorted(defaults):
        v = defaults[key]
        if (
            key.endswith(("token_id", "token_index"))
            and isinstance(v, int)
            and not isinstance(v, bool)
            and vocab
            and v >= vocab
        ):
            out[key], spare = (0, spare) if key == "pad_token_id" else (spare, spare - 1)
    return out


def recipe(defaults: dict[str, Any]) -> dict[str, Any]:
    """The part of a config's defaults that :func:`_shrink` reads (so the survey can record it)."""
    names = {n for names in _rules(2, 64) for n in names} | {"kv_lora_rank", "sliding_window"}
    n = next((defaults[k] for k in _LAYERS if isinstance(defaults.get(k), int)), None)
    return {
        k: v
        for k, v in defaults.items()
        if k in names
        or k.endswith(("token_id", "token_index"))
        or (isinstance(v, list) and n and len(v) == n)
        or (isinstance(v, dict) and "model_type" in v)
    }


def small_config(model_type: str, *, layers: int = 2, hidden: int = 64) -> dict[str, Any]:
    """A small config dict for any transformers model type, from its config class's defaults.

    A surveyed type's defaults come from the survey's record, so a restart that
    only needs the config (to compute its cache key) never imports transformers.
    """
    from adstore.integration.reference import survey_results as surveyed

    defaults = surveyed.RECIPES.get(model_type)
    if defaults is None:
        from transformers import AutoConfig

        try:
            defaults = AutoConfig.for_model(model_type).to_dict()
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError("arch", f"transformers has no config for {model_type!r}: {exc}") from exc
    return {"model_type": model_type, **_shrink(defaults, layers, hidden)}


#: The refusal that the pipeline's own check makes true on every run: export refuses tensor
#: constants whose values the meta device lost (``stages.ExportToGraph``).  Whether a model type
#: loses them depends on how its transformers release writes ``forward``, so under another release
#: than the verdict's the model type is built and that check decides.
RUNTIME_CHECKED = "whose values are lost"


def lookup(model_type: str) -> tuple[bool, str]:
    """``(True, "")`` if the pipeline handles ``model_type`` as far as the survey knows, else ``(False, why)``.

    Every verdict names the transformers release it was measured on.  A refusal
    for values lost on the meta device is trusted only under that release;
    under another one the model is accepted and export's check refuses it
    again, with the same error, if its values are still lost.
    """
    from adstore.integration.reference import survey_results as surveyed

    if model_type in surveyed.HANDLED:
        return True, ""
    why = surveyed.REFUSED.get(model_type)
    if why is not None:
        measured = next(r for r, types in surveyed.MEASURED_WITH.items() if model_type in types)
        installed = installed_transformers()
        if RUNTIME_CHECKED in why and installed is not None and installed != measured:
            _log.info(
                "%s was refused under transformers %s (%s); %s is installed, so export's check decides",
                model_type,
                measured,
                RUNTIME_CHECKED,
                installed,
            )
            return True, ""
        return False, f"the reference pipeline does not handle {model_type!r} (transformers {measured}): {why}"
    return False, (
        f"{model_type!r} was not surveyed (transformers {surveyed.TRANSFORMERS}); "
        "`python -m adstore.integration.reference.survey " + model_type + "` checks it"
    )


def installed_transformers() -> str | None:
    """The installed transformers release, read from its metadata (no import: restarts never pay for it)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
