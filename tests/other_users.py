"""Run this interpreter as another uid, as on a real host where every user can reach Python.

Here Python and its packages may live under root's home (pyenv or a venv in
``/root``, mode 0700).  Another uid then cannot read the standard library or
the installed packages, which no real host does.  In a private mount
namespace each closed directory on the way is covered by an open tmpfs that
holds only what this interpreter needs, bind-mounted back at the same paths
(so install paths, and every key that holds them, stay the same).
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "moved_argv",
    "moved_interpreter",
    "needed_paths",
    "open_python_steps",
    "user_argv",
    "user_private_group_steps",
]


def needed_paths() -> list[Path]:
    """What another uid must reach to run this interpreter with this environment's packages."""
    paths = [os.path.realpath(sys.executable), sys.prefix, sys.base_prefix]
    paths += [sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")]
    import adstore.store  # an editable install: the checkout itself

    paths.append(os.path.dirname(str(adstore.store.__file__)))
    return [Path(os.path.realpath(p)) for p in paths]


def _closed_ancestor(path: Path) -> tuple[Path, Path] | None:
    """The first directory from ``/`` down that others cannot enter, and its child on the way to ``path``."""
    for directory in reversed(path.parents):
        if not os.stat(directory).st_mode & 0o001:
            return directory, directory / path.relative_to(directory).parts[0]
    return None


def open_python_steps(stash: Path) -> list[str]:
    """Shell steps, run as root inside ``unshare -m``, after which any uid reaches this interpreter.

    ``stash`` is an empty directory others can reach; a mount point per
    covered directory is made in it.
    """
    covered: dict[Path, set[Path]] = {}
    for path in needed_paths():
        found = _closed_ancestor(path)
        if found is not None:
            covered.setdefault(found[0], set()).add(found[1])
    q = shlex.quote
    steps: list[str] = []
    for i, (closed, inners) in enumerate(sorted(covered.items())):
        kept = []
        for j, inner in enumerate(sorted(inners)):
            held = stash / f"{i}-{j}"
            held.mkdir(parents=True, exist_ok=True)
            steps.append(f"mount --bind {q(str(inner))} {q(str(held))}")
            kept.append((held, inner))
        steps.append(f"mount -t tmpfs -o mode=0755 tmpfs {q(str(closed))}")
        for held, inner in kept:
            steps += [f"mkdir -p {q(str(inner))}", f"mount --bind {q(str(held))} {q(str(inner))}"]
    return steps


def user_private_group_steps(uid: int, stash: Path) -> list[str]:
    """Shell steps, run as root inside ``unshare -m``, after which ``uid`` is a user ``u<uid>`` with its own
    user-private group ``u<uid>`` (gid ``uid``) in the user and group databases, as on a Debian host.

    A gid the group database does not know is not a private group (the trust rule), so umask 002 is safe
    only under a group the database names.  Copies of ``/etc/passwd`` and ``/etc/group`` with the entries
    added are bind-mounted over the originals, in the namespace only.
    """
    steps: list[str] = []
    for name, line, known in [
        ("passwd", f"u{uid}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin", _known(pwd.getpwuid, uid)),
        ("group", f"u{uid}:x:{uid}:", _known(grp.getgrgid, uid)),
    ]:
        if known:
            continue
        copy = stash / f"etc-{name}-{uid}"
        copy.write_text(Path(f"/etc/{name}").read_text() + line + "\n")
        copy.chmod(0o644)
        steps.append(f"mount --bind {shlex.quote(str(copy))} /etc/{name}")
    return steps


def _known(lookup: Callable[[int], object], number: int) -> bool:
    try:
        lookup(number)
    except KeyError:
        return False
    return True


def user_argv(uid: int | None, cmd: list[str], *, steps: list[str], stash: Path | None) -> list[str]:
    """``cmd`` as ``uid`` (its own user-private group, no others) in a private mount namespace after ``steps``.

    With ``uid`` given, the steps that open this interpreter to every user
    (:func:`open_python_steps`, holding in ``stash``) and that give ``uid``
    its user-private group (:func:`user_private_group_steps`) come first.
    """
    if uid is not None:
        if stash is None:
            raise ValueError("another uid needs a stash directory for the interpreter's closed directories")
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *cmd]
        stash.mkdir(parents=True, exist_ok=True)
        steps = [*open_python_steps(stash), *user_private_group_steps(uid, stash), *steps]
    if not steps:
        return cmd
    script = " && ".join([*steps, f"exec {shlex.join(cmd)}"])
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]


def moved_interpreter(base: Path) -> tuple[list[tuple[str, str]], str]:
    """This interpreter at another path, for a private mount namespace: (bind mounts in order, the python there).

    The interpreter's prefix (``sys.base_prefix``: torch, Python's headers)
    goes to ``base/py``; a venv (``sys.prefix``) to ``base/venv``, with a
    ``pyvenv.cfg`` whose ``home`` names the moved interpreter bound over its
    own, so ``torch.__file__`` and ``sysconfig``'s paths name the new place,
    as on a host whose venv was created there.  Makes the mount points.
    """
    py, exe = base / "py", Path(sys.executable)
    py.mkdir(parents=True, exist_ok=True)
    mounts = [(sys.base_prefix, str(py))]
    if sys.prefix == sys.base_prefix:
        return mounts, str(py / exe.relative_to(sys.base_prefix))
    venv, cfg = base / "venv", base / "pyvenv.cfg"
    venv.mkdir(exist_ok=True)
    lines = []
    for line in Path(sys.prefix, "pyvenv.cfg").read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == "home":
            line = f"home = {value.strip().replace(sys.base_prefix, str(py), 1)}"
        lines.append(line + "\n")
    cfg.write_text("".join(lines))
    mounts += [(sys.prefix, str(venv)), (str(cfg), str(venv / "pyvenv.cfg"))]
    return mounts, str(venv / exe.relative_to(sys.prefix))


def moved_argv(base: Path) -> tuple[list[str], str] | None:
    """:func:`moved_interpreter` as a command prefix (a private mount namespace) and the python to run after it.

    None without root and ``unshare -m``.
    """
    import shutil
    import subprocess

    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return None
    if subprocess.run([unshare, "-m", "--propagation", "private", "true"], check=False).returncode != 0:
        return None
    mounts, python = moved_interpreter(base)
    steps = [f"mount --bind {shlex.quote(source)} {shlex.quote(target)}" for source, target in mounts]
    script = " && ".join(steps) + ' && exec "$@"'
    return [unshare, "-m", "--propagation", "private", "sh", "-c", script, "sh"], python
