"""vLLM's own compile artifacts as store entries: one directory tree, one entry, restored whole or not at all.

vLLM keeps what it compiled as directories under ``VLLM_CACHE_ROOT`` (see
:mod:`adstore.integration.vllm.hooks` for which).  A *tree entry* is one
store entry, namespace ``vllm_tree``, whose manifest holds each regular file
of such a directory as an artifact (named ``p.<hash of its relative path>``:
store names cannot hold ``/``) and whose meta maps every relative path to its
mode, lists the directories, and records the *anchors* found in the files.

Key: the SHA-256 of canonical JSON of the components (kind, vLLM's hash,
rank, part) together with torch's build key and adstore's toolchain
fingerprint: the same scheme and the same identity as Inductor's entries
(:class:`~adstore.integration.inductor.entries.InductorEntries`), so
``adstore explain`` shows which part made two keys differ.

Anchors: vLLM's pickles embed absolute paths (its cache directory, the
venv's ``vllm/_custom_ops.py``).  Capture looks for the caller's anchors
(role -> absolute path on this host) in every file.  A pickle that names
them only in its strings is stored with each such path named after its
role (``${cache_root}/…``, :mod:`~adstore.integration.vllm.relocate`) and
listed as *relocated*; restore writes it back with this host's paths.  A
kernel that names them only where the dynamic loader never looks is stored
as it is.  Any other file that holds an anchor's bytes is recorded under
*anchors*, and restore refuses the tree, as a miss saying which path
differs, unless every recorded role has the same path here.  A tree that
would load another host's files is never restored.

The key also holds vLLM's build (:func:`vllm_build`: the digest of the
hashes its installed ``RECORD`` lists for the ``vllm`` package's files),
since a relocated tree no longer tells one vLLM install from another by
its path, and ``paths: relative/1``, so trees of the earlier format (paths
as they were) are never read as relocated ones.

Restore leaves a target that holds anything alone (vLLM's own; an empty
directory, which vLLM makes before it looks, is replaced), builds the tree
in a private directory beside the target (0700, named ``.adstore-<pid>-*``
so a sweep can remove a killed process's), under a parent no untrusted user
can rename in (the rule for code, :mod:`~adstore.integration.placement`; a
0775 parent of this user's is tightened), copies each file through the trust
rule (:func:`~adstore.integration.placement.place.place`: verified bytes
from a trusted writer), and publishes it with one ``rename``; if another
process got there first, ours is discarded.  No process sees half a tree,
and a failure leaves nothing behind.  Capture reads every file under the
same rule (:func:`~adstore.integration.placement.capture.capture_files`).

Both directions never raise: a problem is an :class:`Outcome` with a
reason, logged once and counted as ``vllm.failopen.<reason>``.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adstore.integration.coordination.flights import flights_for
from adstore.integration.errors import VllmTreeError, failure_reason
from adstore.integration.inductor.entries import InductorEntries, note_failure
from adstore.integration.placement.capture import capture_files, read_files
from adstore.integration.placement.dirs import open_dir
from adstore.integration.placement.place import place, read_trusted
from adstore.integration.placement.rule import trusted_uids
from adstore.integration.validity import roots
from adstore.integration.vllm import relocate
from adstore.integration.vllm.treefiles import FORMAT, Limits, Plan, artifact_name, find_anchors, plan_from, scan
from adstore.store import Reason

__all__ = ["NAMESPACE", "PATHS", "Outcome", "Limits", "capture", "restore", "tree_key", "identity", "vllm_build"]

logger = logging.getLogger(__name__)

NAMESPACE = "vllm_tree"
#: How a tree's files name the anchors' paths: pickles relocated to the roles' names (``relocate``).
PATHS = "relative/1"
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]{0,199}", re.ASCII)
_NO_WRITE_BY_OTHERS = 0o755  # and no setuid, setgid or sticky bit


@dataclass(frozen=True)
class Outcome:
    """What a capture or a restore did: ``ok`` (captured / the tree is in place), why, and how many files."""

    ok: bool
    reason: str
    files: int = 0
    detail: str = ""

    @property
    def hit(self) -> bool:
        """A restore: the tree is at the target now (ours, or another process's that won the rename)."""
        return self.ok

    @property
    def captured(self) -> bool:
        return self.ok


@functools.cache
def _identity() -> tuple[tuple[str, str], ...]:
    found = InductorEntries(None, trusted=frozenset(), owns_store=False).identity
    return tuple(sorted(found.items()))


def identity() -> dict[str, str]:
    """torch's build key and adstore's toolchain fingerprint (Inductor's entries'), once per process."""
    return dict(_identity())


@functools.cache
def vllm_build() -> str:
    """A digest of the installed vLLM's files (the hashes its ``RECORD`` lists under ``vllm/``); ``unknown`` if none.

    Path-free, unlike the install: two venvs of one wheel agree, another
    build of the same version differs.  Scripts (``bin/vllm``, whose first
    line names the interpreter's path) and files without a hash are left out.
    """
    from importlib import metadata

    from adstore.integration.validity.keys import json_digest

    try:
        names = metadata.packages_distributions().get("vllm", [])
        for name in sorted(set(names)):
            record = metadata.distribution(name).read_text("RECORD") or ""
            hashes = sorted(
                line for line in record.splitlines() if line.startswith("vllm/") and line.split(",")[1:2] != [""]
            )
            if hashes:
                return json_digest({"distribution": name, "record": hashes})
    except Exception as exc:  # noqa: BLE001 - no metadata: the key says so (vLLM's hash still holds its version)
        logger.debug("vLLM's build from its RECORD: %s", exc)
    return "unknown"


def tree_key(*, kind: str, vllm_hash: str, rank: str, part: str = "") -> tuple[str, dict[str, str]]:
    """The store key of one tree and its components (``InductorEntries.key``'s scheme: json_digest)."""
    from adstore.integration.validity.keys import json_digest

    for what, value in (("kind", kind), ("vllm_hash", vllm_hash), ("rank", rank)) + ((("part", part),) if part else ()):
        if type(value) is not str or _TOKEN.fullmatch(value) is None:
            raise VllmTreeError("bad_key", f"{what} {value!r} is not a plain name")
    components = {"namespace": NAMESPACE, "kind": kind, "vllm_hash": vllm_hash, "rank": rank, "part": part}
    components.update(identity())
    components.update(vllm_build=vllm_build(), paths=PATHS)
    if (
        roots.active()
    ):  # enable() names Inductor's kernels relative to the install roots: a tree of path-named ones differs
        components["kernel_names"] = roots.RELOCATION
    return json_digest(components), components


def _fail(store: Any, exc: BaseException, what: str) -> Outcome:
    reason = failure_reason(exc)
    note_failure(reason, f"{what}: {exc}", store, scope="vllm", fallback="vLLM compiles (or keeps its own files)")
    return Outcome(False, reason, detail=str(exc))


def _anchor_bytes(anchors: Mapping[str, str]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for role, value in anchors.items():
        if type(value) is not str or not os.path.isabs(value) or value.rstrip("/") == "" or "\x00" in value:
            raise VllmTreeError("bad_key", f"anchor {role!r}: {value!r} is not an absolute path below /")
        out[role] = os.fsencode(value)
    return out


# -- capture ---------------------------------------------------------------------
def capture(
    store: Any,
    *,
    kind: str,
    vllm_hash: str,
    rank: str,
    source: Path,
    anchors: Mapping[str, str],
    part: str = "",
    limits: Limits | None = None,
    trusted: frozenset[int] | None = None,
) -> Outcome:
    """Store the directory ``source`` as one tree entry, through ``Store.save``; never raises.

    Refused whole (an outcome with the reason, nothing saved) when it holds
    anything but regular files and directories, a name outside the plain
    set, or more than ``limits``, or when the rule for code refuses a file
    (a directory another user could write in, a file no trusted user owns).  Two processes capturing one tree both
    save whole entries; the last commit wins.
    """
    try:
        key, components = tree_key(kind=kind, vllm_hash=vllm_hash, rank=rank, part=part)
        wanted = _anchor_bytes(anchors)
        tree = scan(Path(source), limits or Limits())
        if not tree.files:
            return Outcome(False, "empty", detail=f"{source} holds no file")
        paths = {str(Path(source) / f.path): artifact_name(f.path) for f in tree.files}
        relative = {str(Path(source) / f.path): f.path for f in tree.files}
        who = trusted_uids() if trusted is None else trusted
        holding = {p: roles for p in paths if (roles := find_anchors(Path(p), wanted))}
        captured = capture_files(store, [p for p in paths if p not in holding], who)
        if captured.refused:
            raise next(iter(captured.refused.values()))
        refs = {paths[p]: ref for p, ref in captured.refs.items()}
        found: set[str] = set()
        relocated: dict[str, list[str]] = {}
        for path, data in read_files(list(holding), who).items():
            held = {role: anchors[role] for role in holding[path]}
            named = relocate.to_names(data, anchors)
            if named is not None:
                relocated[relative[path]] = sorted(held)
                data = named
            elif not relocate.loader_neutral(data, [wanted[role] for role in held]):
                found |= set(held)
            refs[paths[path]] = store.put_bytes(data)
        meta = {
            "tree": FORMAT,
            "kind": kind,
            "root_mode": tree.root_mode,
            "files": {f.path: f.mode for f in tree.files},
            "dirs": dict(tree.dirs),
            "anchors": {role: anchors[role] for role in sorted(found)},
            "relocated": dict(sorted(relocated.items())),
        }
        store.save(key, refs, namespace=NAMESPACE, components=components, meta=meta, trusted=trusted_uids())
        store.count({"vllm.trees_captured": 1})
        return Outcome(True, "captured", len(tree.files))
    except Exception as exc:  # noqa: BLE001 - fail open: vLLM's own files stay as they are
        return _fail(store, exc, f"capture of {source}")
    finally:
        if _leased(kind, rank):  # saved or not: a lease this process compiled the tree under goes now
            try:
                flights_for(store).built(tree_key(kind=kind, vllm_hash=vllm_hash, rank=rank, part=part)[0], NAMESPACE)
            except Exception as exc:  # noqa: BLE001 - no key, no lease; an unreleased lease expires
                logger.debug("single-flight release: %s", exc)


def _leased(kind: str, rank: str) -> bool:
    """Whether a miss of this tree takes a single-flight lease: the first rank's own trees only.

    Ranks of one host meet in collectives while they compile, so only one
    rank per host may wait for another host: the others build (and wait at
    their collectives for the rank that waits); a tree the ranks share is
    restored again by the hook once the first rank's arrived.
    """
    return kind in ("aot", "piecewise") and rank == "rank_0_0"


# -- restore ---------------------------------------------------------------------
def _occupied(target: Path) -> bool:
    """Whether ``target`` holds something of vLLM's: anything but nothing or an empty real directory."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return True
    with os.scandir(target) as it:
        return next(it, None) is not None


def _anchor_mismatch(recorded: Mapping[str, str], here: Mapping[str, str]) -> str | None:
    for role, value in sorted(recorded.items()):
        if role not in here:
            return f"absolute path {value} ({role}) is not known on this host; the tree's files embed it"
        if os.path.normpath(here[role]) != os.path.normpath(value):
            return f"absolute path {value} ({role}) differs on this host ({here[role]}); the tree's files embed it"
    return None


def _unknown_roles(plan: Plan, here: Mapping[str, str]) -> str | None:
    """Why a relocated file cannot be given this host's paths: a role it names that this host has no path for."""
    for path, roles in sorted(plan.relocated.items()):
        missing = [role for role in roles if role not in here]
        if missing:
            return f"{path} names the path of {missing[0]}, which is not known on this host"
    return None


def _build(store: Any, plan: Plan, root: Path, trusted: frozenset[int], anchors: Mapping[str, str]) -> int:
    """Every file of ``plan`` under ``root`` (private, fresh), verified and trusted; then the modes.

    A relocated file is read verified from a trusted writer, given this
    host's paths (``anchors``) and written new; the others are copied.
    """
    real_root = os.path.realpath(root)
    for path in sorted(plan.dirs):
        (root / path).mkdir(mode=0o700, parents=True, exist_ok=True)
    for f, ref in plan.files:
        dest = root / f.path
        mode = f.mode & _NO_WRITE_BY_OTHERS
        if f.path in plan.relocated:
            placed = _write_relocated(store, ref, dest, mode, trusted, anchors, plan.relocated[f.path])
        else:
            placed = place(store, ref, directory=dest.parent, name=dest.name, trusted=trusted, mode=mode)
        if not placed or os.path.commonpath([real_root, os.path.realpath(dest)]) != real_root:
            raise VllmTreeError("unsafe_path", f"{f.path} did not land as a new file under the tree")
    for path in sorted(plan.dirs, key=lambda p: p.count("/"), reverse=True):
        os.chmod(root / path, (plan.dirs[path] & _NO_WRITE_BY_OTHERS) | 0o700, follow_symlinks=False)
    os.chmod(root, (plan.root_mode & _NO_WRITE_BY_OTHERS) | 0o700, follow_symlinks=False)
    return len(plan.files)


def _write_relocated(
    store: Any,
    ref: Any,
    dest: Path,
    mode: int,
    trusted: frozenset[int],
    anchors: Mapping[str, str],
    roles: tuple[str, ...],
) -> bool:
    """The relocated file ``ref`` at ``dest`` (a new file in the private tree) with this host's paths."""
    data = relocate.to_paths(read_trusted(store, ref, trusted), anchors, roles)
    if data is None:
        raise VllmTreeError("corrupt_tree", f"{dest.name}: its named paths cannot be given this host's")
    os.makedirs(dest.parent, mode=0o700, exist_ok=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(dest, mode, follow_symlinks=False)
    return True


def restore(
    store: Any,
    *,
    kind: str,
    vllm_hash: str,
    rank: str,
    target: Path,
    anchors: Mapping[str, str],
    part: str = "",
    trusted: frozenset[int] | None = None,
) -> Outcome:
    """Put the stored tree at ``target``, whole and atomically, or leave everything as it was; never raises.

    A miss (``ok`` False) when ``target`` holds anything (``target_exists``),
    no entry is stored, a recorded anchor's path differs here
    (``incompatible_env``), a path or writer is refused, or a blob is
    damaged (the store quarantines it).  ``hit_by_other``: another process
    renamed its copy into place first; ours was discarded.
    """
    tmp: Path | None = None
    try:
        key, _ = tree_key(kind=kind, vllm_hash=vllm_hash, rank=rank, part=part)
        target = Path(os.path.abspath(target))
        if _occupied(target):
            return Outcome(False, "target_exists", detail=f"{target} is vLLM's own")
        res = store.lookup(key, trusted=trusted_uids() if trusted is None else trusted)  # meta: paths and modes
        if not res.hit and res.reason == Reason.ABSENT and _leased(kind, rank):
            if flights_for(store).after_miss(key, NAMESPACE):  # another host compiled it while this one waited
                res = store.lookup(key, trusted=trusted_uids() if trusted is None else trusted)
        if not res.hit or res.manifest is None:
            if res.reason != Reason.ABSENT:
                note_failure(str(res.reason), f"tree {key[:12]} not served", store, scope="vllm")
            return Outcome(False, str(res.reason))
        manifest = res.manifest
        if manifest.namespace != NAMESPACE:
            raise VllmTreeError("corrupt_tree", f"entry {key[:12]} is in namespace {manifest.namespace}")
        plan = plan_from(manifest.meta, manifest.artifacts)
        why = _anchor_mismatch(plan.anchors, anchors) or _unknown_roles(plan, anchors)
        if why is not None:
            note_failure(str(Reason.INCOMPATIBLE_ENV), why, store, scope="vllm", fallback="vLLM compiles")
            return Outcome(False, str(Reason.INCOMPATIBLE_ENV), detail=why)
        trusted = trusted_uids() if trusted is None else trusted
        os.close(open_dir(target.parent, trusted, own=False))  # no symlink on the way, no one else renames in it
        with store.lease(key):
            tmp = Path(
                tempfile.mkdtemp(prefix=f".adstore-{os.getpid()}-", suffix=f".{target.name[:40]}", dir=target.parent)
            )
            count = _build(store, plan, tmp, trusted, anchors)
        try:
            os.rename(tmp, target)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return Outcome(True, "hit_by_other", count, f"another process put {target} in place first")
            if exc.errno == errno.ENOTDIR:
                return Outcome(False, "target_exists", detail=f"{target} is vLLM's own")
            raise
        tmp = None
        store.count({"vllm.trees_restored": 1})
        return Outcome(True, "restored", count)
    except Exception as exc:  # noqa: BLE001 - fail open: vLLM compiles
        return _fail(store, exc, f"restore of {target}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
