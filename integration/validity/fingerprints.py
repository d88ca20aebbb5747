"""The ``checkpoint`` key component: a cheap fingerprint of a safetensors checkpoint.

It must be cheap on checkpoints of many gigabytes, so it reads only file
names, sizes and the safetensors headers (tensor names, dtypes, shapes and
byte offsets), never the tensor data.  A changed tensor shape, a renamed
tensor or a different file set changes it; rewriting the same layout with
different values does not (a snapshot holds no weights, so it is still valid
for those weights).  Public as ``adstore.integration.checkpoint_fingerprint``
(docs/pipeline-cache.md, "Public API"); it lives beside the keys so that the pipeline cache
needs nothing from the reference pipeline.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from adstore.store import ConfigError

__all__ = ["INDEX_NAME", "checkpoint_files", "checkpoint_fingerprint"]

#: The Hugging Face index of a sharded checkpoint.
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


def checkpoint_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint directory (or a single file), sorted."""
    path = Path(directory)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError("checkpoint", f"{path} does not exist")
    files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and p.is_file())
    if not files:
        raise ConfigError("checkpoint", f"no *.safetensors files in {path}")
    return files


def _header(path: Path) -> bytes:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ConfigError("checkpoint", f"{path} is too short to be safetensors")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ConfigError("checkpoint", f"{path} declares a {n}-byte header")
        header = fh.read(n)
    try:
        json.loads(header)
    except ValueError as exc:
        raise ConfigError("checkpoint", f"{path} has an unreadable safetensors header: {exc}") from exc
    return header


def checkpoint_fingerprint(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Cheap identity of a checkpoint (a directory of shards or one file): per file name, size, header hash."""
    files = checkpoint_files(directory)
    entries: list[dict[str, Any]] = []
    for f in files:
        entries.append(
            {"name": f.name, "size": f.stat().st_size, "header_sha256": hashlib.sha256(_header(f)).hexdigest()}
        )
    index = Path(directory) / INDEX_NAME
    if Path(directory).is_dir() and index.is_file():
        with open(index, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        entries.append({"name": INDEX_NAME, "size": index.stat().st_size, "sha256": digest})
    return {"format": "safetensors", "files": entries}
