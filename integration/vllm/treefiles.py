"""What a tree entry may hold, on both sides: the files of a source tree, and a manifest's plan, validated.

A tree entry (:mod:`adstore.integration.vllm.trees`) is a directory vLLM
wrote, stored as one manifest.  Its files become code on the host that
restores it (pickles vLLM unpickles, kernels it loads), and its relative
paths come from a manifest that a remote or another user may have written.
So the rules for a path are written once here and applied whole on both
sides: capture refuses a tree it could not restore exactly (a symlink, a
device, a FIFO, a socket, a name outside a plain character set, too many
files or bytes), and restore refuses a plan whose paths could lead anywhere
but under the new tree (absolute, ``..``, ``.``, empty components, NUL, a
file where a directory must be), before a byte is written.

Nothing here touches the store: it maps paths to artifact names and back.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adstore.integration.errors import VllmTreeError

__all__ = [
    "FORMAT",
    "Limits",
    "Plan",
    "SourceTree",
    "TreeFile",
    "artifact_name",
    "check_relative",
    "find_anchors",
    "plan_from",
    "scan",
]

#: The layout of a tree entry's meta; a reader refuses any other (2 added ``relocated``).
FORMAT = 2
_FORMATS = (1, 2)
#: One path component: plain ASCII that every filesystem and shell keeps as it is (``.`` and ``..`` refused apart).
_COMPONENT = re.compile(r"[A-Za-z0-9._+=@,~-]{1,255}", re.ASCII)
_ARTIFACT = re.compile(r"p\.[0-9a-f]{40}", re.ASCII)
_ROLE = re.compile(r"[a-z][a-z0-9_]{0,63}", re.ASCII)
_MAX_PATH = 1024
_MAX_DEPTH = 32
_SCAN_CHUNK = 1 << 20


@dataclass(frozen=True)
class Limits:
    """How large a tree capture takes on: past these, the whole tree is refused (the cache is not a backup)."""

    max_files: int = 20_000
    max_bytes: int = 32 << 30


@dataclass(frozen=True)
class TreeFile:
    """One regular file of a tree: its relative path (``/``-separated) and permission bits."""

    path: str
    mode: int


@dataclass(frozen=True)
class SourceTree:
    """A directory's regular files and subdirectories (relative paths, permission bits), as :func:`scan` found them."""

    root_mode: int
    files: tuple[TreeFile, ...]
    dirs: Mapping[str, int]
    size: int


@dataclass(frozen=True)
class Plan:
    """A tree entry's files checked whole: each file's blob, directories, anchors, all validated."""

    root_mode: int
    files: tuple[tuple[TreeFile, Any], ...]  # (file, its blob ref)
    dirs: Mapping[str, int]
    anchors: Mapping[str, str] = field(default_factory=dict)
    relocated: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # file -> the roles it names


def artifact_name(path: str) -> str:
    """The artifact name of a relative path: ``p.`` and 40 hex digits of its SHA-256 (store names cannot hold ``/``).

    The meta maps each path to its mode; a reader derives every name again
    from its path, so a name that does not belong to a path is refused.
    """
    return "p." + hashlib.sha256(path.encode()).hexdigest()[:40]


def check_relative(path: object) -> tuple[str, ...]:
    """The components of a relative path a tree may hold; :class:`VllmTreeError` (``unsafe_path``) otherwise."""
    if type(path) is not str or not path:
        raise VllmTreeError("unsafe_path", f"not a relative path: {path!r}")
    if "\x00" in path:
        raise VllmTreeError("unsafe_path", f"a path holds NUL: {path!r}")
    if path.startswith("/") or len(path) > _MAX_PATH:
        raise VllmTreeError("unsafe_path", f"an absolute or overlong path: {path[:80]!r}")
    parts = tuple(path.split("/"))
    if len(parts) > _MAX_DEPTH:
        raise VllmTreeError("unsafe_path", f"nested deeper than {_MAX_DEPTH}: {path[:80]!r}")
    for part in parts:
        if part in ("", ".", "..") or _COMPONENT.fullmatch(part) is None:
            raise VllmTreeError("unsafe_path", f"component {part!r} of {path[:80]!r} is empty, a dot name or not plain")
    return parts


def _mode(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= 0o7777:
        raise VllmTreeError("corrupt_tree", f"{what}: {value!r} is not a permission mode")
    return value


def scan(source: Path, limits: Limits) -> SourceTree:
    """The regular files and directories under ``source``; anything else refuses the whole tree.

    A symlink (anywhere, the root included), a device, a FIFO or a socket,
    a name :func:`check_relative` would refuse, or more than ``limits``
    raises :class:`VllmTreeError`: a tree is captured exactly or not at all.
    """
    st = os.lstat(source)
    if not stat.S_ISDIR(st.st_mode):
        raise VllmTreeError("unsupported_file", f"{source} is not a directory (a symlink is not followed)")
    files: list[TreeFile] = []
    dirs: dict[str, int] = {}
    size = 0
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(source / rel if rel else source) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            child = f"{rel}/{entry.name}" if rel else entry.name
            check_relative(child)
            est = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(est.st_mode):
                dirs[child] = stat.S_IMODE(est.st_mode)
                stack.append(child)
            elif stat.S_ISREG(est.st_mode):
                files.append(TreeFile(child, stat.S_IMODE(est.st_mode)))
                size += est.st_size
            else:
                kind = "symlink" if stat.S_ISLNK(est.st_mode) else "special file"
                raise VllmTreeError("unsupported_file", f"{source / child} is a {kind}: only files and directories")
            if len(files) > limits.max_files or size > limits.max_bytes:
                raise VllmTreeError(
                    "too_large", f"{source} holds more than {limits.max_files} files or {limits.max_bytes} bytes"
                )
    return SourceTree(stat.S_IMODE(st.st_mode), tuple(sorted(files, key=lambda f: f.path)), dirs, size)


def find_anchors(path: Path, anchors: Mapping[str, bytes]) -> set[str]:
    """The roles whose absolute path occurs, as bytes, in the file ``path`` (read once, without following links)."""
    if not anchors:
        return set()
    overlap = max(len(v) for v in anchors.values()) - 1
    left = dict(anchors)
    found: set[str] = set()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=0) as f:
        tail = b""
        while left and (chunk := f.read(_SCAN_CHUNK)):
            window = tail + chunk
            for role, value in list(left.items()):
                if value in window:
                    found.add(role)
                    del left[role]
            tail = window[-overlap:] if overlap else b""
    return found


def plan_from(meta: Mapping[str, Any], artifacts: Mapping[str, Any]) -> Plan:
    """A tree entry's meta and artifact names checked whole, before anything is written.

    Every path passes :func:`check_relative`; every artifact name is the one
    its path gives and every path has one; no file sits where a directory of
    another path must be; the modes are modes; the anchors are absolute paths.
    """
    if not isinstance(meta, Mapping) or meta.get("tree") not in _FORMATS:
        raise VllmTreeError("corrupt_tree", f"not a tree entry of format {' or '.join(map(str, _FORMATS))}")
    files_meta, dirs_meta, anchors_meta = meta.get("files"), meta.get("dirs"), meta.get("anchors", {})
    if not isinstance(files_meta, Mapping) or not isinstance(dirs_meta, Mapping) or not isinstance(anchors_meta, dict):
        raise VllmTreeError("corrupt_tree", "the meta lacks its files, dirs or anchors")
    files: list[tuple[TreeFile, str]] = []
    parents: set[str] = set()
    for path, mode in files_meta.items():
        parts = check_relative(path)
        files.append((TreeFile(path, _mode(mode, path)), artifact_name(path)))
        parents.update("/".join(parts[:i]) for i in range(1, len(parts)))
    dirs: dict[str, int] = {}
    for path, mode in dirs_meta.items():
        parts = check_relative(path)
        dirs[path] = _mode(mode, path)
        parents.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = parents & set(files_meta)
    if clash or set(dirs) & set(files_meta):
        raise VllmTreeError("unsafe_path", f"a path is both a file and a directory: {sorted(clash)[:3]}")
    names = {name for _, name in files}
    given = set(artifacts)
    if given != names or any(_ARTIFACT.fullmatch(n) is None for n in given):
        raise VllmTreeError("corrupt_tree", f"{len(given ^ names)} artifact names do not belong to the tree's paths")
    for role, value in anchors_meta.items():
        if type(role) is not str or type(value) is not str or not os.path.isabs(value) or "\x00" in value:
            raise VllmTreeError("corrupt_tree", f"anchor {role!r} is not an absolute path")
    relocated = _relocated(meta.get("relocated", {}), files_meta)
    root_mode = _mode(meta.get("root_mode", 0o755), "the tree's root")
    ordered = sorted(files, key=lambda f: f[0].path)
    return Plan(root_mode, tuple((f, artifacts[name]) for f, name in ordered), dirs, dict(anchors_meta), relocated)


def _relocated(value: object, files: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """The meta's ``relocated``: files of the tree, each with the plain role names its paths were named after."""
    if not isinstance(value, dict):
        raise VllmTreeError("corrupt_tree", "relocated is not a mapping")
    out: dict[str, tuple[str, ...]] = {}
    for path, roles in value.items():
        if path not in files or not isinstance(roles, list) or not roles:
            raise VllmTreeError("corrupt_tree", f"relocated names {str(path)[:80]!r}, not a file with roles")
        if any(type(r) is not str or _ROLE.fullmatch(r) is None for r in roles):
            raise VllmTreeError("corrupt_tree", f"relocated {path[:80]!r}: a role is not a plain name")
        out[path] = tuple(roles)
    return out
