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

__all__ = ["needed_paths", "open_python_steps", "user_argv", "user_private_group_steps"]


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
