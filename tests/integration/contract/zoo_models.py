"""A model zoo nobody tuned adstore for: transformers architectures from small configs, random weights, offline.

Each entry builds a small model of its architecture from a config (no hub,
no download) with seeded random weights, and example inputs.  The contract
suite writes a ``contract_model`` module per zoo entry that delegates here
(:func:`module_source`), so the same child and tier adapters serve it.
Besides transformers models: an ``nn.Sequential``, a plain conv net with
batch norm, and a module whose ``forward`` calls a closure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ZOO", "build", "inputs", "module_source"]


def _vision(batch: int) -> dict[str, Any]:
    return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))}


def _tokens(batch: int, vocab: int = 96, length: int = 8, name: str = "input_ids") -> dict[str, Any]:
    return {name: torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))}


def _resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetModel

    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
    return ResNetModel(cfg)


def _convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextModel

    return ConvNextModel(ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    return ViTModel(cfg, add_pooling_layer=False)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return BertModel(cfg, add_pooling_layer=False)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64))


def _t5() -> nn.Module:
    from transformers import T5Config, T5Model

    cfg = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    return T5Model(cfg)


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralModel

    cfg = MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return MixtralModel(cfg)


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, stride=2), nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(pixel_values)))
        return self.pool(torch.relu(self.bn2(self.conv2(y)))).flatten(1)


def _scaled(k: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def scale(t: torch.Tensor) -> torch.Tensor:
        return t * k

    return scale


class _Closure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale = _scaled(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(torch.tanh(self.lin(x)))


def _features(batch: int) -> dict[str, Any]:
    return {"x": torch.randn(batch, 16, generator=torch.Generator().manual_seed(1))}


#: name -> (builder, inputs(batch) as keyword arguments)
ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[int], dict[str, Any]]]] = {
    "resnet": (_resnet, _vision),
    "convnext": (_convnext, _vision),
    "vit": (_vit, _vision),
    "bert": (_bert, _tokens),
    "gpt2": (_gpt2, _tokens),
    "t5": (_t5, lambda b: {**_tokens(b), **_tokens(b, name="decoder_input_ids", length=4)}),
    "mixtral": (_mixtral, _tokens),
    "sequential": (_sequential, lambda b: {"input": torch.randn(b, 16, generator=torch.Generator().manual_seed(1))}),
    "convnet": (_ConvNet, _vision),
    "closure": (_Closure, _features),
}


def build(name: str, dtype: str = "float32") -> nn.Module:
    torch.manual_seed(0)
    model = ZOO[name][0]().eval()
    return model.to(getattr(torch, dtype))


def inputs(name: str, spec: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kwargs = ZOO[name][1](int(spec.get("batch", 2)))
    if name == "sequential":  # nn.Sequential.forward takes its input positionally
        return (kwargs["input"],), {}
    return (), kwargs


def module_source(name: str) -> str:
    """The ``contract_model`` module of zoo entry ``name`` (the child's interface: ``build``, ``inputs``)."""
    return (
        '"""Written by tests/integration/contract/zoo_models.py."""\n\n'
        "import zoo_models\n\n"
        "SCALE = 1.0\n\n\n"
        "def build(dtype='float32', **knobs):\n"
        f"    return zoo_models.build({name!r}, dtype)\n\n\n"
        "def inputs(spec):\n"
        f"    return zoo_models.inputs({name!r}, spec)\n"
    )
