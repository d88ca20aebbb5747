"""Temporary files a killed process left outside the store: found by the pid in their name, removed when it is dead.

The integrations write files that become code under temporary names first
and remove them when they are done; a process killed meanwhile leaves
them behind.  Every such name carries its writer's pid:

* ``.adstore-<pid>-*``: a kernel or header being placed in Inductor's
  directories, a tree being restored beside vLLM's target;
* ``adstore-code-<pid>-*``: a process's private code directory in the
  system temp directory.

:func:`plan_dead_temps` lists those whose pid no longer runs (and that are
older than ``grace`` seconds, for a process of another pid namespace that
shares the directory), owned by this user, never following a link; the
plan's :meth:`DeadTempPlan.execute` removes them.  Torch-free: the daemon
and ``adstore gc`` run it, and so does ``enable()`` in a torch process.
Where to look (:func:`default_temp_dirs`) follows torch's and vLLM's own
defaults, from the environment.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["DeadTempPlan", "default_temp_dirs", "plan_dead_temps"]

_NAME = re.compile(r"(?:\.adstore-|adstore-code-)([0-9]{1,10})-")
#: How far below vLLM's cache directory a temporary name is looked for (its targets sit a few levels down).
_VLLM_DEPTH = 6


@dataclass(frozen=True)
class DeadTempPlan:
    """Leftovers of dead processes (paths, their pids), and what removing them frees."""

    victims: tuple[tuple[str, int], ...]
    bytes_to_free: int

    def execute(self) -> int:
        """Remove every victim (a file, or a directory with what is in it, never through a link); bytes freed."""
        freed = 0
        for path, _ in self.victims:
            try:
                st = os.lstat(path)
                if stat.S_ISDIR(st.st_mode):
                    size = _size(path)
                    shutil.rmtree(path)  # removes links, never what they point at
                else:
                    size = st.st_size
                    os.unlink(path)
                freed += size
            except FileNotFoundError:
                continue  # another sweep was faster
            except OSError:
                continue  # what cannot be removed stays for the next sweep
        return freed

    def to_dict(self) -> dict[str, object]:
        return {"dead_temps": len(self.victims), "bytes_to_free": self.bytes_to_free}


def default_temp_dirs(environ: Mapping[str, str] | None = None) -> list[tuple[Path, int]]:
    """Where adstore writes temporary files for this user, each with how many levels down to look.

    The system temp directory (private code directories), Inductor's cache
    directory (``TORCHINDUCTOR_CACHE_DIR``, else ``$TMPDIR/torchinductor_$USER``,
    which also holds the precompiled headers) and vLLM's (``VLLM_CACHE_ROOT``,
    else ``${XDG_CACHE_HOME:-~/.cache}/vllm``).
    """
    env = os.environ if environ is None else environ
    tmp = Path(env.get("TMPDIR") or tempfile.gettempdir())
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    dirs = [(tmp, 1), (tmp / f"torchinductor_{user}", 2)]
    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        dirs.append((Path(env["TORCHINDUCTOR_CACHE_DIR"]), 2))
    cache_home = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache")
    vllm = Path(env["VLLM_CACHE_ROOT"]) if env.get("VLLM_CACHE_ROOT") else cache_home / "vllm"
    dirs.append((vllm, _VLLM_DEPTH))
    return list(dict.fromkeys((Path(os.path.abspath(d)), depth) for d, depth in dirs))


def plan_dead_temps(
    dirs: Iterable[tuple[str | os.PathLike[str], int]] | None = None, *, grace: float = 60.0, now: float | None = None
) -> DeadTempPlan:
    """The leftovers of dead processes in ``dirs`` ((directory, levels to look down); :func:`default_temp_dirs`
    when None), this user's only, older than ``grace`` seconds at ``now``."""
    now = time.time() if now is None else now
    me = os.geteuid()
    victims: dict[str, int] = {}
    size = 0
    for top, depth in dirs if dirs is not None else default_temp_dirs():
        for path, st, pid in _candidates(Path(top), depth):
            if st.st_uid != me or now - st.st_mtime < grace or str(path) in victims:
                continue
            if psutil.pid_exists(pid):
                continue  # alive (or its pid was reused): left alone
            victims[str(path)] = pid
            size += _size(str(path)) if stat.S_ISDIR(st.st_mode) else st.st_size
    return DeadTempPlan(tuple(sorted(victims.items())), size)


def _candidates(top: Path, depth: int) -> Iterable[tuple[Path, os.stat_result, int]]:
    """Entries named like a temporary of adstore's under ``top`` (``depth`` levels), without following links."""
    stack = [(top, 0)]
    while stack:
        here, level = stack.pop()
        try:
            with os.scandir(here) as it:
                entries = list(it)
        except OSError:
            continue  # absent, not a directory, not ours to read
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            m = _NAME.match(entry.name)
            if m is not None and not stat.S_ISLNK(st.st_mode):
                yield Path(entry.path), st, int(m.group(1))
            elif stat.S_ISDIR(st.st_mode) and level + 1 < depth:
                stack.append((Path(entry.path), level + 1))


def _size(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
