"""Simulated hosts for real vLLM runs: each run is a fresh ``vllm_run.py`` process in the vLLM venv.

Shared by ``bench_vllm.py`` and ``tests/integration/vllm_plugin/test_vllm_real.py``.
A host is ``inductor_hosts.host_env``'s store root, Inductor cache directory
and ``TMPDIR`` (with one compile thread), plus vLLM's cache root.

Compiles are counted by ``vllm_builds/sitecustomize.py`` (on the child's
``PYTHONPATH``, so it runs in the caller, the EngineCore, vLLM's worker and
any Inductor compile worker alike): every C++ compiler run with its target.
:func:`classify` (``bench_inductor``'s) sorts the targets into kernels,
ISA probes and the precompiled header.  A kernel is a ``.so`` Inductor built
in this run: a kernel adstore placed is never built, so "kernels compiled" on
a host fed from a remote is the count that must be zero.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration" / "inductor"))  # inductor_hosts
sys.path.insert(0, str(HERE))

from bench_inductor import classify  # noqa: E402
from inductor_hosts import host_env  # noqa: E402

__all__ = ["RUNNER", "vllm_host", "make_model", "moved_venv", "run_host", "store_counters"]

RUNNER = HERE / "vllm_run.py"
BUILDS = HERE / "vllm_builds"


def vllm_host(base: Path, name: str, **extra: str) -> dict[str, str]:
    """``host_env`` plus vLLM's cache root and the build log of host ``name`` under ``base``."""
    env = host_env(base, name, **extra)
    home = base / name
    env["VLLM_CACHE_ROOT"] = str(home / "vllm")
    env["ADSTORE_BUILDS_LOG"] = str(home / "builds.log")
    return env


def moved_venv(python: Path, base: Path) -> tuple[list[str], Path] | None:
    """The venv of ``python`` seen at ``base/venv`` (a bind mount in a private mount namespace).

    Returns (the command prefix, the python there), or None without root and
    ``unshare -m``.  A process started through it has ``sys.prefix``, vLLM's
    and torch's package directories under ``base/venv``, as on a host whose
    venv was made there.
    """
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return None
    if subprocess.run([unshare, "-m", "--propagation", "private", "true"], check=False).returncode != 0:
        return None
    venv = Path(python).parent.parent
    target = base / "venv"
    target.mkdir(parents=True, exist_ok=True)
    script = f'mount --bind {shlex.quote(str(venv))} {shlex.quote(str(target))} && exec "$@"'
    return [unshare, "-m", "--propagation", "private", "sh", "-c", script, "sh"], target / "bin" / Path(python).name


def _clean_env() -> dict[str, str]:
    """This shell's environment without any store, remote, Inductor or vLLM setting (each host sets its own)."""
    drop = ("ADSTORE_", "TORCHINDUCTOR_", "VLLM_", "PYTHONPATH")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def make_model(python: Path, directory: Path) -> None:
    """The tiny Llama of ``vllm_run.py``, written once into ``directory``."""
    if not (directory / "model.safetensors").exists():
        subprocess.run(
            [str(python), str(RUNNER), "make-model", str(directory)],
            env={**_clean_env(), "HF_HUB_OFFLINE": "1"},
            check=True,
            capture_output=True,
        )


def run_host(
    python: Path,
    model: Path,
    env: dict[str, str],
    *,
    adstore: bool,
    eager: bool = False,
    timeout: float = 1200,
    tp: int = 1,
    vllm_defaults: bool = False,
    argv_prefix: list[str] | None = None,
) -> dict[str, Any]:
    """One vLLM start on host ``env``: ``vllm_run.py``'s figures, the wall time, and the builds by kind.

    ``tp``: tensor_parallel_size; ``vllm_defaults``: vLLM's own settings (AOT compile on), see ``vllm_run.py``;
    ``argv_prefix``: what the command runs under (:func:`moved_venv`'s prefix, with its python as ``python``).
    """
    log = Path(env["ADSTORE_BUILDS_LOG"])
    log.unlink(missing_ok=True)
    child = {**_clean_env(), **env, "PYTHONPATH": str(BUILDS)}
    if not adstore:
        child["ADSTORE_VLLM"] = "0"
    vllm_log = log.with_name(f"vllm-{time.monotonic_ns()}.log")
    argv = [*(argv_prefix or []), str(python), str(RUNNER), "run", "--model", str(model), "--log", str(vllm_log)]
    if eager:
        argv.append("--eager")
    if tp > 1:
        argv += ["--tp", str(tp)]
    if vllm_defaults:
        argv.append("--vllm-defaults")
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=child, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = vllm_log.read_text(errors="replace")[-4000:] if vllm_log.exists() else ""
        raise RuntimeError(f"vllm_run failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{tail}")
    figures: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    targets = [line.split(" ", 1)[1] for line in log.read_text().splitlines()] if log.exists() else []
    figures.update(
        wall_s=wall,
        builds=classify(targets),
        kernel_targets=sorted(Path(t).name for t in targets if t.endswith(".so") and classify([t])["kernel"]),
        log=str(vllm_log),
    )
    return figures


def store_counters(root: str | Path, prefixes: tuple[str, ...] = ("inductor.", "remote.", "vllm.")) -> dict[str, int]:
    """The store's counters under ``prefixes`` (what the host's processes counted), read after the run."""
    from adstore.store import Store

    with Store.open(root) as store:
        return {k: v for k, v in store.stats().counters.items() if k.startswith(prefixes)}
