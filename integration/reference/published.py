"""Published model configurations, as config dicts (nothing is downloaded).

The ``config.json`` of five public checkpoints, trimmed to the fields
``transformers`` reads to build the model (no quantisation, no remote code).
They run the reference pipeline at real size on the meta device
(``tests/benchmarks/bench_scale.py``) with header-only checkpoints
(:func:`~adstore.integration.reference.checkpoint.write_header_checkpoint`);
:func:`published_factory` with ``layers`` cuts one down to a few layers of the
real shapes for tests.
"""

from __future__ import annotations

import copy
from typing import Any

from adstore.integration.reference.models import ModelFactory
from adstore.store import ConfigError

__all__ = ["PUBLISHED", "published_config", "published_factory"]

_LLAMA3 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}

#: Name -> config dict (``meta-llama/Meta-Llama-3-8B`` and ``-70B``, ``mistralai/Mixtral-8x7B-v0.1``,
#: ``Qwen/Qwen3-30B-A3B``, ``deepseek-ai/DeepSeek-V3``).
PUBLISHED: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
    },
    "llama-3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1e6,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 32000,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "initializer_range": 0.02,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "v_head_dim": 128,
        "vocab_size": 129280,
    },
}

#: The dtype the five checkpoints are published in.
DTYPE = "bfloat16"


def published_config(name: str, *, layers: int | None = None, **overrides: Any) -> dict[str, Any]:
    """A copy of :data:`PUBLISHED` ``[name]``; ``layers`` keeps only the first layers (shapes stay real)."""
    if name not in PUBLISHED:
        raise ConfigError("model", f"no published config {name!r}; known: {sorted(PUBLISHED)}")
    cfg = copy.deepcopy(PUBLISHED[name])
    if layers is not None:
        if type(layers) is not int or layers < 1:
            raise ConfigError("model.layers", f"need a positive layer count, got {layers!r}")
        cfg["num_hidden_layers"] = layers
        if "first_k_dense_replace" in cfg:  # keep at least one MoE layer
            cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], layers - 1)
    cfg.update(overrides)
    return cfg


def published_factory(
    name: str,
    *,
    layers: int | None = None,
    dtype: str = DTYPE,
    experts_implementation: str | None = None,
    **overrides: Any,
) -> ModelFactory:
    """The :class:`~adstore.integration.reference.models.ModelFactory` of a published config.

    ``experts_implementation`` names another of transformers' experts
    implementations than the factory's default (``"batched_mm"``, for comparisons).
    """
    kwargs = {"torch_dtype": dtype}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    return ModelFactory(config=published_config(name, layers=layers, **overrides), model_kwargs=kwargs)
