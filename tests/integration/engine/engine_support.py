"""The model, input and lookup helper every engine-cache test module shares (importable by path).

Kept out of the test modules so that a fresh interpreter (``subprocess``
children of the hashing and environment tests) can import the exact model
and input the shared first compile used, without importing a test module.
"""

from __future__ import annotations

import hashlib

import torch

from adstore.integration.engine.cache import EngineCache
from adstore.integration.engine.storage import EngineStorage

__all__ = ["MLP", "MLPRenamed", "X", "digests", "lookup_in", "make_model"]


class MLP(torch.nn.Module):
    """Linear/ReLU/Linear with a buffer and a constant written in forward()."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, hidden)
        self.fc2 = torch.nn.Linear(hidden, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = torch.tensor([0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.25, -0.25])
        return self.fc2(torch.relu(self.fc1(x))) * self.scale + offset


class MLPRenamed(MLP):
    def forward(self, inp: torch.Tensor) -> torch.Tensor:  # same graph, other input name
        offset = torch.tensor([0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.25, -0.25])
        return self.fc2(torch.relu(self.fc1(inp))) * self.scale + offset


def make_model(seed: int) -> MLP:
    torch.manual_seed(seed)
    m = MLP().eval()
    with torch.no_grad():
        m.scale.uniform_(0.5, 2.0)
    return m


def digests(model: torch.nn.Module) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in model.state_dict().items()
    }


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))


def lookup_in(backend: EngineStorage, model: torch.nn.Module):
    front = EngineCache(backend)
    try:
        return front.lookup(model, (X,))
    finally:
        front.close()
