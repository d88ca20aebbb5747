"""Where vLLM keeps what it compiled: the directories a tree goes to or comes from, named by hash and rank.

vLLM names each compile directory after its own hash of the model and
configuration and the rank (``rank_<i>_<j>``); the plugin stores one tree
per directory (:mod:`~adstore.integration.vllm.trees`), so it recognises
only those two layouts, and any other path is vLLM's alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Layout", "aot_layout", "piecewise_layout"]

_RANK = re.compile(r"rank_[0-9]{1,6}_[0-9]{1,6}", re.ASCII)
_HASH = re.compile(r"[0-9a-f]{8,64}", re.ASCII)


@dataclass(frozen=True)
class Layout:
    """One of vLLM's compile directories: its hash, rank, and the directories a tree goes to or comes from."""

    vllm_hash: str
    rank: str
    rank_dir: Path
    shared_dir: Path | None = None  # the AOT path's per-hash inductor_cache


def aot_layout(aot_compilation_path: str, cache_root: str) -> Layout | None:
    """``<cache_root>/torch_compile_cache/torch_aot_compile/<hash>/rank_<i>_<j>/model``; None for any other path."""
    path = Path(os.path.normpath(os.path.abspath(aot_compilation_path)))
    rank_dir = path.parent
    hash_dir = rank_dir.parent
    base = Path(os.path.normpath(os.path.abspath(cache_root))) / "torch_compile_cache" / "torch_aot_compile"
    if path.name != "model" or hash_dir.parent != base:
        return None
    if _RANK.fullmatch(rank_dir.name) is None or _HASH.fullmatch(hash_dir.name) is None:
        return None
    return Layout(hash_dir.name, rank_dir.name, rank_dir, hash_dir / "inductor_cache")


def piecewise_layout(cache_dir: str, prefix: str, cache_root: str) -> Layout | None:
    """``<cache_root>/torch_compile_cache/<hash>/rank_<i>_<j>[/<prefix>]``; None for any other directory."""
    local = Path(os.path.normpath(os.path.abspath(cache_dir)))
    if prefix and local.name != prefix:
        return None
    rank_dir = local.parent if prefix else local
    base = Path(os.path.normpath(os.path.abspath(cache_root))) / "torch_compile_cache"
    if rank_dir.parent.parent != base or _RANK.fullmatch(rank_dir.name) is None:
        return None
    if _HASH.fullmatch(rank_dir.parent.name) is None:
        return None
    return Layout(rank_dir.parent.name, rank_dir.name, rank_dir)
