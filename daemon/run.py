"""``adstore run [--root DIR] [--remote URL] [--mode M] [--seed DIR] -- CMD [ARGS…]``: any program, no edit.

``run`` puts ``ADSTORE_ENABLE=1`` and the store's settings in the
environment and replaces itself with ``CMD`` (exec, as ``ddtrace-run`` and
``opentelemetry-instrument`` do: signals, the exit status and the process id
are the program's own).  Every Python process the program starts inherits
the variables, and the ``adstore-enable.pth`` file the package installs in
site-packages makes each of them enable adstore when it imports torch's
compiler (:mod:`adstore.integration.autoenable`).  The flags name what the
variables name (``--root`` ``ADSTORE_ROOT``, ``--remote`` ``ADSTORE_REMOTE``,
``--mode`` ``ADSTORE_REMOTE_MODE``, ``--seed`` ``ADSTORE_SEED``), so an image
can set the variables instead of wrapping its entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import site
import sys
from collections.abc import Mapping
from pathlib import Path

from adstore.daemon.commands import Context
from adstore.daemon.errors import UsageError

__all__ = ["BOOTSTRAP", "add_run_arguments", "cmd_run", "run_environment", "bootstrap_installed"]

log = logging.getLogger(__name__)

#: The start-up file ``pip install`` puts in site-packages (setup.py); ``site`` runs its line in every interpreter.
BOOTSTRAP = "adstore-enable.pth"


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``run`` (``--root`` is common to every command) and the command after ``--``."""
    p.add_argument("--remote", metavar="URL", help="the remote tier, s3://… or http(s)://… (sets ADSTORE_REMOTE)")
    p.add_argument(
        "--mode", choices=["read", "read-write"], help="read or read-write remote (sets ADSTORE_REMOTE_MODE)"
    )
    p.add_argument("--seed", metavar="DIR", help="a read-only seed store to read first (sets ADSTORE_SEED)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS …]", help="the program to run")


def run_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``ADSTORE_ENABLE=1`` and the variables the flags name (paths made absolute)."""
    env = dict(environ)
    env["ADSTORE_ENABLE"] = "1"
    root = getattr(args, "root", None)
    if root is not None:
        env["ADSTORE_ROOT"] = str(Path(root).expanduser().absolute())
    if args.seed:
        env["ADSTORE_SEED"] = str(Path(args.seed).expanduser().absolute())
    if args.remote:
        env["ADSTORE_REMOTE"] = args.remote
    if args.mode:
        env["ADSTORE_REMOTE_MODE"] = args.mode
    return env


def bootstrap_installed() -> bool:
    """Whether this interpreter's site-packages hold ``adstore-enable.pth`` (an install older than ``run`` does not)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any(Path(d, BOOTSTRAP).is_file() for d in dirs)


def cmd_run(args: argparse.Namespace, ctx: Context) -> int:
    """Exec ``CMD`` with adstore enabled in every Python process it starts; returns only on an error."""
    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise UsageError("give the program to run: adstore run [OPTIONS] -- CMD [ARGS …]", prog="adstore run")
    if not bootstrap_installed():
        log.warning(
            "%s is not in this Python's site-packages (%s): reinstall adstore (pip install adstore, or "
            "pip install -e . in a checkout), or Python programs will run without adstore",
            BOOTSTRAP,
            sys.prefix,
        )
    env = run_environment(args, os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        raise UsageError(f"{argv[0]}: command not found", prog="adstore run") from None
    return 0  # not reached: exec replaced the process
