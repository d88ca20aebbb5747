"""Simulated fleet hosts on one machine, each as honest as the kernel allows: namespaces, uids, mounts.

A fleet is near-identical hosts, not twins.  Each host here is a fresh
process (``fleet_run.py``) with a store root, Inductor cache directory,
``TMPDIR`` and ``HOME`` of its own, fed by the builder's signed HTTP remote,
and differs from the builder (host A) by one thing, made real:

* ``twin`` (B): nothing;
* ``cpu_flags`` (C): ``/proc/cpuinfo`` without ``hypervisor`` and
  ``tsc_known_freq`` (bare metal against a VM, another kernel: same CPU,
  same ISA), bind-mounted over the real one in a private mount namespace;
* ``other_user`` (D): uid 1001 with umask 002 (``setpriv``), its
  directories its own;
* ``read_only`` (E): a frozen copy of A's store bind-mounted read-only (a
  store baked into an image), no remote;
* ``install_path`` (F): the same venv bind-mounted at another path and run
  from there (``sys.prefix``, torch's include directory and so Inductor's
  command lines differ).

Needs root (mount namespaces, other uids), as the tests and CI run.
Compiler runs: ``vllm_builds/sitecustomize.py`` logs every ``g++ ... -o``
of the child (``TORCHINDUCTOR_COMPILE_THREADS=1`` keeps them in it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "fleet_run.py"
sys.path[:0] = [str(HERE), str(HERE.parent)]
from bench_restart import started  # noqa: E402
from other_users import user_argv  # noqa: E402

from adstore.store import Store  # noqa: E402

BUILDS = HERE / "vllm_builds"  # the sitecustomize that logs compiler runs

__all__ = ["HOSTS", "Host", "Fleet", "edited_cpuinfo"]

#: kind -> (label, what differs from the builder).
HOSTS = {
    "builder": ("A", "the builder (cold, then its local warm restart)"),
    "twin": ("B", "nothing (a twin)"),
    "cpu_flags": ("C", "/proc/cpuinfo lacks hypervisor and tsc_known_freq"),
    "other_user": ("D", "another user (uid 1001, umask 002)"),
    "read_only": ("E", "A's store mounted read-only, no remote"),
    "install_path": ("F", "the same venv at another path"),
}
OTHER_UID = 1001
_DROP_FLAGS = ("hypervisor", "tsc_known_freq")
_UMASK_LAUNCHER = (
    "import os, runpy, sys; os.umask(int(sys.argv[1], 8)); sys.argv = sys.argv[2:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def edited_cpuinfo(text: str, drop: tuple[str, ...] = _DROP_FLAGS) -> str:
    """``/proc/cpuinfo`` text with ``drop`` removed from every ``flags`` line."""
    lines = []
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "flags":
            line = f"{name}: " + " ".join(f for f in value.split() if f not in drop)
        lines.append(line)
    return "\n".join(lines) + "\n"


@dataclass
class Host:
    """One host's environment, the mounts of its namespace, its uid and umask, and its Python."""

    kind: str
    env: dict[str, str]
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (source, target, read-only)
    uid: int | None = None
    stash: Path | None = None  # where the interpreter's closed directories are held for another uid
    umask: int | None = None
    python: str = sys.executable

    def argv(self, *args: str) -> list[str]:
        """The command line that starts ``fleet_run.py`` on this host (a namespace and uid only when needed)."""
        cmd = [self.python, str(RUNNER), *args]
        if self.umask is not None:
            # Set by the interpreter itself, before anything of the model runs, as a login shell's umask would be.
            cmd = [self.python, "-c", _UMASK_LAUNCHER, f"{self.umask:03o}", str(RUNNER), *args]
        steps = []
        for source, target, read_only in self.mounts:
            steps.append(f"mount --bind {shlex.quote(source)} {shlex.quote(target)}")
            if read_only:
                steps.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        return user_argv(self.uid, cmd, steps=steps, stash=self.stash)


class Fleet:
    """The builder's directories and remote, and a host of each kind beside it, under ``work``."""

    def __init__(self, work: Path, remote: dict[str, dict[str, str]]) -> None:
        self.work = work
        self.remote = remote
        clean = ("ADSTORE_", "TORCHINDUCTOR_", "PYTHONPATH", "TMPDIR", "HOME")
        self.base = {k: v for k, v in os.environ.items() if not k.startswith(clean)}

    def _dirs(self, name: str, uid: int | None = None) -> dict[str, str]:
        home = self.work / name
        for sub in ("tmp", "home", "inductor"):
            (home / sub).mkdir(parents=True, exist_ok=True)
        if uid is not None:
            for path in (home, *(home / s for s in ("tmp", "home", "inductor"))):
                os.chown(path, uid, uid)
        return {
            "ADSTORE_ROOT": str(home / "store"),
            "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"),
            "TMPDIR": str(home / "tmp"),
            "HOME": str(home / "home"),
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "PYTHONPATH": str(BUILDS),
            "ADSTORE_BUILDS_LOG": str(home / "builds.log"),
        }

    def host(self, kind: str) -> Host:
        """A host of ``kind`` (see :data:`HOSTS`), its directories made."""
        reader = self.remote["reader"]
        if kind == "builder":
            return Host(kind, {**self._dirs("a"), **self.remote["writer"]})
        if kind == "twin":
            return Host(kind, {**self._dirs("b"), **reader})
        if kind == "cpu_flags":
            cpuinfo = self.work / "c" / "cpuinfo"
            env = {**self._dirs("c"), **reader}
            cpuinfo.write_text(edited_cpuinfo(Path("/proc/cpuinfo").read_text()))
            return Host(kind, env, mounts=[(str(cpuinfo), "/proc/cpuinfo", True)])
        if kind == "other_user":
            env = {**self._dirs("d", uid=OTHER_UID), **reader}
            keys = Path(reader["ADSTORE_TRUSTED_KEYS"])
            keys.chmod(0o644)
            keys.parent.chmod(0o755)
            return Host(kind, env, uid=OTHER_UID, umask=0o002, stash=self.work / "python-stash")
        if kind == "read_only":  # a copy of A's store, frozen as an image build leaves it, mounted read-only
            env = self._dirs("e")
            mount, image = self.work / "e" / "store", self.work / "e" / "image-store"
            mount.mkdir(exist_ok=True)
            shutil.rmtree(image, ignore_errors=True)
            shutil.copytree(self.work / "a" / "store", image, symlinks=True)
            with Store.open(image, create=False) as store:
                store.freeze()
            return Host(kind, env, mounts=[(str(image), str(mount), True)])
        if kind == "install_path":
            venv = Path(sys.prefix)
            elsewhere = self.work / "f" / "venv-elsewhere"
            env = {**self._dirs("f"), **reader}
            elsewhere.mkdir(exist_ok=True)
            python = elsewhere / Path(sys.executable).relative_to(venv)
            return Host(kind, env, mounts=[(str(venv), str(elsewhere), True)], python=str(python))
        raise ValueError(f"no host kind {kind!r}")

    def run(self, host: Host, *args: str, timeout: float = 900) -> dict[str, Any]:
        """One start on ``host``: seconds to the first output, what the child said, and its compiler runs."""
        log = Path(host.env["ADSTORE_BUILDS_LOG"])
        log.unlink(missing_ok=True)
        if host.uid is not None:
            log.touch()
            os.chown(log, host.uid, host.uid)
        seconds, first, code, err = started(host.argv(*args), {**self.base, **host.env}, timeout)
        if code != 0 or first is None:
            raise RuntimeError(f"host {host.kind} failed ({code}):\n{err}")
        logged = log.read_text().splitlines() if log.exists() else []
        targets = [line.split(" ", 1)[1] for line in logged if " " in line]
        # ``g++ -E`` of the precompiled header (``.i``) preprocesses in every process: not a compile.
        compiled = [t for t in targets if not t.endswith(".i")]
        first.update(seconds=seconds, compiler_runs=len(compiled), compiler_targets=compiled, stderr=err)
        return first

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
