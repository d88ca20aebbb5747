"""vLLM's model-class inspection cache (``<VLLM_CACHE_ROOT>/modelinfos``) as tree entries, one per model class.

Before vLLM uses a model class it needs a few facts about it (``_ModelInfo``:
is it a text-generation model, does it support pipeline parallelism, ...).
vLLM 0.32.0 reads them from ``modelinfos/<module>-<Class>.json`` (the file
holds the hash of the model's source module, which vLLM compares), and when
that file is absent or stale it imports the class in a *subprocess* (a new
interpreter that imports vLLM and torch: several seconds) and writes the
file.  A new host has no file, so every process start on it pays that
subprocess until the file is written.

Each model class's file is one tree entry (:mod:`adstore.integration.vllm.trees`,
kind ``modelinfo``) whose key holds vLLM's own module hash, so a changed
model source is a different key, and whose one file is the JSON vLLM wrote:

* capture, after vLLM saved the file: the file, if it names the module
  hash vLLM saved it for, is copied into a private directory and captured
  as a tree;
* restore, before vLLM reads the file, when it is absent: the tree is
  restored into a private directory beside ``modelinfos`` (the trees' rules:
  verified copies from trusted writers, every path checked) and its one
  file, if it has exactly the expected name, is linked into ``modelinfos``
  without replacing anything there (a file vLLM or another process put
  there first wins).

vLLM still checks the hash inside the file and inspects the class again
on a mismatch: a wrong file costs the subprocess, never a wrong answer.
Both never raise: problems are :class:`~adstore.integration.vllm.trees.Outcome` misses.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adstore.integration.errors import VllmTreeError, failure_reason
from adstore.integration.inductor.entries import note_failure
from adstore.integration.vllm import trees

__all__ = ["KIND", "RANK", "capture", "restore", "part_of"]

KIND = "modelinfo"
#: Model-class facts are the same for every rank: one tree per class and module hash.
RANK = "all"
_FILENAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,200}\.json", re.ASCII)
_NOT_IN_PART = re.compile(r"[^A-Za-z0-9.-]", re.ASCII)
_MAX_BYTES = 1 << 20


def part_of(filename: str) -> str:
    """The tree key's part for vLLM's file name (``_`` is not in a key's alphabet: it becomes ``.``)."""
    if _FILENAME.fullmatch(filename) is None:
        raise VllmTreeError("bad_key", f"{filename!r} is not a vLLM modelinfo file name")
    return _NOT_IN_PART.sub(".", filename[: -len(".json")])


def _names_hash(path: Path, module_hash: str) -> bool:
    """Whether the JSON file at ``path`` is vLLM's for ``module_hash`` (small, an object, that hash)."""
    with open(path, "rb") as fh:
        data = fh.read(_MAX_BYTES + 1)
    if len(data) > _MAX_BYTES:
        return False
    try:
        doc = json.loads(data)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("hash") == module_hash and isinstance(doc.get("modelinfo"), dict)


def _fail(store: Any, exc: BaseException, what: str) -> trees.Outcome:
    reason = getattr(exc, "why", None) or failure_reason(exc)
    note_failure(reason, f"{what}: {exc}", store, scope="vllm", fallback="vLLM inspects the model class")
    return trees.Outcome(False, reason, detail=str(exc))


def _scratch(directory: Path) -> Path:
    """A private directory beside ``directory`` (same filesystem: its file can be linked in)."""
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{directory.name}.adstore-", dir=parent))


def capture(
    store: Any, *, directory: Path, filename: str, module_hash: str, anchors: Mapping[str, str]
) -> trees.Outcome:
    """Store vLLM's file ``directory/filename`` (if it names ``module_hash``) as one tree; never raises."""
    scratch: Path | None = None
    try:
        part = part_of(filename)
        source = Path(directory) / filename
        if not source.is_file() or source.is_symlink() or not _names_hash(source, module_hash):
            return trees.Outcome(False, "not_saved", detail=f"{source} is not vLLM's file for {module_hash[:12]}")
        scratch = _scratch(Path(directory))
        shutil.copyfile(source, scratch / filename, follow_symlinks=False)
        return trees.capture(
            store, kind=KIND, vllm_hash=module_hash, rank=RANK, part=part, source=scratch, anchors=anchors
        )
    except Exception as exc:  # noqa: BLE001 - fail open: vLLM keeps its own file
        return _fail(store, exc, f"capture of {filename}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def restore(
    store: Any,
    *,
    directory: Path,
    filename: str,
    module_hash: str,
    anchors: Mapping[str, str],
    trusted: frozenset[int] | None = None,
) -> trees.Outcome:
    """Put the stored file for ``module_hash`` at ``directory/filename`` unless something is there; never raises."""
    scratch: Path | None = None
    try:
        part = part_of(filename)
        final = Path(directory) / filename
        if os.path.lexists(final):
            return trees.Outcome(False, "target_exists", detail=f"{final} is vLLM's own")
        scratch = _scratch(Path(directory))
        tree = scratch / "tree"
        got = trees.restore(
            store, kind=KIND, vllm_hash=module_hash, rank=RANK, part=part, target=tree, anchors=anchors, trusted=trusted
        )
        if not got.ok:
            return got
        names = sorted(p.name for p in tree.iterdir())
        if names != [filename] or not _names_hash(tree / filename, module_hash):
            raise VllmTreeError("corrupt_tree", f"modelinfo tree {module_hash[:12]} holds {names}, not {filename}")
        Path(directory).mkdir(parents=True, exist_ok=True)
        try:
            os.link(tree / filename, final)
        except FileExistsError:
            return trees.Outcome(True, "hit_by_other", 1, f"{final} appeared meanwhile")
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            return trees.Outcome(False, "cross_device", detail=f"{directory} is on another filesystem than its parent")
        return trees.Outcome(True, "restored", 1)
    except Exception as exc:  # noqa: BLE001 - fail open: vLLM inspects the class
        return _fail(store, exc, f"restore of {filename}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
