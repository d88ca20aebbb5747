"""Where vLLM keeps what it compiled: the directories a tree goes to or comes from, named by hash and rank.

vLLM names each compile directory after its own hash of the model and
configuration and the rank (``rank_<i>_<j>``); the plugin stores one tree
per directory (:mod:`~adstore.integration.vllm.trees`), so it recognises
only those two layouts, and any other path is vLLM's alone.

vLLM makes these directories with the user's umask: under umask 002 they
are 0775, writable by the user's primary group.  The rule for code
(:func:`~adstore.integration.placement.dirs.open_dir`) tightens a directory
of this user's instead of refusing it, but only the one a file goes to or
comes from; :func:`tighten` does the same for vLLM's directories above it
(from the cache root down) and inside a tree, so a primary group not known
to be private (a shared group, a gid the group database does not know)
refuses no tree of this user's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from adstore.integration.errors import UnsafeCacheDir
from adstore.integration.placement.dirs import open_dir

__all__ = ["Layout", "aot_layout", "piecewise_layout", "tighten"]

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


def tighten(cache_root: str, path: Path, trusted: frozenset[int], *, inside: bool = False) -> None:
    """vLLM's directories from ``cache_root`` down to ``path`` (and, ``inside``, under it) tightened if this user's.

    Each is opened as the rule for code opens a directory (walked from
    ``/``, judged, a directory of this user's that others may write tightened
    through its descriptor).  A path outside ``cache_root`` is left alone;
    the first directory the rule refuses (not this user's, a symlink, an
    unsafe parent) ends it quietly: the restore or capture that follows
    refuses the tree and says why.
    """
    root = Path(os.path.normpath(os.path.abspath(cache_root)))
    leaf = Path(os.path.normpath(os.path.abspath(path)))
    if leaf != root and root not in leaf.parents:
        return
    parts = leaf.relative_to(root).parts
    chain = [root.joinpath(*parts[:i]) for i in range(len(parts) + 1)]
    if inside and leaf.is_dir() and not leaf.is_symlink():
        found = (Path(d) / n for d, names, _ in os.walk(leaf) for n in names)
        chain += sorted(found, key=lambda p: len(p.parts))
    for directory in chain:
        try:
            os.close(open_dir(directory, trusted, own=False))
        except (UnsafeCacheDir, OSError):
            return
