"""Local safetensors checkpoints of the reference pipeline: write random weights, read them.

The fingerprint (the ``checkpoint`` key component) lives in
``adstore.integration.pipeline.fingerprints`` and is re-exported here, so the
pipeline cache needs nothing from the reference pipeline.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path

import torch
from torch import nn

from adstore.integration.pipeline.fingerprints import INDEX_NAME, checkpoint_files, checkpoint_fingerprint
from adstore.store import ConfigError, atomic_write

__all__ = [
    "INDEX_NAME",
    "checkpoint_files",
    "checkpoint_fingerprint",
    "random_state_dict",
    "read_checkpoint",
    "write_random_checkpoint",
]

log = logging.getLogger(__name__)


def random_state_dict(model: nn.Module, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random tensors for every entry of ``model.state_dict()``.

    Works on a meta model (only shapes are read).  Each tensor gets its own
    generator seeded from its name, so values do not depend on iteration order.
    Matrices are scaled by ``1/sqrt(fan_in)`` so activations of deep models stay
    finite; vectors (norm weights, biases) are small perturbations around 1 / 0.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        gen = torch.Generator().manual_seed((zlib.crc32(name.encode()) + seed * 7919) % (2**63))
        if not t.dtype.is_floating_point:
            out[name] = torch.zeros(t.shape, dtype=t.dtype)
            continue
        if t.dim() >= 2:
            fan_in = t.shape[-1]
            val = torch.randn(t.shape, generator=gen) / (fan_in**0.5)
        elif name.endswith("bias") or "bias" in name.rsplit(".", 1)[-1]:
            val = torch.randn(t.shape, generator=gen) * 0.02
        else:
            val = 1.0 + torch.randn(t.shape, generator=gen) * 0.1
        out[name] = val.to(t.dtype).contiguous()
    return out


def write_random_checkpoint(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    seed: int = 0,
    max_shard_bytes: int = 1 << 30,
) -> Path:
    """Write deterministic random weights for ``model`` as safetensors shards.

    More than one shard also writes ``model.safetensors.index.json`` (the
    Hugging Face layout).  Files are published with the store's atomic write.
    """
    from safetensors.torch import save

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = random_state_dict(model, seed=seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        atomic_write(directory / "model.safetensors", save(shards[0]))
        return directory
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_write(directory / fname, save(shard))
        weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    atomic_write(directory / INDEX_NAME, json.dumps(index, indent=1, sort_keys=True).encode())
    return directory


def read_checkpoint(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint (every shard), on CPU."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(directory):
        part = load_file(str(f), device="cpu")
        dup = set(part) & set(out)
        if dup:
            raise ConfigError("checkpoint", f"tensor(s) {sorted(dup)[:3]} appear in more than one shard")
        out.update(part)
    return out
