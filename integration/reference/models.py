"""Model factory: real ``transformers`` architectures built from a config dict.

The pipeline builds the model on the meta device (parameters and buffers carry
shapes, not data), so the expensive front half of the pipeline never touches
weights; the weights come later from a checkpoint.  The factory's
:meth:`ModelFactory.identity` is the ``model`` component of the cache key: the
architecture, the full config dict after defaults and the construction kwargs.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adstore.integration.reference import experts
from adstore.integration.reference.metabuild import build_on_meta
from adstore.store import ConfigError

__all__ = ["ARCHITECTURES", "MODEL_TYPES", "ModelFactory", "tiny_config"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")  # transformers model types: bert-generation, qwen3_5_moe


def _llama_like(model_type: str, layers: int, hidden: int, **extra: Any) -> dict[str, Any]:
    heads = max(2, hidden // 32)
    cfg = {
        "model_type": model_type,
        "vocab_size": 512,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(2, heads // 2),
        "head_dim": hidden // heads,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    cfg.update(extra)
    return cfg


def _moe(model_type: str, layers: int, hidden: int, **extra: Any) -> dict[str, Any]:
    return _llama_like(
        model_type,
        layers,
        hidden,
        num_local_experts=4,
        num_experts=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden // 2,
        **extra,
    )


#: Short architecture names -> builder of a small config dict (layers, hidden).
ARCHITECTURES: dict[str, Any] = {
    "llama": lambda n, h: _llama_like("llama", n, h),
    "qwen2": lambda n, h: _llama_like("qwen2", n, h),
    "gemma": lambda n, h: _llama_like("gemma", n, h),
    "mixtral": lambda n, h: _moe("mixtral", n, h),
    "qwen3_moe": lambda n, h: _moe("qwen3_moe", n, h, decoder_sparse_step=1, mlp_only_layers=[]),
    # Qwen3.5-MoE text model: hybrid linear (gated delta) + full attention layers.
    "qwen3_5_moe": lambda n, h: _moe(
        "qwen3_5_moe_text",
        n,
        h,
        shared_expert_intermediate_size=h // 2,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=h // 4,
        linear_value_head_dim=h // 4,
        full_attention_interval=2,
    ),
    "glm4_moe": lambda n, h: _moe(
        "glm4_moe", n, h, first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1
    ),
    # Gemma-4 text model: sliding-window and full-attention layers, with or without MoE blocks.
    "gemma4": lambda n, h: _gemma4(n, h),
    "gemma4_moe": lambda n, h: _gemma4(
        n, h, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=h // 2
    ),
    # Multi-head latent attention (low-rank q/kv, interleaved RoPE) with routed + shared experts.
    "glm4_moe_lite": lambda n, h: {
        **_moe(
            "glm4_moe_lite",
            n,
            h,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
        ),
        **_mla(h),
    },
    "deepseek_v3": lambda n, h: {
        **_moe("deepseek_v3", n, h, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1),
        **_mla(h),
    },
}

#: ``model_type`` spellings that name an architecture above.
MODEL_TYPES: dict[str, str] = {"qwen3_5_moe_text": "qwen3_5_moe", "gemma4_text": "gemma4"}


def _gemma4(layers: int, hidden: int, **extra: Any) -> dict[str, Any]:
    """A small Gemma-4 text config: sliding-window layers, the last one full attention."""
    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    return _llama_like(
        "gemma4_text", layers, hidden, sliding_window=16, hidden_size_per_layer_input=0, layer_types=types, **extra
    )


def _mla(hidden: int) -> dict[str, Any]:
    """Low-rank attention sizes for a small DeepSeek-V3 / GLM-4.7-lite config."""
    rope = hidden // 4
    return {
        "kv_lora_rank": hidden // 2,
        "q_lora_rank": hidden * 3 // 4,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": hidden // 2,
        "v_head_dim": hidden // 2,
        "head_dim": rope,
    }


def tiny_config(arch: str = "llama", *, layers: int = 2, hidden: int = 64, surveyed: bool = True) -> dict[str, Any]:
    """A small config dict for ``arch``: a tuned one (:data:`ARCHITECTURES`) or any transformers model type.

    A model type outside the tuned eleven is sized down from its transformers
    defaults (:func:`~adstore.integration.reference.model_types.small_config`)
    and accepted only if the survey found the pipeline handles it; otherwise the
    error says why.  ``surveyed=False`` skips that check (the survey itself).
    """
    if not isinstance(arch, str) or not _NAME.fullmatch(arch):
        raise ConfigError("arch", f"not an architecture name: {arch!r}")
    if any(type(v) is not int for v in (layers, hidden)) or layers < 1 or hidden < 32 or hidden % 32:
        raise ConfigError("hidden", f"need layers >= 1 and hidden a multiple of 32, got {layers=} {hidden=}")
    builder = ARCHITECTURES.get(MODEL_TYPES.get(arch, arch))
    if builder is not None:
        return builder(layers, hidden)
    from adstore.integration.reference import model_types

    if surveyed:
        handled, why = model_types.lookup(arch)
        if not handled:
            raise ConfigError(
                "arch",
                f"{why}. Tuned architectures: {sorted(ARCHITECTURES)}; another model "
                "may still run as ModelFactory(config={'model_type': ..., ...}) with its full config",
            )
    return model_types.small_config(arch, layers=layers, hidden=hidden)


@dataclass(frozen=True)
class ModelFactory:
    """Builds one ``transformers`` causal LM from a config dict.

    ``config`` holds ``model_type`` plus any config fields; ``model_kwargs`` are
    construction overrides (``attn_implementation``, ``torch_dtype``) that change
    the built model and are therefore part of the identity.
    """

    config: Mapping[str, Any]
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelFactory:
        """``{"arch": "llama", "layers": 2, "hidden": 64, "overrides": {...}, "model_kwargs": {...}}``."""
        allowed = {"arch", "layers", "hidden", "overrides", "model_kwargs"}
        unknown = set(config) - allowed
        if unknown:
            raise ConfigError("model", f"unknown option(s) {sorted(unknown)}; allowed {sorted(allowed)}")
        cfg = tiny_config(config.get("arch", "llama"), layers=config.get("layers", 2), hidden=config.get("hidden", 64))
        cfg.update(config.get("overrides", {}))
        return cls(config=cfg, model_kwargs=dict(config.get("model_kwargs", {})))

    def __post_init__(self) -> None:
        if "model_type" not in self.config:
            raise ConfigError("model.config", "needs a 'model_type' (e.g. 'llama')")
        unknown = set(self.model_kwargs) - {"attn_implementation", "torch_dtype", "experts_implementation"}
        if unknown:
            raise ConfigError("model.model_kwargs", f"unsupported kwargs {sorted(unknown)}")

    # ------------------------------------------------------------------ config
    def hf_config(self) -> Any:
        """The transformers config object (defaults filled in)."""
        from transformers import AutoConfig

        cfg = dict(self.config)
        model_type = cfg.pop("model_type")
        try:
            hf = AutoConfig.for_model(model_type, **cfg)
        except (ValueError, KeyError) as exc:
            raise ConfigError("model.config", f"transformers rejects the config: {exc}") from exc
        cls = self._model_class(hf)
        text = hf.get_text_config(decoder=True)
        hf.use_cache = text.use_cache = False
        # SDPA where the architecture has it (the attention the KV-cache and engine stages recognise),
        # else the architecture's own eager attention.
        default = "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"
        hf._attn_implementation = self.model_kwargs.get("attn_implementation", default)
        # A grouped GEMM over the routed tokens, bit-exact with transformers' eager loop (.experts).
        grouped = experts.register()  # registered whichever is asked for: a config may name it
        hf._experts_implementation = self.model_kwargs.get("experts_implementation", grouped)
        return hf

    @property
    def dtype(self) -> torch.dtype:
        name = self.model_kwargs.get("torch_dtype", "float32")
        dtype = getattr(torch, str(name).replace("torch.", ""), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError("model.model_kwargs.torch_dtype", f"not a torch dtype: {name!r}")
        return dtype

    def identity(self) -> dict[str, Any]:
        """The ``model`` key component: model type, the config mapping and the kwargs.

        Computed from the mapping alone, without importing transformers (about
        a second on a restart that restores and never builds).  The defaults
        transformers fills in are covered by its version in the ``env``
        component, so an upgrade that could change them is a miss; a config that
        spells out a default is another key than one that leaves it out (a
        miss, never a wrong hit).
        """
        return {
            "model_type": self.config["model_type"],
            "config": dict(self.config),
            "model_kwargs": dict(sorted(self.model_kwargs.items())),
        }

    def tp_plan(self) -> dict[str, str]:
        """Tensor-parallel plan by parameter-owner pattern (``*`` = layer index)."""
        hf = self.hf_config()
        text = hf.get_text_config(decoder=True)
        plan = {f"model.{k}": v for k, v in (getattr(text, "base_model_tp_plan", None) or {}).items()}
        plan.update(getattr(self._model_class(hf), "_tp_plan", None) or {})
        return plan

    def attention_shape(self) -> dict[str, int]:
        """Head counts the sharding transform checks divisibility against."""
        hf = self.hf_config().get_text_config(decoder=True)  # a composite model's language part
        heads = int(hf.num_attention_heads)
        return {
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(hf, "num_key_value_heads", None) or heads),
            "vocab_size": int(hf.vocab_size),
        }

    # ------------------------------------------------------------------- build
    @staticmethod
    def _model_class(hf: Any) -> type:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf)]
        except KeyError:
            raise ConfigError("model.config", f"no causal LM for {type(hf).__name__}") from None

    def build(self, *, device: str = "meta") -> nn.Module:
        """Build the model: on the meta device (no parameter allocated; :mod:`.metabuild`), or with random weights."""
        hf = self.hf_config()
        cls = self._model_class(hf)
        if not isinstance(hf, cls.config_class):
            hf = hf.get_text_config(
                decoder=True
            )  # a composite type whose causal LM is its language model alone (qwen3_5)
        if device == "meta":
            model = build_on_meta(cls, hf)
            for mod in model.modules():
                for name, p in list(mod._parameters.items()):
                    if p is not None and p.dtype.is_floating_point and p.dtype != self.dtype:
                        mod._parameters[name] = nn.Parameter(p.to(self.dtype), requires_grad=False)
        else:
            model = cls(copy.deepcopy(hf)).to(self.dtype)
        model.eval()
        log.debug("built %s on %s", cls.__name__, device)
        return model

    def eager_model(self, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
        """The reference eager model with ``state_dict`` loaded (for comparisons)."""
        model = self.build(device="cpu")
        model.load_state_dict(dict(state_dict), strict=True)
        return model.eval()

    def example_inputs(self, *, batch: int = 2, seq: int = 8, seed: int = 0) -> tuple[torch.Tensor]:
        """Token ids of the export / comparison shape (deterministic)."""
        gen = torch.Generator().manual_seed(seed)
        text = self.config.get("text_config")
        vocab = self.config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, Mapping) else None)
        vocab = int(vocab or self.hf_config().get_text_config(decoder=True).vocab_size)
        return (torch.randint(0, vocab, (batch, seq), generator=gen),)
