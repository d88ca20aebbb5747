"""Local safetensors checkpoints of the reference pipeline: write random weights, read them.

:func:`write_header_checkpoint` writes a checkpoint of the real size with no
weights in it: each file is a safetensors header followed by a hole (a sparse
file), so a 1.3 TB model costs a few megabytes of disk.  Its fingerprint is
the one a real checkpoint of the same layout has, so a prefix cached with it
is the prefix of the real weights; the weights themselves read as zeros.

The fingerprint (the ``checkpoint`` key component) lives in
``adstore.integration.validity.fingerprints`` and is re-exported here, so the
pipeline cache needs nothing from the reference pipeline.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from adstore.integration.validity.fingerprints import INDEX_NAME, checkpoint_files, checkpoint_fingerprint
from adstore.store import ConfigError, atomic_write

__all__ = [
    "INDEX_NAME",
    "checkpoint_files",
    "checkpoint_fingerprint",
    "random_state_dict",
    "read_checkpoint",
    "write_header_checkpoint",
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
    model: nn.Module, directory: str | os.PathLike[str], *, seed: int = 0, max_shard_bytes: int = 1 << 30
) -> Path:
    """Write deterministic random weights for ``model`` as safetensors shards.

    More than one shard also writes ``model.safetensors.index.json`` (the
    Hugging Face layout).  Files are published with the store's atomic write.
    """
    from safetensors.torch import save

    tensors = random_state_dict(model, seed=seed)
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    files = _shard_files(directory, sizes, max_shard_bytes)
    for fname, names in files.items():
        atomic_write(Path(directory) / fname, save({k: tensors[k] for k in names}))
    return Path(directory)


def _shard_files(
    directory: str | os.PathLike[str], sizes: Mapping[str, int], max_shard_bytes: int
) -> dict[str, list[str]]:
    """File name -> tensor names, in order; writes the index when there is more than one file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    files = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards)}
    index = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": {name: fname for fname, names in files.items() for name in names},
    }
    atomic_write(directory / INDEX_NAME, json.dumps(index, indent=1, sort_keys=True).encode())
    return files


#: safetensors' dtype names, ranked as its ``Dtype`` enum orders them (a file lists tensors by
#: descending rank, then by name).
_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 4),
    torch.int8: ("I8", 5),
    torch.float8_e5m2: ("F8_E5M2", 6),
    torch.float8_e4m3fn: ("F8_E4M3", 7),
    torch.int16: ("I16", 9),
    torch.uint16: ("U16", 10),
    torch.float16: ("F16", 11),
    torch.bfloat16: ("BF16", 12),
    torch.int32: ("I32", 13),
    torch.uint32: ("U32", 14),
    torch.float32: ("F32", 15),
    torch.float64: ("F64", 17),
    torch.int64: ("I64", 18),
    torch.uint64: ("U64", 19),
}


def _safetensors_header(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[bytes, int]:
    """The safetensors header ``save`` would write for tensors of these dtypes and shapes, and the data size."""
    try:
        ranked = sorted(specs.items(), key=lambda kv: (-_DTYPES[kv[1][0]][1], kv[0]))
    except KeyError as exc:
        raise ConfigError("checkpoint", f"safetensors has no dtype for {exc.args[0]}") from None
    entries, offset = {}, 0
    for name, (dtype, shape) in ranked:
        end = offset + math.prod(shape) * dtype.itemsize
        entries[name] = {"dtype": _DTYPES[dtype][0], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offset


def write_header_checkpoint(
    model: nn.Module, directory: str | os.PathLike[str], *, max_shard_bytes: int = 5 << 30
) -> Path:
    """Write a checkpoint of ``model``'s real layout whose tensor data is a hole (no weights).

    Works on a meta model of any size.  The headers and file sizes are those
    ``safetensors`` writes for these tensors (Hugging Face's 5 GiB shards by
    default), so :func:`checkpoint_fingerprint` gives the real checkpoint's
    value.  Each file is published with the store's atomic write (the header)
    and then extended to its full size; the extension allocates no disk.
    """
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in model.state_dict(keep_vars=True).items()}
    sizes = {name: math.prod(shape) * dtype.itemsize for name, (dtype, shape) in specs.items()}
    files = _shard_files(directory, sizes, max_shard_bytes)
    for fname, names in files.items():
        header, data = _safetensors_header({k: specs[k] for k in names})
        path = atomic_write(Path(directory) / fname, header)
        os.truncate(path, len(header) + data)
    return Path(directory)


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
