"""Helpers shared by the snapshot tests (no tests here): meta-fying, round trips, HF builders."""

from __future__ import annotations

import copy

import torch

from adstore.integration.snapshot import dump_module, load_module

__all__ = ["to_meta", "real_state", "roundtrip", "build_hf", "export_hf", "HF_ARCHS"]


def to_meta(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every parameter by a meta parameter (keeping ties), like a pre-weight-loading module."""
    seen: dict[int, torch.nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in seen:
                seen[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            mod._parameters[name] = seen[id(p)]
    return module


def real_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def roundtrip(module: torch.nn.Module, **load_kw) -> tuple[torch.nn.Module, dict[str, bytes]]:
    art = dump_module(module)
    assert set(art) == {"module.pt", "hooks.json"}
    return load_module(art, **load_kw), art


HF_ARCHS = ("llama", "qwen2", "mixtral", "gemma")


def build_hf(arch: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer, hidden-64 causal LM of ``arch`` with random weights (no downloads)."""
    import transformers as tf

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    table = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 16}),
    }
    cfg_cls, model_cls, extra = table[arch]
    torch.manual_seed(seed)
    return model_cls(cfg_cls(**common, **extra)).eval()


def export_hf(arch: str, seq: int = 8):
    """(exported ``.module()``, real weights, example input_ids) for ``arch``."""
    model = build_hf(arch)
    ids = torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(1))
    gm = torch.export.export(model, (), {"input_ids": ids}).module()
    return gm, real_state(gm), ids


def clone_module(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module)
